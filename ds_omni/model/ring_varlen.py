"""(c) The ring's block kernel on CUDA: torch's varlen flash kernel (`aten._flash_attention_forward`
/ `_flash_attention_backward`, with cu_seqlens and windows), which returns the log-sum-exp.

A block's mask (`ring_attention.ring_mask`: packed samples, causal by row position, windows,
image blocks) is not one varlen call's: `varlen_plan` reads it row by row. Each query row that
sees a key sees a contiguous range [lo, hi) of the block's keys (the keys of a rank keep their row
order); consecutive rows whose ranges move alike (hi fixed or +1 a row, lo fixed or +1 a row) form
a run, one varlen sequence over its key range, flash's bottom-right aligned window
(left, right: -1 none, right 0 causal) giving each row its range. Runs of the same window go in
one call; a key may sit in several runs (its gradients are summed). The plan is checked row by
row against the mask; a mask it cannot express, float32 inputs (flash takes 16-bit) or a head dim
flash lacks run `TorchBlock`. Checked on a GPU by benchmarks/gpu_check_ring.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_omni.model.ring_kernels import TorchBlock, work_dtype


@dataclass
class VarlenGroup:
    """One varlen call: the block rows and columns it gathers (run by run) and its arguments."""

    q_idx: torch.Tensor  # [nq] block rows
    k_idx: torch.Tensor  # [nk] block columns (one may repeat in several runs)
    cu_q: torch.Tensor  # int32 [runs + 1]
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    left: int  # window_size_left: -1 none
    right: int  # window_size_right: 0 causal (bottom-right), -1 none


def _ranges(allowed: torch.Tensor):
    """(rows, lo, hi) of the rows that see a key: each one's first and past-last key; None when
    a row's keys are not contiguous."""
    rows = allowed.any(1).nonzero()[:, 0]
    if not len(rows):
        return rows, rows, rows
    seen = allowed.index_select(0, rows).to(torch.uint8)  # [r, K]
    lo = seen.argmax(1)
    hi = seen.shape[1] - seen.flip(1).argmax(1)
    if not torch.equal(seen.sum(1, dtype=torch.long), hi - lo):
        return None
    return rows, lo, hi


