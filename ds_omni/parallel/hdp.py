"""Per-sequence SP degree (ByteScale's hybrid data parallelism): the pure placement math.

All ranks of a reorder group form one pool. A sequence whose modelled cost is above one rank's
share of the step, or whose tokens do not fit one micro-batch, gets a Ulysses group of d ranks
(the smallest power of two that brings its share under both limits, aligned on a multiple of d);
every other sequence runs whole on one rank. A block's ranks each carry cost / d, and the normal
samples are packed around those loads (`ds_omni.data.reorder`). Long sequences run in rounds: in
round k every rank runs one micro-batch (its block's shard, or an empty one), so ZeRO's
collectives and each block's all-to-alls line up and no rank waits on a peer inside another
block. A block larger than the LLM's heads runs Ulysses inside and ring attention across
(`ulysses_ring_split`). More: docs/parallelism.md, "A per-sequence SP degree".

Dims: N candidate sequences, G ranks in the pool, D the largest degree allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ds_omni.errors import DataError


@dataclass(frozen=True)
class Block:
    """The ranks [start, start + size) of a pool that run one long sequence together."""

    start: int
    size: int
    round: int
    """Which of the step's long-sequence rounds it runs in (0-based); blocks of one round are
    disjoint."""

    def __contains__(self, rank: int) -> bool:
        return self.start <= rank < self.start + self.size

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.size)


def check_degree(max_degree: int, pool: int) -> None:
    """`max_degree` must be a power of two that divides the pool (the reorder group)."""
    if max_degree < 1 or max_degree & (max_degree - 1):
        raise ValueError(f"the per-sequence SP degree limit must be a power of two, got {max_degree}")
    if pool % max_degree:
        raise ValueError(f"a per-sequence SP group of up to {max_degree} ranks must fit the "
                         f"{pool}-rank reorder group evenly; make data.reorder.group_size a "
                         f"multiple of {max_degree} or lower parallel.max_sequence_sp")


def degree_for(cost: float, tokens: int, rank_budget: float, token_cap: float,
               max_degree: int) -> int:
    """The smallest power of two d <= max_degree with cost / d <= rank_budget and tokens / d <=
    token_cap; max_degree when even that is not enough for the cost (the rank is then overfull).

    Raises DataError when even max_degree ranks cannot hold the sequence's tokens.
    """
    need = max(cost / rank_budget if rank_budget > 0 else 1.0, tokens / token_cap, 1.0)
    degree = 1 << max(0, math.ceil(math.log2(need) - 1e-12))
    if tokens > max_degree * token_cap:
        raise DataError(f"a sequence of {tokens} tokens needs {math.ceil(tokens / token_cap)} "
                        f"micro-batches of {token_cap:g} tokens, more than the largest SP group "
                        f"({max_degree} ranks); raise parallel.max_sequence_sp or data.pack_tokens, "
                        "or lower data.max_seq_len")
    return min(degree, max_degree)


def ulysses_ring_split(size: int, heads: int | None) -> tuple[int, int]:
    """(Ulysses degree, ring degree) of a block of `size` ranks over an LLM of `heads` query heads
    (None: unknown, no limit): Ulysses over the largest degree dividing both (gcd), consecutive
    ranks, and ring attention across the rest, so a block may be larger than the heads."""
    ulysses = math.gcd(size, heads) if heads else size
    return ulysses, size // ulysses


def place_blocks(cost: np.ndarray, tokens: np.ndarray, loads: np.ndarray, rank_budget: float,
                 token_cap: float, max_degree: int, *, forced: np.ndarray | None = None,
                 limit: float = math.inf) -> dict[int, tuple[int, int]]:
    """Blocks for long sequences (cost [N], tokens [N]) in a pool whose ranks already carry
    `loads` [G] (updated in place: each member gains cost / d).

    Order: forced sequences first, then by cost descending (ties: index). Each takes the smallest
    degree, from `degree_for` up to `max_degree`, whose least-loaded aligned block stays within
    `limit` (a wider block packs around the others when the narrow ones are taken; ties: lowest
    start). When none does, a forced sequence takes the block and degree that leave its busiest
    member least loaded, and so does one whose narrowest block is still empty; any other is left
    out (not in the result) to wait for a later step. Returns {index: (start, degree)}; give
    them rounds with `assign_rounds` (once, over all of a step's blocks).
    """
    cost = np.asarray(cost, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    forced = np.zeros(cost.size, dtype=bool) if forced is None else np.asarray(forced, dtype=bool)
    check_degree(max_degree, loads.size)
    placed: dict[int, tuple[int, int]] = {}
    for i in np.lexsort((np.arange(cost.size), -cost, ~forced)).tolist():
        low = degree_for(float(cost[i]), int(tokens[i]), rank_budget, token_cap, max_degree)
        options = [_best_block(loads, cost[i] / d, d) + (d,)
                   for d in _powers(low, max_degree)]  # (busiest after, start, degree)
        fits = [o for o in options if o[0] <= limit]
        if fits:
            _, start, d = fits[0]
        elif forced[i] or loads[options[0][1]:options[0][1] + low].max() == 0:
            _, start, d = min(options)
        else:
            continue  # waits for a later step
        loads[start:start + d] += cost[i] / d
        placed[i] = (start, d)
    return placed


def _powers(low: int, high: int) -> list[int]:
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return out


def _best_block(loads: np.ndarray, share: float, d: int) -> tuple[float, int]:
    """(busiest member's load after adding `share`, start) of the best aligned block of d."""
    busiest = loads.reshape(-1, d).max(axis=1)  # [G / d]
    k = int(np.argmin(busiest))
    return float(busiest[k] + share), k * d


def assign_rounds(placed: dict[int, tuple[int, int]]) -> dict[int, Block]:
    """Give each (start, size) block, in index order, the first round where its ranks are free."""
    busy: list[set[int]] = []
    out = {}
    for i in sorted(placed):
        start, size = placed[i]
        ranks = set(range(start, start + size))
        k = next((k for k, taken in enumerate(busy) if not taken & ranks), len(busy))
        if k == len(busy):
            busy.append(set())
        busy[k] |= ranks
        out[i] = Block(start, size, k)
    return out


def rank_rounds(blocks: dict[int, Block], rank: int) -> list[int | None]:
    """For `rank`, the sequence index it runs in each round (None: an empty micro-batch)."""
    n_rounds = 1 + max((b.round for b in blocks.values()), default=-1)
    out: list[int | None] = [None] * n_rounds
    for i, b in blocks.items():
        if rank in b:
            out[b.round] = i
    return out
