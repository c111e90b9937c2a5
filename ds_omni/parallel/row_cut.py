"""How a packed row is cut over the ranks of its sequence group: the one object the data layer
carries for it (`ParallelPlan.row_cut`), so the loader cuts rows without knowing which axis asked.

Contiguous shards (Ulysses, per-sequence blocks): the row padded to a multiple of the ranks, rank
r holding slice r. Ring attention (`zigzag` > 1, parallel.cp): the padded row laid out zigzag
(`ds_omni.parallel.zigzag`), rank r holding slice r of that order, and every part's row
positions handed to the model (`Route.row_index`), which the ring masks by. Pure.

Dims: T tokens of the row, T' padded, C tokens of one ring part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_omni.parallel.zigzag import zigzag_layout


@dataclass(frozen=True)
class RowLayout:
    """Where a cut puts a row's tokens."""

    pad: int
    """Padding tokens appended to the row (one more sample with no targets)."""
    order: np.ndarray | None = None
    """[T'] the row position of each slot (rank r holds slots [r x T'/size, (r + 1) x T'/size));
    None: the padded row itself, in order."""
    index: np.ndarray | None = None
    """[parts, C] the row positions of every part's tokens, what the model masks by
    (`Route.row_index`); None: contiguous shards."""

    def slots_of(self) -> np.ndarray:
        """[T'] the slot of each row position (the inverse of `order`)."""
        where = np.empty_like(self.order)
        where[self.order] = np.arange(len(self.order))
        return where


@dataclass(frozen=True)
class RowCut:
    """A row cut over `size` ranks: contiguous, or zigzag over `zigzag` ring ranks of
    size / zigzag consecutive ranks each."""

    size: int
    zigzag: int = 1

    def layout(self, lengths: list[int]) -> RowLayout:
        """The layout of a row of samples of `lengths` (tokens)."""
        if self.zigzag == 1:
            return RowLayout(pad=-sum(lengths) % self.size)
        z = zigzag_layout(lengths, self.zigzag, self.size // self.zigzag)
        return RowLayout(pad=z.pad, order=z.order, index=z.ring_index())
