"""Ring attention (context parallelism) in the simulator: how a row's sequence ranks split into
Ulysses inside and a ring across, and what the ring adds to a step.

A row over g sequence ranks (the sp x cp ranks of one TP coordinate, or a per-sequence block)
runs Ulysses over u consecutive ranks and a ring of c = g / u across them (`sequence_split`).
After Ulysses' all-to-all a rank holds the ring shard's tokens (row / c) for heads / u. Per
attention layer its ring runs c steps: its own key/value block, then c - 1 blocks passed on by
its neighbour, each transfer (p2p, held to the ring's slowest link) overlapping the attention of
the block before; with zigzag chunks every step does the same causal work, 1/c of the rank's
attention. A step costs max(transfer, block attention); the attention is already the rank's
compute, so the ring adds (c - 1) max(0, transfer - block attention) a layer. Backward passes
the blocks again with their gradients (twice the bytes beside twice the attention); under
checkpointing the recomputed forward's ring runs again. More: docs/simulator.md.

Dims: R rows of one size, g sequence ranks of a row, u Ulysses ranks, c ring ranks.
"""

from __future__ import annotations

import numpy as np

from ds_omni.parallel.hdp import ulysses_ring_split
from ds_omni.sim import comm

BF16 = 2


def sequence_split(step, g: int) -> tuple[int, int]:
    """(u, c) of a row over g sequence ranks: the static plan's (sp, cp) on its rows, and on a
    per-sequence block's (static sp x cp is 1 there) `ulysses_ring_split` over the heads a TP
    rank holds."""
    plan = step.plan
    if g == plan.sp * plan.cp:
        return plan.sp, plan.cp
    heads = step.model.llm_heads
    return ulysses_ring_split(g, heads // step.pplan.tp if heads else None)


def kv_bytes_per_token(model, u: int, tp: int = 1) -> float:
    """Bytes of one token's key and value on a rank of Ulysses u (x tp): its share of the kv
    heads, at least one head (fewer kv heads than ranks are repeated), bf16."""
    width = model.kv / (u * tp)
    if model.llm_kv_heads:
        width = max(width, model.kv / model.llm_kv_heads)
    return 2 * width * BF16


# the ring's own backward (`model/ring_attention.RingAttention`) passes the bf16 key/value blocks
# around again with their float32 gradient accumulators: 1 + 2 blocks' bytes a step
BACKWARD_BLOCKS = 3


def ring_layer_seconds(transfer: np.ndarray, block: np.ndarray, c: int,
                       backward: bool, checkpointing: bool) -> np.ndarray:
    """The ring's exposed seconds of one layer in one pass: (c - 1) steps of max(0, transfer -
    block attention) (`transfer` [n]: one key/value block's p2p; `block` [n]: one step's
    forward attention); backward BACKWARD_BLOCKS transfers against twice the attention, plus
    the recomputed forward's."""
    exposed = (c - 1) * np.maximum(0.0, transfer - block)
    if not backward:
        return exposed
    back = (c - 1) * np.maximum(0.0, BACKWARD_BLOCKS * transfer - 2 * block)
    return back + exposed * checkpointing


def run_ring(step, rr, ids: np.ndarray, groups: np.ndarray, u: int, c: int,
             backward: bool) -> None:
    """Rows `ids` of `rr` (`step.RoundRows`), each over sequence ranks `groups` [R tp, g]
    (Ulysses inside: g = c x u, ring-major), meet in their rings (phase "llm_cp")."""
    if c < 2:
        return
    m, tp, plan = step.model, step.pplan.tp, step.plan
    rings = groups.reshape(-1, c, u).transpose(0, 2, 1).reshape(-1, c)  # [R tp u, c]
    per_ring = tp * u  # rings of one row
    tokens = np.repeat(rr.tokens[ids].astype(np.float64), per_ring)  # [R tp u]
    quad = m.cost.coefficients["llm_quad"]
    attn = np.array([quad * float((step.samples.tokens[rr.rows[i].samples].astype(np.float64)
                                   ** 2).sum()) for i in ids])  # [R] training FLOPs
    # one step's forward attention on a rank: 1/3 of training, a layer's, the rank's, 1/c
    block = np.repeat(attn, per_ring) / 3 / m.dims.layers / (u * c * tp) / c / step.rate
    nbytes = tokens / c * kv_bytes_per_token(m, u, tp)  # [R tp u] one block
    dense_blocks(step, rings, block_flops(step, rr, ids, attn, c), per_ring, backward)
    link = comm.links_each(step.cluster, rings)
    seconds = m.dims.layers * ring_layer_seconds(comm.p2p_each(nbytes, link), block, c,
                                                 backward, plan.checkpointing)
    passes = (BACKWARD_BLOCKS + plan.checkpointing) if backward else 1  # in forwards' worth
    moved = float(nbytes.sum()) * c * (c - 1) * m.dims.layers * passes
    step.a2a_bytes["llm_ring"] = step.a2a_bytes.get("llm_ring", 0.0) + moved
    gid = np.repeat(np.arange(rings.shape[0]), c)
    step.timeline.sync(rings.reshape(-1), gid, "llm_cp", seconds[gid])


def compacted_share(c: int) -> float:
    """The share of a row's full square its ring's blocks compute: the kernel (`ring_kernels.
    CompactBlock`) keeps a block's queries that see one of its keys and keys one query sees;
    under zigzag (rank i: chunks i and 2c-1-i of every sample) a rank's own block is whole and
    each other block half (j < i: every query, the head chunks' keys; j > i: the tail chunks'
    queries, every key): (C^2 + (c - 1) C^2 / 2) / (c C^2) = (c + 1) / 2c."""
    return (c + 1) / (2 * c)


def block_flops(step, rr, ids: np.ndarray, attn: np.ndarray, c: int) -> np.ndarray:
    """[R] each row's ring attention in FLOPs at the step's rate, beyond the varlen cost the
    step already charged (`attn`: the causal sum of its samples' squares): `block_attention`
    scores a block's queries against its keys, masked, not sample by sample (zigzag puts every
    sample on every rank): the row's full square, twice its causal L^2, of which its c ranks'
    blocks keep `compacted_share(c)`, at `Cluster.ring_flops_per_s` (its pure-torch kernel,
    calibrated on CPU). 0 there (the GPU presets): a fused varlen ring kernel, nothing beyond
    `attn`."""
    ring_rate = step.cluster.ring_flops_per_s
    if not ring_rate:
        return np.zeros(len(ids))
    quad = step.model.cost.coefficients["llm_quad"]
    dense = 2 * quad * rr.tokens[ids].astype(np.float64) ** 2 * compacted_share(c)
    return np.maximum(0.0, dense * step.rate / ring_rate - attn)


def dense_blocks(step, rings: np.ndarray, flops: np.ndarray, per_ring: int,
                 backward: bool) -> None:
    """Each ring rank computes its 1/(u c tp) of its row's dense-block FLOPs `flops` [R] in this
    pass (forward 1/3 of training, backward 2/3, plus the recomputed forward's)."""
    c = rings.shape[1]
    share = (2 + step.plan.checkpointing) / 3 if backward else 1 / 3
    seconds = np.repeat(flops, per_ring) * share / (per_ring * c) / step.rate  # [R tp u]
    step.timeline.run(rings.reshape(-1), "llm_bwd" if backward else "llm_fwd",
                      np.repeat(seconds, c))
