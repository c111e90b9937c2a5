"""The pipeline engine's topology under tp and sp (`ds_omni.parallelize.pipe_grid`), in one
process: its groups are ds_omni's, and SP shard i of a stage sends to SP shard i of the next."""

import pytest

from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallelize.pipe_grid import pipe_topology, stage_peer

PLANS = [dict(pp=2, dp=1, sp=2, tp=2), dict(pp=2, dp=2, sp=2, tp=1), dict(pp=4, dp=2, sp=1, tp=2),
         dict(pp=2, dp=3, sp=2, tp=2)]


@pytest.mark.parametrize("degrees", PLANS)
def test_the_engine_groups_are_the_plan_groups(degrees):
    plan = ParallelPlan(world_size=degrees["pp"] * degrees["dp"] * degrees["sp"] * degrees["tp"],
                        **degrees)
    topology = pipe_topology(plan)
    # the engine's data-parallel groups (ZeRO's): the dp x sp ranks of a (stage, TP rank)
    assert sorted(topology.get_axis_comm_lists("data")) == sorted(plan.seq_data_group_ranks())
    if plan.tp > 1:  # its slice groups: the TP groups
        assert sorted(topology.get_axis_comm_lists("model")) == sorted(plan.tp_group_ranks())
    for pipe in topology.get_axis_comm_lists("pipe"):  # a column: the same dp, sp and tp rank
        coords = {(c.dp_rank, c.sp_rank, c.tp_rank) for c in map(plan.coords, pipe)}
        assert len(coords) == 1 and [plan.coords(r).pp_stage for r in pipe] == list(range(plan.pp))
        assert [stage_peer(plan, pipe[0], s) for s in range(plan.pp)] == pipe


@pytest.mark.parametrize("parallel,world,says", [
    (dict(pp=2, tp=3), 6, "parallel.tp=3 must divide the LLM's attention heads"),
    (dict(pp=2, sp=3), 6, "parallel.sp=3 must divide the LLM's attention heads"),
    (dict(pp=2, tp=2, sp=4), 16, "tp x sp must divide the query heads"),
    (dict(pp=3, tp=2), 6, "parallel.pp=3 pipeline stages but the LLM has only 2 decoder layers")])
def test_a_degree_the_llm_cannot_split_is_one_error_before_any_process_group(
        tmp_path, parallel, world, says):
    import torch
    from ds_omni.errors import LaunchError, ModelError
    from ds_omni.train.setup import plan_run
    from tests.fixtures import ds_config, tiny_config
    cfg = tiny_config(str(tmp_path), global_batch_size=8)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    with pytest.raises((ModelError, LaunchError), match=says.replace("x", ".")):
        plan_run(cfg, ds_config(1), world)
    assert not torch.distributed.is_initialized()
