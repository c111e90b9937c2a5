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


def test_plan_facts_of_cp():
    """sp x cp ranks split a row: Ulysses groups of consecutive ranks, rings across them, and
    ZeRO's sequence x data group over all of them."""
    from ds_omni.config import ParallelConfig, ReorderConfig
    from ds_omni.parallel.plan import ParallelPlan
    plan = ParallelPlan.from_config(ParallelConfig(sp=2, cp=2), 8, ReorderConfig())
    assert (plan.dp, plan.sp, plan.cp, plan.ulysses) == (2, 4, 2, 2)
    assert plan.sp_degrees == [2]  # the heads are checked against Ulysses' degree only
    assert plan.ulysses_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.cp_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [plan.ring_coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert plan.seq_data_group_ranks() == [list(range(8))]
    assert plan.layout()["cp_groups"] == plan.cp_group_ranks()
    ring = ParallelPlan.from_config(ParallelConfig(cp=4), 4, ReorderConfig())
    assert ring.cp_group_ranks() == [[0, 1, 2, 3]] and ring.sp_degrees == []
