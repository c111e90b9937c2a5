"""One plan: training's `ParallelPlan` (from the config, as `plan_run` builds it) and the
simulator's (`SimPlan.parallel_plan`, and the facts the search and the baselines read) agree on
every derived fact over a matrix of degrees, placements, reorder groups and world sizes, refuse
the same plans, and the loader's and the step's views read their facts from the plan."""

import itertools

import pytest

from ds_omni.config import ParallelConfig, ReorderConfig
from ds_omni.data.rank_place import RankPlace
from ds_omni.errors import DsOmniError
from ds_omni.parallel.groups import TorchDataComm
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.sim.bounds import resolved_plan
from ds_omni.sim.plan_spec import SimPlan

REORDERS = [("loader_order", 8), ("fixed", 2), ("budget", 4)]
# (placement, dp given or "auto", world: the plan's own or one replica more), cycled over the
# degrees rather than multiplied with them: 11 entries, prime to the matrix's 2s and 3s
WHERE = list(itertools.product(["stage0", "uniform"], [False, True], [0, 1]))
MATRIX = [degrees + where for degrees, where in zip(
    itertools.product([1, 2, 4], [1, 2], [1, 2], [1, 2], [1, 2, 4], [1, 2], REORDERS,
                      [False, True]), itertools.cycle(WHERE + WHERE[:3]))]


def _configs(dp, sp, tp, pp, msp, ep, pool, placement="stage0", explicit=False):
    """The same parallel section twice: training's `ParallelConfig` fields, and the
    simulator's spelling of them (`SimPlan`'s keywords)."""
    cfg = dict(dp=dp if explicit else "auto", sp=sp, tp=tp, pp=pp, max_sequence_sp=msp, ep=ep,
               encoder_pool="dp" if pool else "off", encoder_placement=placement)
    sim = dict(cfg, dp=dp if explicit else None, encoder_mode="pool" if pool else "reshard")
    del sim["encoder_pool"]
    return cfg, sim


def _plans(dp, sp, tp, pp, msp, ep, reorder, pool, placement="stage0", explicit=False,
           extra=0):
    """(training's plan or its error, the simulator's plan or its error, the SimPlan or its
    error), on dp x sp x tp x pp ranks (`extra`: that many replicas more)."""
    world = (dp + extra) * sp * tp * pp
    mode, group = reorder
    cfg, sim = _configs(dp, sp, tp, pp, msp, ep, pool, placement, explicit)
    out = []
    for build in (
            lambda: ParallelPlan.from_config(ParallelConfig(**cfg), world,
                                             ReorderConfig(mode=mode, group_size=group)),
            lambda: SimPlan(reorder=mode, reorder_group=group, **sim).parallel_plan(world),
            lambda: SimPlan(reorder=mode, reorder_group=group, **sim)):
        try:
            out.append(build())
        except DsOmniError as e:
            out.append(e)
    return out


def _facts(plan: ParallelPlan) -> dict:
    """Every derived fact of the plan, as plain data."""
    ranks = range(plan.world_size)
    return {"degrees": (plan.world_size, plan.dp, plan.sp, plan.tp, plan.pp, plan.ep,
                        plan.max_sequence_sp, plan.encoder_pool),
            "long_item_group": plan.long_item_group, "sp_degrees": plan.sp_degrees,
            "reader_group_size": plan.reader_group_size, "pool_size": plan.pool_size,
            "pool_rank": [plan.pool_rank(r) for r in ranks],
            "replica_rank": [plan.replica_rank(r) for r in ranks],
            "reorder_group": plan.reorder_group, "sequence_blocks": plan.sequence_blocks(),
            "tp_encodes_apart": plan.tp_encodes_apart, "layout": plan.layout(gpus_per_node=4)}


@pytest.mark.parametrize("dp,sp,tp,pp,msp,ep,reorder,pool,placement,explicit,extra", MATRIX)
def test_training_and_the_simulator_build_one_plan(dp, sp, tp, pp, msp, ep, reorder, pool,
                                                   placement, explicit, extra):
    train, sim, simplan = _plans(dp, sp, tp, pp, msp, ep, reorder, pool, placement, explicit,
                                 extra)
    if isinstance(train, DsOmniError):  # refused by training: refused by the simulator too
        assert isinstance(sim, DsOmniError), (train, sim)
        return
    assert not isinstance(sim, DsOmniError), sim
    assert _facts(sim) == _facts(train)
    world = train.world_size
    # what the search and the baselines read without resolving a plan, and the search's cache
    assert ParallelPlan.dp_of(simplan.parallel, world) == train.dp
    assert ParallelPlan.replica_size(simplan.parallel) * train.dp == world
    assert simplan.dp == (train.dp if explicit else None)
    assert _facts(resolved_plan(simplan, world, {})) == _facts(train)
    assert simplan.long_item_group == train.long_item_group
    assert simplan.tp_apart(sim) == train.tp_encodes_apart
    assert simplan.replace(name="again").parallel_plan(world).layout() == train.layout()


@pytest.mark.parametrize("dp,sp,tp,pp,msp,ep,reorder,pool", [m[:8] for m in MATRIX[::7]])
def test_the_facts_are_what_the_groups_say(dp, sp, tp, pp, msp, ep, reorder, pool):
    """Each fact against its definition by the plan's groups, so one plan computing a fact
    wrongly is caught even though the simulator would agree with it."""
    plan = _plans(dp, sp, tp, pp, msp, ep, reorder, pool)[0]
    if isinstance(plan, DsOmniError):
        return
    assert plan.dp * ParallelPlan.model_parallel_size(sp, pp, tp) == plan.world_size
    assert plan.long_item_group == max(sp, msp)
    assert plan.reader_group_size == len(plan.reader_group_ranks()[0])
    assert plan.pool_size == len(plan.seq_data_group_ranks()[0])
    for r in range(plan.world_size):
        pool_ranks = next(g for g in plan.seq_data_group_ranks() if r in g)
        assert pool_ranks[plan.pool_rank(r)] == r  # its place in its pool's ranks
        tp_group = next(g for g in plan.tp_group_ranks() if r in g)
        assert {plan.replica_rank(t) for t in tp_group} == {plan.replica_rank(r)}
    assert plan.tp_encodes_apart == (tp > 1 and sp == 1 and not pool and pp == 1)
    assert len({plan.replica_rank(r) for r in range(plan.world_size)}) == plan.world_size // tp


@pytest.mark.parametrize("dp,sp,tp", [(2, 2, 1), (2, 1, 2), (4, 2, 2), (1, 1, 1)])
def test_the_loader_and_the_step_read_the_plan(dp, sp, tp):
    """`RankPlace` and `TorchDataComm` hold the plan: their ranks and sizes are its own."""
    plan = ParallelPlan.from_config(ParallelConfig(sp=sp, tp=tp), dp * sp * tp,
                                    ReorderConfig(mode="fixed", group_size=2))
    for r in range(plan.world_size):
        place, c = RankPlace(plan=plan, rank=r, num_micro=2), plan.coords(r)
        assert (place.dp_rank, place.sp_rank, place.dp_size, place.sp_size) == \
            (c.dp_rank, c.sp_rank, plan.dp, plan.sp)
        assert (place.reorder_group, place.max_sequence_sp) == (plan.reorder_group,
                                                                plan.max_sequence_sp)
    comm = TorchDataComm(plan)
    assert (comm.dp_size, comm.sp_size, comm.group_size) == (plan.dp, plan.sp, plan.reorder_group)
