"""The block kernels of ring attention: one query block against one key/value block, under the
ring's mask, returning the log-sum-exp the merge needs, and its backward given the FINAL output
and log-sum-exp of the whole ring (so no gradient of the log-sum-exp is ever needed; the ring's
own backward, `ds_omni.model.ring_attention.RingAttention`, as ring-flash-attn writes it).

    forward(q, k, v, allowed, scaling) -> (out [Cq, h, D], lse [h, Cq])  (float32 or wider)
    backward(dout, q, k, v, out, lse, allowed, scaling) -> (dq, dk, dv)   (float32 or wider)

`TorchBlock` (pure torch, the default on CPU: the reference numbers), `CpuFlashBlock` (torch's
CPU flash kernel, which takes the block's boolean mask and returns the log-sum-exp) and
`ds_omni.model.ring_varlen.CudaFlashBlock` (torch's CUDA varlen flash kernel). A query that sees
no key of the block gets out 0 and lse -inf (it adds nothing to the merge).

Dims: Cq queries, K keys of the block, r / c those that see / are seen, h query heads, hkv
key/value heads, D head dim.
"""

from __future__ import annotations

import math

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are merged and gradients summed in: float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k/v [c, hkv, D] -> [c, h, D]: each query head keeps its KV head (GQA)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_heads`: [c, h, D] -> [c, hkv, D], each KV head's query heads summed."""
    c, h, d = t.shape
    return t if h == kv_heads else t.view(c, kv_heads, h // kv_heads, d).sum(2)


class CompactBlock:
    """A kernel over the rows and columns of the block that see anything: gathers them (heads
    expanded for GQA, in the work dtype), runs `dense_forward` / `dense_backward` on the
    compacted mask [r, c], and puts the results back in place."""

    name = "compact"

    def forward(self, q, k, v, allowed, scaling):
        work = work_dtype(q.dtype)
        out = q.new_zeros(q.shape, dtype=work)
        lse = q.new_full((q.shape[1], q.shape[0]), -math.inf, dtype=work)
        rows = allowed.any(1).nonzero()[:, 0]  # queries that see a key of this block
        cols = allowed.any(0).nonzero()[:, 0]  # keys that some query sees
        if not len(rows):
            return out, lse
        qs = q.index_select(0, rows).to(work)  # [r, h, D]
        ks, vs = (_heads(t.index_select(0, cols).to(work), q.shape[1]) for t in (k, v))
        block_out, block_lse = self.dense_forward(qs, ks, vs, allowed[rows][:, cols], scaling)
        return out.index_copy(0, rows, block_out), lse.index_copy(1, rows, block_lse)

    def backward(self, dout, q, k, v, out, lse, allowed, scaling):
        work = work_dtype(q.dtype)
        grads = [q.new_zeros(t.shape, dtype=work) for t in (q, k, v)]
        rows = allowed.any(1).nonzero()[:, 0]
        cols = allowed.any(0).nonzero()[:, 0]
        if not len(rows):
            return tuple(grads)
        qs = q.index_select(0, rows).to(work)
        ks, vs = (_heads(t.index_select(0, cols).to(work), q.shape[1]) for t in (k, v))
        do, o = (t.index_select(0, rows).to(work) for t in (dout, out))
        dq, dk, dv = self.dense_backward(do, qs, ks, vs, o, lse[:, rows].to(work),
                                         allowed[rows][:, cols], scaling)
        dk, dv = (_fold_heads(t, k.shape[1]) for t in (dk, dv))
        return (grads[0].index_copy(0, rows, dq), grads[1].index_copy(0, cols, dk),
                grads[2].index_copy(0, cols, dv))


class TorchBlock(CompactBlock):
    """(a) Pure torch: scores, masked, their log-sum-exp; backward written out with the final
    lse: P = exp(S x scale - lse), dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O))."""

    name = "torch"

    @staticmethod
    def dense_forward(qs, ks, vs, mask, scaling):
        scores = torch.einsum("rhd,chd->hrc", qs, ks) * scaling  # [h, r, c]
        scores = scores.masked_fill(~mask, -math.inf)
        block_lse = torch.logsumexp(scores, dim=-1)  # [h, r]
        probs = torch.exp(scores - block_lse[..., None])
        return torch.einsum("hrc,chd->rhd", probs, vs), block_lse

    @staticmethod
    def dense_backward(do, qs, ks, vs, o, lse, mask, scaling):
        scores = torch.einsum("rhd,chd->hrc", qs, ks) * scaling
        probs = torch.exp(scores.masked_fill(~mask, -math.inf) - lse[..., None])  # [h, r, c]
        dv = torch.einsum("hrc,rhd->chd", probs, do)
        dp = torch.einsum("rhd,chd->hrc", do, vs)
        delta = (do * o).sum(-1).transpose(0, 1)  # [h, r]: rowsum(dO O) of the final output
        ds = probs * (dp - delta[..., None])
        return (torch.einsum("hrc,chd->rhd", ds, ks) * scaling,
                torch.einsum("hrc,rhd->chd", ds, qs) * scaling, dv)


class CpuFlashBlock(CompactBlock):
    """(b) torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its
    backward): tiled, it never holds the [h, r, c] scores; it takes the block's mask (any
    pattern: packed samples, windows, image blocks) as an additive one of the inputs' dtype (it
    refuses a boolean mask) and returns the log-sum-exp."""

    name = "cpu_flash"

    @staticmethod
    def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, -math.inf)

    @staticmethod
    def dense_forward(qs, ks, vs, mask, scaling):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(t.transpose(0, 1)[None] for t in (qs, ks, vs)), 0.0, False,
            attn_mask=CpuFlashBlock._additive(mask, qs.dtype), scale=scaling)  # [1, h, r, D]
        return out[0].transpose(0, 1), lse[0].to(qs.dtype)

    @staticmethod
    def dense_backward(do, qs, ks, vs, o, lse, mask, scaling):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.transpose(0, 1)[None] for t in (do, qs, ks, vs, o)), lse[None], 0.0, False,
            attn_mask=CpuFlashBlock._additive(mask, qs.dtype), scale=scaling)
        return tuple(g[0].transpose(0, 1) for g in grads)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Cq, h, D], k/v [K, hkv, D], allowed [Cq, K] -> (out [Cq, h, D], lse [h, Cq]) in float32
    (float64 for float64 inputs), pure torch and differentiable (`TorchBlock.forward`)."""
    return TorchBlock().forward(q, k, v, allowed, scaling)
