"""Ring attention (parallel.cp) over a packed row's zigzag shards, merged by log-sum-exp.

Each cp rank holds the tokens `ds_omni.parallel.zigzag` gives it (after Ulysses gathered them
from its sp ranks, with its share of the heads). At step j of the ring a rank attends its queries
to the key/value block of rank (rank - j) mod cp and folds the result into its running output:
out = sum_b out_b x exp(lse_b - lse), lse = logaddexp over the blocks. Which query may see which
key is read from the row positions of both (`ring_mask`: the same sample, causal or inside one
bidirectional block, within the sliding window; the SDPA path's masks, so the same numbers).
Backward is the ring's own (`RingAttention`, as ring-flash-attn): the blocks go around again with
their gradient accumulators, each block's kernel backward run with the FINAL out and lse, so no
lse gradient is needed and any kernel returning an lse serves (`ds_omni.model.ring_kernels`; on
CUDA torch's varlen flash kernel); only q, k, v, out, lse are kept. `backward="autograd"`
differentiates the pure-torch blocks and `RingPass` (the reference). yunchang's torch backends
return an all-zero lse. Dims: C tokens of this cp rank, h query heads, hkv KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_omni.model.ring_kernels import CpuFlashBlock, TorchBlock, block_attention
from ds_omni.model.ring_varlen import CudaFlashBlock
from ds_omni.parallel.evidence import SPCounts, register
from ds_omni.parallel.ring import RingGroup, RingPass, pass_on

__all__ = ["block_attention", "merge", "ring_attention", "ring_mask", "RingAttention"]

register("cp", ring_steps="ring-attention passes: key/value blocks this rank sent to the next "
         "rank", ring_bytes="bytes of those blocks")


def _sample_of(positions: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """[n] the sample (index into `bounds`, the row's cu_seqlens) of each row position."""
    return torch.searchsorted(bounds, positions, right=True)


def _block_of(positions: torch.Tensor, spans: torch.Tensor | None) -> torch.Tensor:
    """[n] the bidirectional span (row of `spans` [m, 2]) holding each position, -1 for none."""
    if spans is None or not len(spans):
        return torch.full_like(positions, -1)
    inside = (positions[:, None] >= spans[None, :, 0]) & (positions[:, None] < spans[None, :, 1])
    return torch.where(inside.any(1), inside.int().argmax(1), -1)  # [n]


def ring_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, bounds: torch.Tensor,
              window: int | None = None, spans: torch.Tensor | None = None) -> torch.Tensor:
    """[Cq, K] bool, True where the query at row position q_pos[i] may see the key at k_pos[j]:
    (causal OR same block) AND same sample AND (k > q - window); `sample_mask`'s rule read from
    row positions, so it holds for any two shards of the row."""
    allowed = k_pos[None, :] <= q_pos[:, None]  # [Cq, K]
    q_block, k_block = _block_of(q_pos, spans), _block_of(k_pos, spans)
    allowed |= (q_block[:, None] == k_block[None, :]) & (q_block[:, None] >= 0)
    allowed &= _sample_of(q_pos, bounds)[:, None] == _sample_of(k_pos, bounds)[None, :]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge: (out [C, h, D], lse [h, C]) over the keys so far and over a new
    block -> over both. `out` must have a finite lse (a rank's own block, first, gives every
    query its own token)."""
    both = torch.logaddexp(lse, lse_b)  # [h, C]
    keep = torch.exp(lse - both).transpose(0, 1)[..., None]  # [C, h, 1]
    add = torch.exp(lse_b - both).transpose(0, 1)[..., None]
    return out * keep + out_b * add, both


KERNELS = {"torch": TorchBlock, "cpu_flash": CpuFlashBlock, "cuda_flash": CudaFlashBlock}


def kernel_for(device: torch.device, name: str | None = None):
    """A block kernel (`ds_omni.model.ring_kernels`) by `name`; default: torch's varlen flash
    kernel on CUDA, pure torch elsewhere."""
    name = name or ("cuda_flash" if torch.device(device).type == "cuda" else "torch")
    if name not in KERNELS:
        raise ValueError(f"no ring block kernel {name!r}; use one of {sorted(KERNELS)}")
    return KERNELS[name]()


@dataclass
class RingSpec:
    """What every step of one ring attention needs besides q, k, v: the ring, the row positions
    of every cp rank's tokens (`index` [cp, C]), the row's sample bounds, window and bidirectional
    spans, the scaling, the block kernel and the evidence counters."""

    ring: RingGroup
    index: torch.Tensor
    bounds: torch.Tensor
    window: int | None
    spans: torch.Tensor | None
    scaling: float
    kernel: object
    counts: SPCounts | None = None

    def allowed(self, step: int) -> torch.Tensor:
        """[C, C] the mask of this rank's queries against the block that arrives at `step`."""
        source = (self.ring.rank - step) % self.ring.size  # whose block this is
        return ring_mask(self.index[self.ring.rank], self.index[source], self.bounds,
                         self.window, self.spans)

    def count(self, kv: torch.Tensor) -> None:
        if self.counts is not None:
            self.counts.ring_steps += 1
            self.counts.ring_bytes += kv.numel() * kv.element_size()


