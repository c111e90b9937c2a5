"""The zigzag layout of parallel.cp, over simulated ranks in one process."""

import numpy as np
import pytest

from ds_omni.parallel.zigzag import causal_pairs, chunk_owner, zigzag_layout


@pytest.mark.parametrize("cp,ulysses", [(1, 2), (2, 1), (2, 2), (3, 2), (4, 1)])
def test_every_token_once_in_row_order_per_rank(cp, ulysses):
    lengths = [7, 1, 30, 12, 5]
    layout = zigzag_layout(lengths, cp, ulysses)
    total = len(layout.order)
    assert sorted(layout.order.tolist()) == list(range(total))  # a permutation of the row
    assert total == sum(lengths) + layout.pad and total % (cp * ulysses) == 0
    for positions in layout.ring_index():  # ascending: local order is causal order
        assert np.all(np.diff(positions) > 0)
    assert np.array_equal(layout.order[layout.slots_of()], np.arange(total))


def test_head_and_tail_pair_up():
    assert [chunk_owner(c, 4) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    layout = zigzag_layout([8], 2)  # chunks of 2: rank 0 holds 0-1 and 6-7
    assert layout.ring_index().tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_is_even(cp):
    """Zigzag: every rank's causal (query, key) pairs within 5 % of each other on long samples;
    a plain split in cp pieces gives the last rank far more."""
    lengths = [1000, 640, 2048]
    layout = zigzag_layout(lengths, cp)
    cu = np.concatenate([[0], np.cumsum(lengths + ([layout.pad] if layout.pad else []))])
    work = causal_pairs(layout.ring_index(), cu.tolist())
    assert max(work) <= 1.05 * min(work), work
    plain = np.arange(len(layout.order)).reshape(cp, -1)
    unbalanced = causal_pairs(plain, cu.tolist())
    assert max(unbalanced) > 1.5 * min(unbalanced), unbalanced
