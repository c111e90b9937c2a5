"""The encoder pool's own costs in the simulator (`sim/pool_sim.py`: `plan_pool`, `pool_calls`):
the step's planning (the metadata all-gather, `Cluster.pool_item_s` an item) and, in a round
whose plan moves an item, the pool's all-to-all calls (`POOL_CALLS` x `Cluster.a2a_call_s`).
Before them a pool plan that moves nothing was priced exactly as plain data parallelism, while
training runs `EncoderPool.plan_step` every step (the validation's pool2_image vs dp2_image).

Planted error "sim_pool_plan_free" (tests/plants/sim.py): the step's pool planning charged nothing.
"""

import dataclasses

import numpy as np
import pytest

from ds_omni.data.cost import EncoderDims, ModelDims
from ds_omni.sim import calibrate_comm, pool_sim
from ds_omni.sim.cluster import cluster
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import simulate
from ds_omni.sim.workload import Samples
from tests import plants


def tiny() -> ModelSpec:
    return ModelSpec.from_dims(ModelDims(hidden=64, layers=2, intermediate=128, vocab=1000,
                                         encoders={"vision": EncoderDims(hidden=32, layers=2,
                                                                         intermediate=64)}))


def image_samples(patches) -> Samples:
    """One image a sample, of `patches` [N] encoder positions (16 text tokens around it)."""
    n = len(patches)
    rows = np.asarray(patches, dtype=np.int64)
    return Samples(rows + 16, np.arange(n, dtype=np.int64), np.array(["vision"] * n),
                   rows, rows)


def busy(report) -> np.ndarray:
    return np.asarray(report.compute) + np.asarray(report.comm)


C = dataclasses.replace(cluster("cpu", 2, 2), pool_item_s=1e-3, a2a_call_s=2e-3)
PLAN = SimPlan(global_batch=8, micro_batches=2, pack_tokens=4096, reorder="loader_order")


def check_pool_planning_charged():
    """Even images: the pool moves nothing, so only its planning separates it from dp."""
    samples = image_samples([64] * 8)
    dp = simulate(C, tiny(), samples, PLAN)
    pool = simulate(C, tiny(), samples, PLAN.replace(encoder_mode="pool"))
    gather = 2 * C.intra_latency  # two all-gathers of one latency each on 2 ranks
    # 8 items: the CPU of their planning on every rank, plus the two all-gathers' latencies
    assert busy(pool) - busy(dp) == pytest.approx(8 * 1e-3 + gather, rel=0.05)


def test_pool_planning_is_charged_once_a_step():
    check_pool_planning_charged()


def test_a_round_that_moves_items_pays_the_pool_calls():
    """Rank 0 reads the four large images, rank 1 four tiny ones (loader order): the pool moves
    large ones to rank 1 and every rank pays POOL_CALLS calls in those rounds."""
    samples = image_samples([2048] * 4 + [4] * 4)
    calls = dataclasses.replace(C, pool_item_s=0.0)
    free = dataclasses.replace(calls, a2a_call_s=0.0)
    plan = PLAN.replace(encoder_mode="pool")
    with_calls, without = simulate(calls, tiny(), samples, plan), simulate(free, tiny(), samples,
                                                                             plan)
    extra = busy(with_calls) - busy(without)
    moved_rounds = round(extra[0] / (pool_sim.POOL_CALLS * 2e-3))
    assert moved_rounds >= 1
    assert extra == pytest.approx([moved_rounds * pool_sim.POOL_CALLS * 2e-3] * 2)


def test_pool_planning_micro_benchmark_is_a_small_positive_time():
    per_item = calibrate_comm.time_pool_planning(2, per_rank=4, rounds=2, repeats=3)
    assert 0 < per_item < 1e-3  # microseconds an item in Python, not milliseconds


@pytest.mark.parametrize("plant", plants.for_launch("sim_pool"))
def test_plant_sim_pool(plant):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_pool_planning_charged()


