"""Rank cursors: each epoch's chunks split over ranks; elastic redistribution reads every row once."""

import collections
import itertools
import random

import pytest

from ds_omni.data.sources import Chunk, Locator
from ds_omni.data.stream import SourceCursor, rank_chunks, redistribute
from ds_omni.errors import DataError


class FakeSource:
    """In-memory rows cut into chunks, streamed like a real Source."""

    def __init__(self, file_rows, chunk_rows):
        self.name, self.chunk_rows = "fake", chunk_rows
        self.chunks = [Chunk(f, s, min(s + chunk_rows, n)) for f, n in enumerate(file_rows)
                       for s in range(0, n, chunk_rows)]

    def stream(self, chunk, start):
        for r in range(start, chunk.stop):
            yield Locator(self.name, chunk.file, r), {"row": r}


def _read(cursor, n):
    """Up to n rows, without starting a new epoch; the locators."""
    out = []
    for _ in range(n):
        got = cursor.next()
        if got is None:
            break
        out.append(got[0])
    return out


def test_epoch_chunks_partition_over_ranks_and_change_per_epoch():
    n = 37
    for dp in (1, 2, 5):
        lists = [rank_chunks(n, 3, 0, 0, r, dp) for r in range(dp)]
        assert sorted(itertools.chain(*lists)) == list(range(n))
    assert rank_chunks(n, 3, 0, 0, 0, 1) != rank_chunks(n, 3, 0, 1, 0, 1)


def test_cursor_reads_its_share_then_ends_the_epoch():
    src = FakeSource([10, 7], chunk_rows=3)
    seen = []
    for rank in range(2):
        cursor = SourceCursor(src, 0, rank, 2, seed=1)
        seen += _read(cursor, 100)
        assert cursor.next() is None
        cursor.next_epoch()
        assert cursor.epoch == 1 and cursor.next() is not None
    assert sorted((l.file, l.row) for l in seen) == [(f, r) for f, n in enumerate([10, 7])
                                                     for r in range(n)]


def test_too_few_chunks_for_the_ranks_is_a_clear_error():
    with pytest.raises(DataError, match="has 2 chunks .* 4 data-parallel ranks: .* lower data.chunk_rows"):
        SourceCursor(FakeSource([6], chunk_rows=3), 0, 0, 4, seed=0)


@pytest.mark.parametrize("old_dp,new_dp", [(3, 2), (2, 5), (4, 1)])
def test_redistribution_reads_every_row_exactly_once(old_dp, new_dp):
    rng = random.Random(old_dp * 10 + new_dp)
    src = FakeSource([23, 11, 30], chunk_rows=4)
    old = [SourceCursor(src, 0, r, old_dp, seed=7) for r in range(old_dp)]
    read = []
    for c in old:  # ranks stop at different places; one finishes its epoch and starts the next
        read += [(0, l) for l in _read(c, rng.randint(0, 12))]
    read += [(0, l) for l in _read(old[0], 100)]
    old[0].next_epoch()
    read += [(1, l) for l in _read(old[0], 3)]
    states = [c.state_dict() for c in old]
    new = [SourceCursor(src, 0, r, new_dp, seed=7) for r in range(new_dp)]
    for c, st in zip(new, redistribute(states, new_dp, src.chunks, 7, 0)):
        c.load_state_dict(st)
        read += [(None, l) for l in _read(c, 1000)]
    # the old ranks stood in epochs 0 and 1; the new ranks' pending lists finish both, so every
    # row has now been read exactly twice: none lost, none repeated
    counts = collections.Counter((l.file, l.row) for _, l in read)
    assert set(counts) == {(c.file, r) for c in src.chunks for r in range(c.start, c.stop)}
    assert set(counts.values()) == {2}
    for c in new:  # then every rank goes on with whole epochs under the new dp
        c.next_epoch()
        assert c.epoch == 2 and c.pending is None