def _block_grads(kernel, dout, q, k, v, out, lse, allowed, scaling):
    """One block's (dq, dk, dv): its kernel's backward with the ring's final out and lse."""
    return kernel.backward(dout, q, k, v, out, lse, allowed, scaling)


def _pass_grads(dkv: torch.Tensor, ring: RingGroup, last: bool) -> torch.Tensor:
    """The key/value gradient accumulator on to the next rank, the one of the block that arrives
    next in (after the last step: each rank's own accumulator, home)."""
    return pass_on(dkv, ring, tag=1).wait()


class RingAttention(torch.autograd.Function):
    """q [C, h, D], k/v [C, hkv, D] of this cp rank -> out [C, h, D]: the ring's forward (blocks
    merged by lse) and its own backward (module docstring); each step's pass overlaps its block."""

    @staticmethod
    def forward(ctx, q, k, v, spec: RingSpec):
        ring, kernel = spec.ring, spec.kernel
        kv = torch.stack([k, v])  # [2, C, hkv, D]: one message a step
        out = lse = None
        for step in range(ring.size):
            pending = pass_on(kv, ring) if step + 1 < ring.size else None
            out_b, lse_b = kernel.forward(q, kv[0], kv[1], spec.allowed(step), spec.scaling)
            out, lse = (out_b, lse_b) if out is None else merge(out, lse, out_b, lse_b)
            if pending is not None:
                kv = pending.wait()
                spec.count(kv)
        out = out.to(q.dtype)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        spec = ctx.spec
        ring, kernel = spec.ring, spec.kernel
        kv = torch.stack([k, v])
        dq = dkv = None
        for step in range(ring.size):
            pending = pass_on(kv, ring) if step + 1 < ring.size else None
            dq_b, dk_b, dv_b = _block_grads(kernel, dout, q, kv[0], kv[1], out, lse,
                                            spec.allowed(step), spec.scaling)
            dq = dq_b if dq is None else dq + dq_b
            dkv = torch.stack([dk_b, dv_b]) if dkv is None else dkv + torch.stack([dk_b, dv_b])
            if ring.size > 1:  # the accumulator goes with its block; after the last step, home
                dkv = _pass_grads(dkv, ring, last=step + 1 == ring.size)
            if pending is not None:
                kv = pending.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _autograd_ring(q, k, v, spec: RingSpec) -> torch.Tensor:
    """The same ring differentiated by autograd through the pure-torch blocks and `RingPass`
    (the reference for `RingAttention`; it keeps every block's scores for backward)."""
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(spec.ring.size):
        if step:
            kv = RingPass.apply(kv, spec.ring)
            spec.count(kv)
        out_b, lse_b = block_attention(q, kv[0], kv[1], spec.allowed(step), spec.scaling)
        out, lse = (out_b, lse_b) if out is None else merge(out, lse, out_b, lse_b)
    return out.to(q.dtype)


def ring_spec(q: torch.Tensor, index: torch.Tensor, ring: RingGroup, cu_seqlens: torch.Tensor,
              scaling: float | None, window: int | None = None,
              blocks: torch.Tensor | None = None, counts: SPCounts | None = None,
              kernel: str | None = None) -> RingSpec:
    """The `RingSpec` of `ring_attention`'s arguments, on q's device."""
    device = q.device
    return RingSpec(
        ring=ring, index=index.to(device), bounds=cu_seqlens.to(device=device, dtype=torch.long),
        window=window, spans=blocks.to(device) if blocks is not None and len(blocks) else None,
        scaling=scaling if scaling is not None else q.shape[-1] ** -0.5,
        kernel=kernel_for(device, kernel), counts=counts)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                   ring: RingGroup, cu_seqlens: torch.Tensor, scaling: float | None,
                   dropout: float = 0.0, window: int | None = None,
                   blocks: torch.Tensor | None = None, counts: SPCounts | None = None,
                   kernel: str | None = None, backward: str = "ring") -> torch.Tensor:
    """q [1, C, h, D], k/v [1, C, hkv, D] of this cp rank -> out [1, C, h, D]; `index` [cp, C]:
    the row position of every cp rank's tokens (`Zigzag.ring_index`); `cu_seqlens` and `blocks`
    of the whole padded row; `kernel`: the block kernel (`ring_kernels.kernel_for`);
    `backward`: "ring" (`RingAttention`) or "autograd" (`_autograd_ring`)."""
    if dropout:
        raise ValueError(f"ring attention (parallel.cp) has no attention dropout (got {dropout}); "
                         "set the LLM's attention_dropout to 0 or parallel.cp to 1")
    if backward not in ("ring", "autograd"):
        raise ValueError(f"ring attention's backward is 'ring' or 'autograd', not {backward!r}")
    spec = ring_spec(q, index, ring, cu_seqlens, scaling, window, blocks, counts, kernel)
    if backward == "autograd":
        return _autograd_ring(q[0], k[0], v[0], spec).unsqueeze(0)
    return RingAttention.apply(q[0], k[0], v[0], spec).unsqueeze(0)