@pytest.mark.parametrize("placement", ["stage0", "uniform", "bubbles"])
def test_the_pool_under_pp_spreads_the_encoders_over_a_stages_ranks(placement):
    """pp2 x dp2 (`sim/pool_sim.py`): data-parallel rank 0 reads the four large images, rank
    1 four tiny ones. Without the pool the encoders' work stays in rank 0's pipeline (stage 0's
    rank 0 under "stage0", ranks 0 and 2 under "uniform" and "bubbles"); with it the pool moves
    large images to rank 1's pipeline on every stage that encodes (under "bubbles" each column
    places the pool's items: `pool_sim.pool_owned_rounds`), and prices their inputs' exchange."""
    samples = image_samples([4096] * 4 + [4] * 4)
    c = dataclasses.replace(cluster("cpu", 4, 4), pool_item_s=0.0)
    plan = PLAN.replace(pp=2, encoder_placement=placement, zero_stage=1)
    off, on = (simulate(c, tiny(), samples, plan.replace(encoder_mode=mode))
               for mode in ("reshard", "pool"))
    stages = [0] if placement == "stage0" else [0, 1]
    for s in stages:  # stage s's ranks: 2 s (dp 0), 2 s + 1 (dp 1)
        mine, other = 2 * s, 2 * s + 1
        assert np.asarray(on.compute)[other] > np.asarray(off.compute)[other] * 1.5, (s, on, off)
        assert np.asarray(on.compute)[mine] < np.asarray(off.compute)[mine], s
    assert on.all_to_all_bytes["pool_inputs"] > 0 and off.all_to_all_bytes["pool_inputs"] == 0


# ------------------------------------------- the pool under pp, priced once for every tp
def folded_case(tp: int, placement: str = "stage0"):
    """pp2 x dp2 x tp on nodes of 2 GPUs (the TP copies' messages cross nodes), pool mode."""
    from ds_omni.sim.step import Step
    c = dataclasses.replace(cluster("cpu", 4 * tp, 2), pool_item_s=0.0, a2a_call_s=1e-4)
    samples = image_samples([4096] * 4 + [4] * 4)  # dp rank 0 reads the large ones
    plan = PLAN.replace(pp=2, tp=tp, encoder_placement=placement, zero_stage=1,
                        encoder_mode="pool")
    return c, Step(c, tiny(), samples, plan, cache={})


def check_folded_pool_is_round_works():
    """The pool's plan under pp is computed once with tp folded away (`pool_sim.pool_folded`):
    every TP rank's loads equal TP rank 0's, which are the same at every tp (the pipeline's
    `_micro_arrays` keeps them without tp in its key), and equal `round_work`'s under tp, whose
    messages' seconds and bytes `encode_sim.exchanges(c, folded, tp)` prices exactly."""
    from ds_omni.sim import encode_sim
    loads = {}
    for tp in (1, 2, 4):
        c, step = folded_case(tp)
        loads[tp] = pool_sim.pool_loads(step)  # [M, D]
        for m in range(step.plan.micro_batches):
            rows = [encode_sim.Row(step.ranks_of(d, 1), r[m].samples)
                    for d, r in enumerate(step.assignment.rounds) if r[m].samples.size]
            whole = encode_sim.round_work(rows, step.layout, step.pplan.seq_data_size * tp,
                                          "pool", pool_sim.pool_long(step), step.heads,
                                          step.model.cost.encoder_names, tp)
            assert np.array_equal(whole.flops.reshape(-1, tp), np.repeat(
                loads[tp][m][:, None], tp, axis=1)), (tp, m)
            for (s, moved), (want, want_moved) in zip(
                    encode_sim.exchanges(c, pool_sim.pool_folded(step, m), tp),
                    encode_sim.exchanges(c, whole)):
                assert np.array_equal(s, want) and moved == want_moved, (tp, m)
            assert whole.inputs, "no input moved: the check would see too little"
    assert np.array_equal(loads[1], loads[2]) and np.array_equal(loads[1], loads[4])


def test_the_pool_under_pp_is_planned_once_for_every_tp():
    check_folded_pool_is_round_works()


@pytest.mark.parametrize("plant", plants.for_launch("sim_pool_folded"))
def test_plant_sim_pool_folded(plant):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_folded_pool_is_round_works()
