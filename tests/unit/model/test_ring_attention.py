"""Ring attention (parallel.cp) in one process: every cp rank of the ring simulated in its own
thread (`tests/ring_sim.py`), its output and gradients (the ring's own backward) against the
SDPA path over the whole row."""

import pytest
import torch

from ds_omni.model import ring_attention as ra
from ds_omni.model.attention import _sdpa_per_sample
from ds_omni.parallel.zigzag import zigzag_layout
from tests import plants
from tests.ring_sim import simulate


def _row(lengths, cp, ulysses, heads=4, kv_heads=2, dim=8, seed=0):
    layout = zigzag_layout(lengths, cp, ulysses)
    total = len(layout.order)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]
                      + ([total] if layout.pad else []), dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, total, kv_heads, dim, generator=g, dtype=torch.float64,
                        requires_grad=True) for _ in range(2))
    return layout, cu, q, k, v


def check_against_sdpa(lengths, cp, ulysses, window=None, spans=None, tol=1e-10, **kwargs):
    """The simulated ring's output and q/k/v gradients equal the SDPA path's over the row."""
    layout, cu, q, k, v = _row(lengths, cp, ulysses)
    blocks = torch.tensor(spans) if spans else None
    want = _sdpa_per_sample(*(t.transpose(1, 2) for t in (q, k, v)), cu, None, 0.0, window,
                            blocks)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2),
                          dtype=want.dtype)
    index = torch.as_tensor(layout.ring_index())
    got, grads = simulate(q, k, v, index, cu, weights, window=window, blocks=blocks, **kwargs)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g_ring, g_sdpa in zip(grads, torch.autograd.grad((want * weights).sum(), (q, k, v))):
        torch.testing.assert_close(g_ring, g_sdpa, rtol=tol, atol=tol)


@pytest.mark.parametrize("cp,ulysses", [(2, 1), (2, 2), (3, 1), (4, 2)])
@pytest.mark.parametrize("window,spans", [(None, None), (4, None), (None, [[3, 7], [20, 25]])])
def test_ring_equals_sdpa_with_gradients(cp, ulysses, window, spans):
    check_against_sdpa([9, 2, 17, 11], cp, ulysses, window, spans)


def test_merge_is_order_free_and_exact():
    """Two blocks merged by log-sum-exp equal one softmax over both, in either order."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    allowed = torch.ones(6, 6, dtype=torch.bool)
    whole, whole_lse = ra.block_attention(q, k, v, allowed, 0.5)
    a, b = (ra.block_attention(q, k[s], v[s], allowed[:, s], 0.5) for s in (slice(0, 2),
                                                                          slice(2, 6)))
    for first, second in ((a, b), (b, a)):
        out, lse = ra.merge(*first, *second)
        torch.testing.assert_close(out, whole)
        torch.testing.assert_close(lse, whole_lse)


def test_a_block_nobody_sees_adds_nothing():
    q, k, v = (torch.randn(3, 2, 4) for _ in range(3))
    out, lse = ra.block_attention(q, k, v, torch.zeros(3, 3, dtype=torch.bool), 1.0)
    assert not out.any() and torch.isinf(lse).all()


def _ring_equals_sdpa(monkeypatch):
    for cp in (2, 3):
        test_ring_equals_sdpa_with_gradients(cp, 1, None, None)


def _zigzag_balanced(monkeypatch):
    from tests.unit.parallel.test_zigzag import test_causal_work_is_even
    test_causal_work_is_even(2)


def _varlen_plan_exact(monkeypatch):
    from tests.unit.model.test_ring_backward import test_varlen_plan_reproduces_every_ring_block
    test_varlen_plan_reproduces_every_ring_block(2, 4, None)


CAUGHT_BY = {"ring_lse_merge_wrong": _ring_equals_sdpa, "ring_step_skipped": _ring_equals_sdpa,
             "ring_causal_local": _ring_equals_sdpa, "zigzag_chunk_wrong_rank": _zigzag_balanced,
             "ring_bwd_block_lse": _ring_equals_sdpa, "ring_dkv_not_home": _ring_equals_sdpa,
             "ring_varlen_window_shifted": _varlen_plan_exact}


def test_every_ring_plant_has_a_check():
    assert sorted(CAUGHT_BY) == plants.for_launch("ring")


@pytest.mark.parametrize("plant", plants.for_launch("ring"))
def test_plant_is_caught(plant, monkeypatch):
    """The checks above pass honestly and fail with each planted error of the ring."""
    CAUGHT_BY[plant](monkeypatch)
    with plants.applied(plant, 0), pytest.raises(AssertionError):
        CAUGHT_BY[plant](monkeypatch)
