"""A data-parallel rank's read position in one source, and how it moves to another DP size.

Each epoch of a source permutes its chunks with a seed of (data seed, source, epoch); rank r of dp
reads chunks r, r + dp, r + 2 dp, ... of that order, each from start to end (`Source.stream`).
So the position is three numbers: epoch, index into the rank's chunk list, row offset in the chunk.
The file list itself is not state: every rank derives it from the config.

Elastic resume: the positions written under dp ranks are turned into the list of (chunk, first
row) pieces nobody has read yet in the current epoch(s); the new ranks split that list, finish it,
then go on with whole epochs under the new dp. Every row is read exactly once per epoch across
the change.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ds_omni.data.sources import Chunk, Locator, Source
from ds_omni.errors import DataError

STATE_KEYS = ("epoch", "pos", "offset", "pending")


def chunk_order(n_chunks: int, seed: int, source_index: int, epoch: int) -> np.ndarray:
    """The chunk permutation of one epoch of one source (the same on every rank)."""
    return np.random.default_rng([seed, source_index, epoch]).permutation(n_chunks)


def rank_chunks(n_chunks: int, seed: int, source_index: int, epoch: int, rank: int,
                dp: int) -> list[int]:
    return chunk_order(n_chunks, seed, source_index, epoch)[rank::dp].tolist()


class SourceCursor:
    """Where rank `rank` of `dp` reads source `source` next; `next()` gives one row at a time."""

    def __init__(self, source: Source, source_index: int, rank: int, dp: int, seed: int):
        self.source, self.index = source, source_index
        self.rank, self.dp, self.seed = rank, dp, seed
        n = len(source.chunks)
        if n < dp:
            raise DataError(f"data source '{source.name}' has {n} chunks of at most "
                            f"{source.chunk_rows} rows but there are {dp} data-parallel ranks: every "
                            "rank needs a chunk; lower data.chunk_rows")
        self.epoch, self.pos, self.offset = 0, 0, 0
        self.pending: list[list[int]] | None = None  # [[chunk index, first row], ...] after a dp change
        self._rows: Iterator | None = None
        self._epoch_work: tuple[int, list] = (-1, [])  # this rank's chunk list of one epoch

    # ------------------------------------------------------------------------------ reading
    def _work(self) -> list[tuple[int, int]]:
        """(chunk index, first row) pieces of the current list: pending, or this epoch's chunks."""
        if self.pending is not None:
            return [(c, s) for c, s in self.pending]
        if self._epoch_work[0] != self.epoch:
            chunks = rank_chunks(len(self.source.chunks), self.seed, self.index, self.epoch,
                                 self.rank, self.dp)
            self._epoch_work = (self.epoch, [(c, self.source.chunks[c].start) for c in chunks])
        return self._epoch_work[1]

    def next(self) -> tuple[Locator, dict] | None:
        """The next row, or None when this rank's share of the epoch is read."""
        while True:
            work = self._work()
            if self.pos >= len(work):
                return None
            if self._rows is None:
                chunk_index, first = work[self.pos]
                chunk = self.source.chunks[chunk_index]
                self._rows = self.source.stream(chunk, first + self.offset)
            item = next(self._rows, None)
            if item is not None:
                self.offset += 1
                return item
            self.close()
            self.pos, self.offset = self.pos + 1, 0

    def close(self) -> None:
        """Release the open stream (its file handles) now rather than at garbage collection."""
        if self._rows is not None:
            self._rows.close()
            self._rows = None

    def next_epoch(self) -> None:
        """Go on to the next epoch (a pending list always completes the current one)."""
        self.close()
        self.epoch, self.pending = self.epoch + 1, None
        self.pos, self.offset = 0, 0

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "offset": self.offset,
                "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.epoch, self.pos, self.offset = state["epoch"], state["pos"], state["offset"]
        self.pending = state["pending"]


def unread_pieces(states: list[dict], chunks: list[Chunk], seed: int, source_index: int) -> list[list[int]]:
    """[chunk index, first unread row] of every piece no rank has read, under the old dp.

    Ranks may stand in different epochs (one finished its share and began the next): a rank behind
    the furthest epoch E still owes the rest of its epoch and its whole share of later epochs <= E.
    """
    old_dp = len(states)
    furthest = max(s["epoch"] for s in states)
    pieces = []
    for rank, st in enumerate(states):
        epochs = [(st["epoch"], st["pending"], st["pos"], st["offset"])]
        epochs += [(e, None, 0, 0) for e in range(st["epoch"] + 1, furthest + 1)]
        for epoch, pending, pos, offset in epochs:
            work = pending if pending is not None else [
                [c, chunks[c].start] for c in rank_chunks(len(chunks), seed, source_index, epoch,
                                                          rank, old_dp)]
            for i, (c, first) in enumerate(work[pos:]):
                start = first + (offset if i == 0 else 0)
                if start < chunks[c].stop:
                    pieces.append([int(c), int(start)])
    return pieces


def redistribute(states: list[dict], new_dp: int, chunks: list[Chunk], seed: int,
                 source_index: int) -> list[dict]:
    """Cursor states for `new_dp` ranks that read exactly what the old ranks had not."""
    pieces = unread_pieces(states, chunks, seed, source_index)
    furthest = max(s["epoch"] for s in states)
    return [{"epoch": furthest, "pos": 0, "offset": 0, "pending": pieces[r::new_dp]}
            for r in range(new_dp)]
