import pytest

from ds_omni.config import ParallelConfig, ReorderConfig
from ds_omni.errors import LaunchError
from ds_omni.parallel.plan import ParallelPlan, RankCoords


def test_auto_dp_fills_the_world():
    plan = ParallelPlan.from_config(ParallelConfig(sp=2), 8, ReorderConfig())
    assert (plan.dp, plan.sp, plan.pp) == (4, 2, 1)
    assert plan.sp_enabled and plan.dp_enabled and not plan.pp_enabled


@pytest.mark.parametrize("cfg,world,match", [
    (ParallelConfig(dp=2), 3, r"needs parallel.dp x sp x pp = 2 x 1 x 1 = 2 processes but 3"),
    (ParallelConfig(sp=2), 3, r"world size 3 is not divisible by parallel.sp x parallel.pp = 2 x 1"),
    (ParallelConfig(dp=2, sp=2, pp=2), 4, r"= 8 processes but 4 were launched"),
])
def test_world_size_mismatch(cfg, world, match):
    with pytest.raises(LaunchError, match=match):
        ParallelPlan.from_config(cfg, world, ReorderConfig())


def test_layout_is_a_bijection_with_sp_innermost():
    plan = ParallelPlan(world_size=12, dp=3, sp=2, pp=2)
    coords = [plan.coords(r) for r in range(12)]
    assert len(set(coords)) == 12
    assert all(plan.rank_of(c) == r for r, c in enumerate(coords))
    assert plan.coords(1) == RankCoords(pp_stage=0, dp_rank=0, sp_rank=1)
    assert plan.coords(6) == RankCoords(pp_stage=1, dp_rank=0, sp_rank=0)


def test_groups_partition_the_world():
    plan = ParallelPlan(world_size=12, dp=3, sp=2, pp=2)
    for groups, size in ((plan.dp_group_ranks(), 3), (plan.sp_group_ranks(), 2)):
        assert sorted(r for g in groups for r in g) == list(range(12))
        assert all(len(g) == size for g in groups)
    assert plan.sp_group_ranks()[0] == [0, 1]
    assert plan.dp_group_ranks()[0] == [0, 2, 4]


