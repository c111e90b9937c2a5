import pytest

from ds_omni.config import ParallelConfig
from ds_omni.errors import LaunchError
from ds_omni.parallel.plan import ParallelPlan, RankCoords


def test_auto_dp_fills_the_world():
    plan = ParallelPlan.from_config(ParallelConfig(sp=2), 8)
    assert (plan.dp, plan.sp, plan.pp) == (4, 2, 1)
    assert plan.sp_enabled and plan.dp_enabled and not plan.pp_enabled


@pytest.mark.parametrize("cfg,world,match", [
    (ParallelConfig(dp=2), 3, r"needs parallel.dp x sp x pp = 2 x 1 x 1 = 2 processes but 3"),
    (ParallelConfig(sp=2), 3, r"world size 3 is not divisible by parallel.sp x parallel.pp = 2 x 1"),
    (ParallelConfig(dp=2, sp=2, pp=2), 4, r"= 8 processes but 4 were launched"),
])
def test_world_size_mismatch(cfg, world, match):
    with pytest.raises(LaunchError, match=match):
        ParallelPlan.from_config(cfg, world)


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
