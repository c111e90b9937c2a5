"""Ring attention (parallel.cp) over a packed row's zigzag shards, merged by log-sum-exp.

Each cp rank holds the tokens `ds_omni.parallel.zigzag` gives it (after Ulysses gathered them
from its sp ranks, with its share of the heads). The key/value block travels around the ring
(`RingPass`): at step j a rank attends its queries to the block of rank (rank - j) mod cp and
folds the result into its running output by the online softmax: out = sum_b out_b x
exp(lse_b - lse), lse = logaddexp over the blocks. Which query may see which key is read from
the row positions of both (`ring_mask`): the same sample, causal or inside one bidirectional
block (Gemma 3's images), within the sliding window: the masks of the SDPA path, so the numbers
are the same. `block_attention` is pure torch and returns the log-sum-exp SDPA does not; only
the rows and columns that see anything are computed. Backward: autograd through these ops and
`RingPass`, exact. CUDA runs the same ops: flash-attn's varlen autograd drops the lse's gradient,
which the merge needs; yunchang's torch backends return an all-zero lse (a wrong merge for cp > 1).

Dims: C tokens of this cp rank, K of a key block, h query heads here, hkv key/value heads, D head dim.
"""

from __future__ import annotations

import math

import torch

from ds_omni.parallel.evidence import SPCounts, register
from ds_omni.parallel.ring import RingGroup, RingPass

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


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Cq, h, D], k/v [K, hkv, D], allowed [Cq, K] -> (out [Cq, h, D], lse [h, Cq]) in float32
    (float64 for float64 inputs); a query that sees no key here gets out 0 and lse -inf (it adds
    nothing to the merge)."""
    work = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(q.shape, dtype=work)
    lse = q.new_full((q.shape[1], q.shape[0]), -math.inf, dtype=work)
    rows = allowed.any(1).nonzero()[:, 0]  # queries that see a key of this block
    cols = allowed.any(0).nonzero()[:, 0]  # keys that some query sees
    if not len(rows):
        return out, lse
    qs = q.index_select(0, rows).to(work)  # [r, h, D]
    ks, vs = (t.index_select(0, cols).to(work) for t in (k, v))  # [c, hkv, D]
    if ks.shape[1] != qs.shape[1]:  # GQA: each query head keeps its KV head
        ks, vs = (t.repeat_interleave(qs.shape[1] // t.shape[1], dim=1) for t in (ks, vs))
    scores = torch.einsum("rhd,chd->hrc", qs, ks) * scaling  # [h, r, c]
    scores = scores.masked_fill(~allowed[rows][:, cols], -math.inf)
    block_lse = torch.logsumexp(scores, dim=-1)  # [h, r]
    probs = torch.exp(scores - block_lse[..., None])
    block_out = torch.einsum("hrc,chd->rhd", probs, vs)  # [r, h, D]
    return out.index_copy(0, rows, block_out), lse.index_copy(1, rows, block_lse)


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge: (out [C, h, D], lse [h, C]) over the keys so far and over a new
    block -> over both. `out` must have a finite lse (a rank's own block, first, gives every
    query its own token)."""
    both = torch.logaddexp(lse, lse_b)  # [h, C]
    keep = torch.exp(lse - both).transpose(0, 1)[..., None]  # [C, h, 1]
    add = torch.exp(lse_b - both).transpose(0, 1)[..., None]
    return out * keep + out_b * add, both


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                   ring: RingGroup, cu_seqlens: torch.Tensor, scaling: float | None,
                   dropout: float = 0.0, window: int | None = None,
                   blocks: torch.Tensor | None = None,
                   counts: SPCounts | None = None) -> torch.Tensor:
    """q [1, C, h, D], k/v [1, C, hkv, D] of this cp rank -> out [1, C, h, D]; `index` [cp, C]:
    the row position of every cp rank's tokens (`Zigzag.ring_index`); `cu_seqlens` and `blocks`
    of the whole padded row."""
    if dropout:
        raise ValueError(f"ring attention (parallel.cp) has no attention dropout (got {dropout}); "
                         "set the LLM's attention_dropout to 0 or parallel.cp to 1")
    scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
    device = q.device
    index = index.to(device)
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    spans = blocks.to(device) if blocks is not None and len(blocks) else None
    q_pos = index[ring.rank]
    kv = torch.stack([k[0], v[0]])  # [2, C, hkv, D]: one message a step
    out = lse = None
    for step in range(ring.size):
        if step:
            kv = RingPass.apply(kv, ring)
            if counts is not None:
                counts.ring_steps += 1
                counts.ring_bytes += kv.numel() * kv.element_size()
        source = (ring.rank - step) % ring.size  # whose block this is
        allowed = ring_mask(q_pos, index[source], bounds, window, spans)
        out_b, lse_b = block_attention(q[0], kv[0], kv[1], allowed, scaling)
        out, lse = (out_b, lse_b) if out is None else merge(out, lse, out_b, lse_b)
    return out.to(q.dtype).unsqueeze(0)