def test_layout_of_8_ranks_with_sp_2():
    """dp 4 x sp 2, reorder groups of 2: SP pairs are neighbours, DP groups stride over them."""
    layout = ParallelPlan.from_config(ParallelConfig(sp=2), 8,
                                     ReorderConfig(group_size=2)).layout()
    assert layout["ranks"] == [{"rank": r, "pp": 0, "dp": r // 2, "sp": r % 2} for r in range(8)]
    assert layout["sp_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["dp_groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["reorder_group_size"] == 2
    assert layout["reorder_groups"] == [[0, 2], [4, 6], [1, 3], [5, 7]]


def test_reorder_groups_are_consecutive_ranks_of_one_dp_group():
    plan = ParallelPlan(world_size=24, dp=6, sp=2, pp=2)
    groups = plan.reorder_group_ranks(3)
    assert sorted(r for g in groups for r in g) == list(range(24))
    for g in groups:
        coords = [plan.coords(r) for r in g]
        assert len({(c.pp_stage, c.sp_rank) for c in coords}) == 1  # inside one dp group
        assert [c.dp_rank for c in coords] == list(range(coords[0].dp_rank, coords[0].dp_rank + 3))
    with pytest.raises(ValueError, match="a reorder group of 4 ranks does not divide the "
                                         "data-parallel size 6"):
        plan.reorder_group_ranks(4)


def test_data_groups_build_the_printed_layout(monkeypatch):
    """The process groups `data_groups` creates are the layout's (new_group recorded, no backend),
    each with the world's timeout (a new group's own default is 30 minutes)."""
    from datetime import timedelta
    from ds_omni.parallel import groups
    timeouts = []
    monkeypatch.setattr(groups.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(groups.dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(groups, "world_timeout", lambda: timedelta(seconds=7))
    monkeypatch.setattr(groups.dist, "new_group",
                        lambda ranks, timeout: timeouts.append(timeout) or tuple(ranks))
    plan = ParallelPlan(world_size=8, dp=4, sp=2, reorder_group=2)
    layout = plan.layout()
    for rank in range(8):
        dp_pg, reorder_pg = groups.data_groups(plan, rank)
        assert [list(dp_pg)] == [g for g in layout["dp_groups"] if rank in g]
        assert [list(reorder_pg)] == [g for g in layout["reorder_groups"] if rank in g]
    assert timeouts and set(timeouts) == {timedelta(seconds=7)}


def test_reader_groups_are_the_sp_x_tp_ranks_of_a_data_parallel_rank():
    plan = ParallelPlan(world_size=8, dp=2, sp=2, tp=2)
    assert plan.reader_group_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for group in plan.reader_group_ranks():
        coords = [plan.coords(r) for r in group]
        assert len({(c.pp_stage, c.dp_rank) for c in coords}) == 1
        assert [(c.sp_rank, c.tp_rank) for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ParallelPlan(world_size=4, dp=2, sp=2).reader_group_ranks() == \
        ParallelPlan(world_size=4, dp=2, sp=2).sp_group_ranks()


def test_no_sequence_groups_without_sp():
    from ds_omni.parallel.groups import sequence_groups
    assert sequence_groups(ParallelPlan(world_size=2, dp=2), 0) is None  # the engine tests `if mpu`


def test_the_plan_owns_its_derived_facts():
    """The reorder group (capped at dp, 1 in loader order), per-sequence blocks and the pool's
    and long items' group sizes come from the plan alone."""
    plan = ParallelPlan.from_config(ParallelConfig(max_sequence_sp=4), 8, ReorderConfig())
    assert (plan.dp, plan.reorder_group, plan.pool_size, plan.long_item_group) == (8, 8, 8, 4)
    assert plan.sequence_blocks() == [(0, 2), (2, 2), (4, 2), (6, 2), (0, 4), (4, 4)]
    loader_order = ReorderConfig(mode="loader_order")
    assert ParallelPlan.from_config(ParallelConfig(sp=2), 4, loader_order).reorder_group == 1
    assert ParallelPlan.from_config(ParallelConfig(sp=2), 4, loader_order).sequence_blocks() == []
    assert plan.sequence_block_ranks(4, 4) == [[4, 5, 6, 7]]  # without tp: consecutive ranks
    from ds_omni.errors import DataError
    with pytest.raises(DataError, match="needs grouped reordering"):
        ParallelPlan.from_config(ParallelConfig(max_sequence_sp=2), 4, loader_order)
    with pytest.raises(DataError, match="must divide the data-parallel size 6"):
        ParallelPlan.from_config(ParallelConfig(), 6, ReorderConfig(group_size=4))


def test_per_sequence_blocks_under_tp_share_one_tp_rank():
    """tp x max_sequence_sp: a block (in data-parallel ranks) has one group per TP rank, each
    over that TP rank's data-parallel ranks, so its all-to-alls never mix TP shards; every rank
    is in exactly one group of each block."""
    plan = ParallelPlan.from_config(ParallelConfig(tp=2, max_sequence_sp=4), 8, ReorderConfig())
    assert (plan.dp, plan.sequence_blocks()) == (4, [(0, 2), (2, 2), (0, 4)])
    assert plan.sequence_block_ranks(2, 2) == [[4, 6], [5, 7]]
    assert plan.sequence_block_ranks(0, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for start, size in plan.sequence_blocks():
        groups = plan.sequence_block_ranks(start, size)
        assert all(len({plan.coords(r).tp_rank for r in g}) == 1 for g in groups)
        assert [plan.coords(r).dp_rank for r in groups[0]] == list(range(start, start + size))