def _run_starts(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """[r] bool, True where a run starts: the step from the row before is not (hi +0/+1, lo
    +0/+1), or hi's step changes, or lo stops sliding."""
    dh, dl = hi[1:] - hi[:-1], lo[1:] - lo[:-1]  # dh[j]: row j -> j + 1
    valid = ((dh == 0) | (dh == 1)) & ((dl == 0) | (dl == 1))
    starts = torch.ones(len(lo), dtype=torch.bool, device=lo.device)
    starts[1:] = ~valid
    starts[2:] |= valid[:-1] & ((dh[1:] != dh[:-1]) | ((dl[:-1] == 1) & (dl[1:] == 0)))
    return starts


def _run_windows(lo, hi, starts):
    """Per run: its first key L, key count nk, row count nq, window (left, right); and per row
    its run. None when flash's window would not give some row its exact range."""
    first = starts.nonzero()[:, 0]
    last = torch.cat([first[1:] - 1, first.new_tensor([len(lo) - 1])])
    run = starts.long().cumsum(0) - 1  # [r]
    L, nq = lo[first], last - first + 1
    nk = hi[last] - L
    step = hi[torch.clamp(first + 1, max=len(hi) - 1)] - hi[first]
    right = torch.where((nq > 1) & (step == 1), 0, -1)
    left = torch.where(lo[last] != L, nk - 1 - (lo[last] - L), -1)
    offset = torch.arange(len(lo), device=lo.device) - first[run] + nk[run] - nq[run]
    want_hi = torch.where(right[run] == 0, offset + 1, nk[run])
    want_lo = torch.where(left[run] >= 0, (offset - left[run]).clamp(min=0), 0)
    if not (torch.equal(want_hi, hi - L[run]) and torch.equal(want_lo, lo - L[run])):
        return None
    return L, nk, nq, left, right, run


def varlen_plan(allowed: torch.Tensor) -> list[VarlenGroup] | None:
    """The varlen calls that compute the block of mask `allowed` [Cq, K] exactly (module
    docstring), or None when they cannot."""
    ranges = _ranges(allowed)
    if ranges is None:
        return None
    rows, lo, hi = ranges
    if not len(rows):
        return []
    found = _run_windows(lo, hi, _run_starts(lo, hi))
    if found is None:
        return None
    L, nk, nq, left, right, run = found
    kinds, kind_of = torch.unique(torch.stack([left, right], 1), dim=0, return_inverse=True)
    groups = []
    for g, (win_left, win_right) in enumerate(kinds.tolist()):
        mine = (kind_of == g).nonzero()[:, 0]  # runs of this window, in row order
        lens = nk[mine]
        starts = torch.repeat_interleave(L[mine], lens)
        k_idx = starts + torch.arange(len(starts), device=lo.device) - torch.repeat_interleave(
            lens.cumsum(0) - lens, lens)
        cu = [torch.cat([n.new_zeros(1), n.cumsum(0)]).to(torch.int32) for n in (nq[mine], lens)]
        groups.append(VarlenGroup(q_idx=rows[kind_of[run] == g], k_idx=k_idx, cu_q=cu[0],
                                  cu_k=cu[1], max_q=int(nq[mine].max()), max_k=int(lens.max()),
                                  left=int(win_left), right=int(win_right)))
    return groups


def _flash_forward(q, k, v, g: VarlenGroup, scaling: float):
    """One varlen call: (out [nq, h, D], lse [h, nq] float32, rng_state, unused)."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, g.cu_q, g.cu_k, g.max_q, g.max_k, 0.0, g.right == 0, False, scale=scaling,
        window_size_left=g.left, window_size_right=g.right)
    if lse.dim() != 2:
        raise RuntimeError(f"torch's varlen flash kernel returned an lse of shape "
                           f"{tuple(lse.shape)}, not [heads, tokens]; use ring kernel 'torch'")
    return out, lse, rng_state, unused


def _flash_backward(dout, q, k, v, out, lse, g: VarlenGroup, scaling: float, rng):
    """One varlen call's backward with the ring's final out and lse -> (dq, dk, dv)."""
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, g.cu_q, g.cu_k, g.max_q, g.max_k, 0.0, g.right == 0, *rng,
        scale=scaling, window_size_left=g.left, window_size_right=g.right)


class CudaFlashBlock:
    """(c) The ring's block on torch's CUDA varlen flash kernel (module docstring); forward and
    backward take the `ring_kernels` interface, backward with the ring's final out and lse."""

    name = "cuda_flash"

    def __init__(self):
        self.fallback = TorchBlock()
        self.rng = None  # (rng_state, unused) of a forward call: dropout is 0, never read

    @staticmethod
    def plan(q: torch.Tensor, allowed: torch.Tensor) -> list[VarlenGroup] | None:
        """The block's varlen calls, or None where flash cannot run it (module docstring)."""
        usable = (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
                  and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)
        return varlen_plan(allowed) if usable else None

    def forward(self, q, k, v, allowed, scaling):
        groups = self.plan(q, allowed)
        if groups is None:
            return self.fallback.forward(q, k, v, allowed, scaling)
        work = work_dtype(q.dtype)  # float32 for flash's 16-bit inputs
        out = q.new_zeros(q.shape, dtype=work)
        lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=work)
        for g in groups:
            o, l, *self.rng = _flash_forward(q[g.q_idx], k[g.k_idx], v[g.k_idx], g, scaling)
            out[g.q_idx] = o.to(work)
            lse[:, g.q_idx] = l.to(work)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, allowed, scaling):
        groups = self.plan(q, allowed)
        if groups is None:
            return self.fallback.backward(dout, q, k, v, out, lse, allowed, scaling)
        grads = [q.new_zeros(t.shape, dtype=work_dtype(q.dtype)) for t in (q, k, v)]
        rng = self.rng or (torch.zeros(2, dtype=torch.int64, device=q.device),
                           torch.empty(0, device=q.device))
        for g in groups:
            dq, dk, dv = _flash_backward(
                dout[g.q_idx].to(q.dtype), q[g.q_idx], k[g.k_idx], v[g.k_idx],
                out[g.q_idx].to(q.dtype), lse[:, g.q_idx].contiguous(), g, scaling, rng)
            for grad, idx, part in zip(grads, (g.q_idx, g.k_idx, g.k_idx), (dq, dk, dv)):
                grad.index_add_(0, idx, part.to(grad.dtype))
        return tuple(grads)
