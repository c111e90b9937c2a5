"""Ring attention's zigzag split of a packed row over the sp x cp ranks of its sequence group.

Each sample is cut into 2 x cp chunks (as even as its length allows) and cp rank c holds chunks
c and 2cp - 1 - c of every sample (head and tail), so each rank's causal work is about the same
(a plain split in cp pieces gives the last rank cp times the first's). A rank's tokens keep their
row order, and a padding sample (no targets, it attends only to itself) fills every rank up to
the same count, a multiple of the Ulysses degree, whose ranks take equal consecutive pieces of it.
The layout is a permutation of the padded row: sequence rank s = c x ulysses + u holds slots
[s x S, (s + 1) x S) of `order`. Pure; `ds_omni.data.packing.shard_row` cuts rows by it and the
ring kernel (`ds_omni.model.ring_attention`) masks by the row positions it gives every token.
More: docs/parallelism.md, "Ring attention (parallel.cp)".

Dims: T tokens of the row, T' padded, C = T' / cp tokens of one cp rank, S = C / ulysses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def chunk_owner(chunk: int, cp: int) -> int:
    """The cp rank holding chunk `chunk` (0 .. 2cp - 1) of a sample: head and tail pair up."""
    return min(chunk, 2 * cp - 1 - chunk)


@dataclass(frozen=True)
class Zigzag:
    """One row's layout: `order` [T'] is the row position of each slot (cp rank c holds slots
    [c x C, (c + 1) x C)); the last `pad` positions are the padding sample's."""

    order: np.ndarray
    pad: int
    cp: int

    @property
    def rank_tokens(self) -> int:
        """C: tokens each cp rank holds."""
        return len(self.order) // self.cp

    def ring_index(self) -> np.ndarray:
        """[cp, C] row positions of every cp rank's tokens, what the ring kernel masks by."""
        return self.order.reshape(self.cp, self.rank_tokens)

    def slots_of(self) -> np.ndarray:
        """[T'] the slot of each row position (the inverse of `order`)."""
        where = np.empty_like(self.order)
        where[self.order] = np.arange(len(self.order))
        return where


def zigzag_layout(lengths: list[int], cp: int, ulysses: int = 1) -> Zigzag:
    """The zigzag layout of a row of samples of `lengths` over cp ranks of `ulysses` each."""
    parts: list[list[np.ndarray]] = [[] for _ in range(cp)]
    start = 0
    for length in lengths:
        chunks = np.array_split(np.arange(start, start + length), 2 * cp)
        for chunk, positions in enumerate(chunks):
            parts[chunk_owner(chunk, cp)].append(positions)
        start += length
    sizes = [sum(len(p) for p in rank) for rank in parts]
    per_rank = max(1, -(-max(sizes) // ulysses)) * ulysses  # C
    pad_at = start
    for rank, size in zip(parts, sizes):  # the padding sample: fill ranks in order
        rank.append(np.arange(pad_at, pad_at + per_rank - size))
        pad_at += per_rank - size
    order = np.concatenate([np.concatenate(rank) for rank in parts]).astype(np.int64)
    return Zigzag(order=order, pad=pad_at - start, cp=cp)


def causal_pairs(index: np.ndarray, cu_seqlens: list[int]) -> list[int]:
    """Causal (query, key) pairs each cp rank computes over the ring (index [cp, C] row
    positions): its queries against every earlier key of their own sample. Zigzag keeps them
    within a few percent of each other (`tests/unit/parallel/test_zigzag.py`)."""
    bounds = np.asarray(cu_seqlens)
    out = []
    for positions in index:
        sample_start = bounds[np.searchsorted(bounds, positions, side="right") - 1]
        out.append(int((positions - sample_start + 1).sum()))
    return out
