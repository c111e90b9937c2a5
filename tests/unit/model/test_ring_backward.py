"""The ring's own backward (`RingAttention`) against autograd through the pure-torch blocks (the
ring's `backward="autograd"` path), cp 1 / 2 / 4 simulated in one process with GQA, a sliding
window and image blocks; the CPU flash kernel against pure torch; the CUDA kernel's varlen plan
against the masks it must reproduce (the kernel itself: benchmarks/gpu_check_ring.py on a GPU).
The planted errors of the backward and the varlen plan are caught in test_ring_attention.py
(`CAUGHT_BY`)."""

import pytest
import torch

from ds_omni.model import ring_attention as ra
from ds_omni.model import ring_varlen
from ds_omni.model.ring_kernels import TorchBlock, _fold_heads, _heads
from ds_omni.model.ring_varlen import varlen_plan
from ds_omni.parallel.zigzag import zigzag_layout
from tests.ring_sim import simulate
from tests.unit.model.test_ring_attention import _row, check_against_sdpa

LENGTHS = [9, 2, 17, 11]
MASKS = [(None, None), (4, None), (None, [[3, 7], [20, 25]])]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("window,spans", MASKS)
def test_ring_backward_equals_autograd(cp, window, spans):
    """Same output and q/k/v gradients as autograd through the same blocks (float64)."""
    layout, cu, q, k, v = _row(LENGTHS, cp, 1, heads=4, kv_heads=2)
    index = torch.as_tensor(layout.ring_index())
    blocks = torch.tensor(spans) if spans else None
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    runs = [simulate(q, k, v, index, cu, weights, window=window, blocks=blocks, backward=how)
            for how in ("ring", "autograd")]
    (out, grads), (want_out, want_grads) = runs
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_direct_calls_equal_autograd_engine():
    """`simulate(direct=True)` (what benchmarks/gpu_check_ring.py runs on CUDA) gives what the
    autograd engine gives."""
    layout, cu, q, k, v = _row(LENGTHS, 4, 1)
    index = torch.as_tensor(layout.ring_index())
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=q.dtype)
    (out, grads), (want, want_grads) = (simulate(q, k, v, index, cu, weights, window=4,
                                                 direct=direct) for direct in (True, False))
    assert torch.equal(out, want) and all(map(torch.equal, grads, want_grads))


@pytest.mark.parametrize("window,spans", MASKS)
def test_cpu_flash_kernel_equals_sdpa(window, spans):
    """torch's CPU flash kernel as the ring's block kernel, float64 (mask passed additively)."""
    check_against_sdpa(LENGTHS, 2, 1, window, spans, kernel="cpu_flash")


def _varlen_mask(g) -> torch.Tensor:
    """[nq, nk] what one varlen call lets its gathered queries see: flash's bottom-right aligned
    window (left, right) inside each sequence of cu_seqlens, nothing across them."""
    mask = torch.zeros(int(g.cu_q[-1]), int(g.cu_k[-1]), dtype=torch.bool)
    for s in range(len(g.cu_q) - 1):
        (q0, q1), (k0, k1) = g.cu_q[s:s + 2].tolist(), g.cu_k[s:s + 2].tolist()
        nq, nk = q1 - q0, k1 - k0
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        seen = torch.ones(nq, nk, dtype=torch.bool)
        if g.right >= 0:
            seen &= j <= i + nk - nq + g.right
        if g.left >= 0:
            seen &= j >= i + nk - nq - g.left
        mask[q0:q1, k0:k1] = seen
    return mask


def _plan_mask(groups, shape) -> torch.Tensor:
    """The block mask the varlen calls apply, each (query, key) pair at most once."""
    count = torch.zeros(shape, dtype=torch.long)
    for g in groups:
        pairs = _varlen_mask(g).nonzero()
        count.index_put_((g.q_idx[pairs[:, 0]], g.k_idx[pairs[:, 1]]),
                         torch.ones(len(pairs), dtype=torch.long), accumulate=True)
    assert count.max() <= 1, "a pair seen twice"
    return count.bool()


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("window,spans", MASKS)
def test_varlen_plan_reproduces_every_ring_block(cp, window, spans):
    """For every (rank, step) block of a zigzag row, the CUDA kernel's varlen calls see exactly
    the pairs `ring_mask` allows, each once."""
    layout = zigzag_layout(LENGTHS, cp)
    index = torch.as_tensor(layout.ring_index())
    bounds = torch.tensor([0, 9, 11, 28, 39, len(layout.order)])
    blocks = torch.tensor(spans) if spans else None
    for rank in range(cp):
        for source in range(cp):
            allowed = ra.ring_mask(index[rank], index[source], bounds, window, blocks)
            groups = varlen_plan(allowed)
            assert groups is not None, (rank, source)
            assert torch.equal(_plan_mask(groups, allowed.shape), allowed), (rank, source)


def test_varlen_plan_refuses_what_flash_cannot_do():
    """A row whose keys are not contiguous: no plan (the kernel runs pure torch there)."""
    allowed = torch.tensor([[True, False, True], [True, True, True]])
    assert varlen_plan(allowed) is None
    assert varlen_plan(torch.zeros(2, 3, dtype=torch.bool)) == []


def _emulated_flash(monkeypatch):
    """torch's varlen flash calls done by pure torch with flash's masks (`_varlen_mask`), and
    every block planned, so `CudaFlashBlock`'s gathering and summing run on CPU."""
    def forward(q, k, v, g, scaling):
        out, lse = TorchBlock.dense_forward(q, _heads(k, q.shape[1]), _heads(v, q.shape[1]),
                                            _varlen_mask(g), scaling)
        return out, lse, None, None

    def backward(dout, q, k, v, out, lse, g, scaling, rng):
        dq, dk, dv = TorchBlock.dense_backward(dout, q, _heads(k, q.shape[1]),
                                               _heads(v, q.shape[1]), out, lse, _varlen_mask(g),
                                               scaling)
        return dq, _fold_heads(dk, k.shape[1]), _fold_heads(dv, k.shape[1])
    monkeypatch.setattr(ring_varlen, "_flash_forward", forward)
    monkeypatch.setattr(ring_varlen, "_flash_backward", backward)
    monkeypatch.setattr(ring_varlen.CudaFlashBlock, "plan",
                        staticmethod(lambda q, allowed: varlen_plan(allowed)))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window,spans", MASKS)
def test_cuda_kernel_plumbing_with_emulated_flash(cp, window, spans, monkeypatch):
    """`CudaFlashBlock` over the ring with flash's calls emulated: equal to SDPA (float64)."""
    _emulated_flash(monkeypatch)
    check_against_sdpa(LENGTHS, cp, 1, window, spans, kernel="cuda_flash")


def test_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="cpu_flash"):
        ra.kernel_for(torch.device("cpu"), "flash3")
