"""The simulator under parallel.tp as training runs it (`ds_omni.sim.encode_sim`, `model_parallel`):

- tp alone (`tp_encodes_apart`): each TP rank encodes its LPT share of the row's items (the
  training's `plan_tp_encode`), the rows are all-gathered over TP and every micro-batch's
  encoder gradients all-reduced over TP: on a row of 2 equal items at tp 2 the busiest rank's
  encoder time halves, against hand counts of the gather and the all-reduce;
- tp x sp: each TP rank runs Ulysses over its SP group with heads / tp (1/tp of the bytes a rank
  sends under sp alone, by hand), and encodes its SP rank's share (the same as under sp alone);
- the search's lower bounds stay below the simulated time on random plans, tp x sp included;
  the search ranks tp x sp plans;
- a planted error (every TP rank encodes the whole row again) makes the split's test fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds_omni.data.cost import EncoderDims, ModelDims
from ds_omni.errors import DsOmniError
from ds_omni.sim import ModelSpec, SimPlan, WorkloadSpec, cluster, comm, simulate
from ds_omni.sim import bounds
from ds_omni.sim.bounds import Shell
from ds_omni.sim.search import SearchSpace, candidates, search
from ds_omni.sim.step import Step, encoder_work, loader_plan, round_rows
from ds_omni.sim.workload import Samples
from tests import plants


def vlm() -> ModelSpec:
    dims = ModelDims(hidden=2048, layers=8, intermediate=5504, vocab=32000, kv_hidden=512,
                     encoders={"vision": EncoderDims(hidden=1024, layers=8, intermediate=4096)})
    return ModelSpec.from_dims(dims, heads=16, kv_heads=4)


def two_equal_items(patches: int = 1024, rows: int = 256, text: int = 512) -> Samples:
    """One sample with two images of `patches` patches and `rows` placeholder rows each."""
    return Samples(np.array([text + 2 * rows]), np.array([0, 0]), np.array(["vision"] * 2),
                   np.array([patches] * 2), np.array([rows] * 2))


def step_of(samples: Samples, plan: SimPlan, gpus: int) -> Step:
    return Step(cluster("h100", gpus, gpus), vlm(), samples, plan)


# ------------------------------------------------------------------------ tp alone: apart
def check_tp_split_halves_the_busiest_encoder() -> None:
    m, s = vlm(), two_equal_items()
    plan = SimPlan(tp=2, zero_stage=1, global_batch=1, micro_batches=1, pack_tokens=4096)
    step = step_of(s, plan, 2)
    work = encoder_work(step, round_rows(step, 0), 0)
    item = float(m.cost.encoder_cost("vision", np.array([1024]))[0])  # the cost model's own
    assert work.flops.tolist() == pytest.approx([item, item])  # one item each: half of 2 items
    # every TP rank sends its 256 rows (bf16, width h) to the other
    assert sorted(work.tp_gathers) == [(0, 1, 256 * m.dims.hidden * 2),
                                       (1, 0, 256 * m.dims.hidden * 2)]


def test_tp_split_halves_the_busiest_rank_encoder_time_and_adds_gather_and_all_reduce():
    check_tp_split_halves_the_busiest_encoder()
    m, c, s = vlm(), cluster("h100", 2, 2), two_equal_items()
    plan = SimPlan(tp=2, zero_stage=1, global_batch=1, micro_batches=1, pack_tokens=4096)
    r = simulate(c, m, s, plan)
    h, enc = m.dims.hidden, m.encoder_params("vision")  # tower + projector, trained
    assert r.all_to_all_bytes["tp_gather"] == pytest.approx(2 * 256 * h * 2)
    # a ring all-reduce of the encoder's bf16 gradients: 2 (tp - 1) / tp of them a rank, 1 round
    assert r.all_to_all_bytes["encoder_tp_grads"] == pytest.approx(2 * 2 * (1 / 2) * enc * 2)
    by_phase = r.summary()["critical_path"]["by_phase"]
    link = comm.link_of(c, [0, 1])
    assert by_phase["encode_tp"] == pytest.approx(comm.all_reduce(enc * 2, 2, link))
    assert by_phase["tp_gather"] == pytest.approx(link.latency + 256 * h * 2 / link.bandwidth)
    # the busiest rank's encoder seconds: one item's forward + backward, half of the row's two
    step = step_of(s, plan, 2)
    assert step.tp_apart
    enc_s = by_phase.get("encode_fwd", 0.0) + by_phase.get("encode_bwd", 0.0)
    item = float(m.cost.encoder_cost("vision", np.array([1024]))[0])
    assert enc_s == pytest.approx(item / c.flops_per_s)


@pytest.mark.parametrize("plant", plants.for_launch("sim_tp"))
def test_plant_sim_tp(plant):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_tp_split_halves_the_busiest_encoder()


# ------------------------------------------------------------------------------ tp x sp
def test_tp_x_sp_ulysses_bytes_are_one_tp_th_of_sp_alone_and_encoders_follow_sp():
    m, s = vlm(), two_equal_items(rows=512, text=3072)
    sp = SimPlan(sp=2, zero_stage=1, global_batch=1, micro_batches=1, pack_tokens=8192)
    both = sp.replace(tp=2)
    alone, tpsp = simulate(cluster("h100", 2, 2), m, s, sp), simulate(cluster("h100", 4, 4), m,
                                                                     s, both)
    tokens, d = 3072 + 1024, m.dims
    calls = 1 + 1 + 1  # forward, backward (the gradients back the same way), the recomputed forward
    per_rank_sp = tokens / 2 * (2 * d.hidden + 2 * m.kv) * 2 * d.layers * calls * (1 / 2)
    assert alone.all_to_all_bytes["llm_ulysses"] / 2 == pytest.approx(per_rank_sp)
    assert tpsp.all_to_all_bytes["llm_ulysses"] / 4 == pytest.approx(per_rank_sp / 2)
    assert tpsp.all_to_all_bytes["tp_gather"] == 0  # no gather: the SP plan places the items
    # each TP rank encodes its SP rank's share, as under sp alone
    a, b = step_of(s, sp, 2), step_of(s, both, 4)
    wa, wb = encoder_work(a, round_rows(a, 0), 0), encoder_work(b, round_rows(b, 0), 0)
    assert wb.flops.tolist() == pytest.approx(np.repeat(wa.flops, 2).tolist())
    assert sum(n for _, _, n in wb.sends) == pytest.approx(2 * sum(n for _, _, n in wa.sends))
    # TP's all-reduces under tp x sp: each TP group holds its SP rank's half of the tokens
    calls_tp = 2 * d.layers * (1 + 2)
    assert tpsp.all_to_all_bytes["llm_tp"] == pytest.approx(
        2 * calls_tp * 2 * (2 - 1) * tokens / 2 * d.hidden * 2)


def test_tp_x_sp_must_divide_the_heads():
    twelve = ModelSpec.from_dims(vlm().dims, heads=12, kv_heads=4)
    with pytest.raises(DsOmniError, match=r"parallel.tp x parallel.sp=8 must divide the LLM's "
                                          r"attention heads \(12\)"):
        simulate(cluster("h100", 8, 8), twelve, two_equal_items(),
                 SimPlan(tp=2, sp=4, global_batch=1, micro_batches=1))


# ------------------------------------------------------------------ bounds and the search
def test_bounds_stay_below_the_simulated_step_on_random_plans_with_tp_x_sp():
    m, c = vlm(), cluster("h100", 8, 8)
    samples = WorkloadSpec(max_tokens=8192).draw(32, 0, ("vision",))
    base = SimPlan(global_batch=32, micro_batches=4, pack_tokens=8192)
    every = candidates(base, 8, 8, m, SearchSpace(degrees=(1, 2, 4), zero_stages=(1, 2),
                                                  reorder_groups=(4,), checkpointing=(True,)))
    both = [f for f in every if f["tp"] > 1 and f["sp"] > 1]
    rest = [f for f in every if not (f["tp"] > 1 and f["sp"] > 1)]
    rng = np.random.default_rng(0)
    picked = both + [rest[i] for i in rng.choice(len(rest), 24, replace=False)]
    totals, tried = bounds.totals_of(m, samples), 0
    for fields in picked:
        try:
            plan = base.replace(**fields)
            shell = Shell(c, m, samples, plan)
            r = simulate(c, m, samples, plan)
        except DsOmniError:
            continue  # training refuses it
        refined = bounds.refined_bound(shell, loader_plan(totals["per_sample"]["cost"],
                                                          samples.tokens, shell.pplan, plan),
                                       totals)
        assert bounds.lower_bound(shell, totals) <= refined * (1 + 1e-9)
        assert refined <= r.step_time * (1 + 1e-9), fields
        tried += 1
    assert tried >= 10 and len(both) >= 4


def test_search_ranks_tp_x_sp_plans():
    m = vlm()
    c = cluster("h100", 4, 4)
    samples = WorkloadSpec(max_tokens=8192).draw(16, 0, ("vision",))
    base = SimPlan(global_batch=16, micro_batches=2, pack_tokens=8192)
    space = SearchSpace(degrees=(1, 2), zero_stages=(1,), encoder_modes=("reshard",),
                        reorder_groups=(4,), checkpointing=(True,))
    out = search(c, m, samples, base, top=100, space=space, prune=False, baselines=False)
    ranked = [r for r in out.top if r.plan.tp == 2 and r.plan.sp == 2]
    assert ranked, [d for d in out.dropped if "tp=2" in d["plan"]]
    assert all(0 < r.bound <= r.step_time for r in ranked)
    times = [r.step_time for r in out.top]
    assert times == sorted(times)
