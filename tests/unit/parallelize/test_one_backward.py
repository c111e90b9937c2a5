"""`one_backward`: DeepSpeed's backward of a stage with two floating outputs (the hidden states
and the carried aux probabilities) walks the graph they share once, with the same gradients."""

from types import SimpleNamespace

import torch

from ds_omni.parallelize.pipeline_moe import one_backward


class Counted(torch.autograd.Function):
    """Identity whose backward counts its calls (the shared part of a stage's graph)."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Counted.calls += 1
        return grad


def _stage_backward(last: bool, wrap: bool) -> tuple[int, torch.Tensor]:
    """DeepSpeed's `_exec_backward_pass` loop over a stage's floating outputs (hidden, probs)."""
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    shared = Counted.apply(torch.randn(5, 4) @ w)  # [5, 3]: below the router
    outs = [shared * 2.0, shared.softmax(-1).sum(0, keepdim=True)]  # hidden, probs [1, 3]
    grads = [torch.randn(5, 3), torch.randn(1, 3)]
    Counted.calls = 0
    engine = SimpleNamespace(is_last_stage=lambda: last)
    with one_backward(engine) if wrap else torch.enable_grad():
        for i, (out, grad) in enumerate(zip(outs, grads)):
            out.backward(gradient=grad, retain_graph=i < len(outs) - 1)
    return Counted.calls, w.grad


def test_a_stage_backward_walks_the_shared_graph_once_with_the_same_gradients():
    original = torch.Tensor.backward
    calls_before, grad_before = _stage_backward(last=False, wrap=False)
    calls, grad = _stage_backward(last=False, wrap=True)
    assert (calls_before, calls) == (2, 1)
    torch.testing.assert_close(grad, grad_before)
    assert torch.Tensor.backward is original  # restored
    assert _stage_backward(last=True, wrap=True)[0] == 2  # the last stage's: DeepSpeed's own
