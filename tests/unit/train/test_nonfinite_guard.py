"""`NonFiniteGuard`'s gradient watch on its own (one process, a stand-in engine): a NaN, +inf
or -inf in any gradient of any micro-batch trips it, finite gradients of any size do not, and a
check resets it. The whole skip/stop path on real engines: tests/dist/test_fault_tolerance.py."""

from __future__ import annotations

import pytest
import torch

from ds_omni.train.nonfinite import NonFiniteGuard


class _Engine:
    device = torch.device("cpu")

    def __init__(self, module):
        self.module = module

    def fp16_enabled(self):
        return False


def _model_and_guard():
    """A two-layer model whose second weight's gradient can be planted with a value (`planted`,
    elements [1, 2:]; None: as computed), and its guard, whose hooks run after the planting one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model.planted = None

    def plant(g):
        if model.planted is None:
            return g
        g = g.clone()
        g[1, 2:] = model.planted
        return g
    model[1].weight.register_hook(plant)
    return model, NonFiniteGuard(_Engine(model))


def _micro_batch(guard, model, scale: float = 1.0):
    loss = (model(torch.ones(3, 4)) * scale).sum()
    guard.watch_loss(loss)
    loss.backward()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("micro_batch", [0, 2])
def test_a_nonfinite_gradient_in_any_micro_batch_trips_the_guard(bad, micro_batch):
    model, guard = _model_and_guard()
    for i in range(3):
        model.planted = bad if i == micro_batch else None
        _micro_batch(guard, model)
    assert guard.tripped()
    model.planted = None
    _micro_batch(guard, model)
    assert not guard.tripped()  # a check resets it


def test_finite_gradients_do_not_trip_it_whatever_their_size():
    model, guard = _model_and_guard()
    model.planted = 3e38
    _micro_batch(guard, model)
    grad = model[1].weight.grad
    assert torch.isfinite(grad).all() and not torch.isfinite(grad.sum())  # a sum would overflow
    assert not guard.tripped()
