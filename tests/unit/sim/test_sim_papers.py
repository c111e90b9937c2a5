"""The papers' baselines as their papers ran them (`ds_omni.sim.baselines`: `megatron_as_run`,
`disaggregated_as_run`, `static_cp_as_run`) are built as the papers state them, and ds_omni's
space holds the tuned baselines' plans: its best is never slower than a tuned baseline whose
plan training can run (`sim_common.own_version`)."""

from __future__ import annotations

import pytest

from benchmarks import sim_bytescale, sim_common
from ds_omni.sim import baselines
from ds_omni.sim.cluster import cluster
from ds_omni.sim.plan_spec import SimPlan


def test_megatron_as_run_is_fixed_tp_pp_with_the_encoder_on_stage0():
    base = SimPlan(global_batch=512, micro_batches=4, pack_tokens=16384, zero_stage=3,
                   reorder="budget", reorder_group=8, encoder_mode="pool", sp=4,
                   max_sequence_sp=1)
    p = baselines.megatron_as_run(base, tp=8, pp=4)
    assert (p.tp, p.pp, p.sp, p.cp, p.max_sequence_sp) == (8, 4, 1, 1, 1)
    assert (p.encoder_placement, p.encoder_mode, p.stage_split) == ("stage0", "replicated",
                                                                     "layers")
    assert (p.reorder, p.zero_stage, p.micro_batches, p.encoder_gpus) == ("loader_order", 1,
                                                                          16, 0)


def test_disaggregated_as_run_sizes_its_pool_once_for_the_average_share():
    """The pool is sized by the share it is given (the average mix's), not by the mix it runs:
    64 GPUs, a share of 1/4, replicas of 8 ranks: 48 LLM GPUs, 16 encoder GPUs, for any mix."""
    plan = SimPlan(global_batch=512, micro_batches=4, pack_tokens=16384 * 8, sp=8,
                   reorder="budget", reorder_group=8)
    p = baselines.disaggregated_as_run(plan, 64, 0.25)
    assert (p.encoder_gpus, p.sp, p.reorder, p.encoder_mode) == (16, 8, "fixed", "reshard")
    assert p.micro_batches == 6  # the same global batch over 6 data-parallel ranks, not 8
    assert baselines.disaggregated_as_run(plan, 64, 0.1).encoder_gpus == 8


def test_static_cp_as_run_holds_the_context_not_the_batch_longest():
    """Static DP x CP at the least degree whose 32K-token shards hold the context: 2M -> 64
    ranks (7B: Ulysses over its 32 heads x a ring of 2; 70B: 64 x 1), 256K -> 8."""
    base = SimPlan(global_batch=8192, micro_batches=4, pack_tokens=32768, zero_stage=1,
                   reorder="budget", max_sequence_sp=32)
    seven = baselines.static_cp_as_run(base, 2097152, heads=32)
    assert (seven.sp, seven.cp, seven.pack_tokens) == (32, 2, 2097152)
    assert (seven.reorder, seven.max_sequence_sp, seven.tp, seven.pp) == ("loader_order", 1, 1, 1)
    seventy = baselines.static_cp_as_run(base, 2097152, heads=64)
    assert (seventy.sp, seventy.cp) == (64, 1)
    assert (baselines.static_cp_as_run(base, 262144, heads=32).sp,
            baselines.static_cp_as_run(base, 262144, heads=32).cp) == (8, 1)


@pytest.mark.slow  # about 30 s on the loaded shared cores
def test_space_holds_the_tuned_static_cp_plans():
    """ByteScale's kind of case, small (Llama-2-7B dims, 64 GPUs, contexts to 128K, rows of 8K
    a rank): ds_omni's per-sequence blocks plus its runs of the tuned static-CP plan are never
    slower than the tuned static CP, and a per-phase breakdown comes with each."""
    gpus, row = 64, 8192
    model, c = sim_common.model_spec(None, "llm_7b"), cluster("h100", gpus)
    samples = sim_bytescale.workload(131072).draw(4 * gpus, 0, ())
    base = SimPlan(name="ds_omni", global_batch=4 * gpus, micro_batches=2, pack_tokens=row,
                   zero_stage=1, reorder="budget", reorder_group=gpus)
    search = sim_common.Search(c, model, samples)
    statics = [base.replace(max_sequence_sp=d, reorder_group=d) for d in (16, 32, 64)]
    tuned = search.baselines(statics, names=("bytescale",))
    own = sim_common.own_version(tuned["bytescale"][0], base)
    assert own is not None and own.reorder == "budget" and own.sp * own.cp > 1
    plan, best = search.best(statics + [own])
    ours, theirs = sim_common.brief(plan, best), sim_common.brief(*tuned["bytescale"])
    assert ours["tokens_per_s"] >= theirs["tokens_per_s"]
    assert sum(ours["phases_s"].values()) > 0 and "llm_fwd" in ours["phases_s"]


def test_own_version_refuses_what_training_cannot_run():
    """Encoders on GPUs of their own (DistTrain-style) is no plan of training's: no own version."""
    plan = SimPlan(sp=8, pack_tokens=8 * 16384, encoder_gpus=16)
    assert sim_common.own_version(plan, SimPlan()) is None


def test_space_holds_the_tuned_colocated_baselines_plans():
    """A small VLM on 16 GPUs: ds_omni's best over its grid and its runs of the tuned baselines'
    plans is never slower than a tuned baseline whose plan training runs (all but DistTrain's)."""
    from tests.unit.sim.test_sim_search import small_vlm
    from ds_omni.sim.workload import WorkloadSpec
    model, c = small_vlm(), cluster("h100", 16)
    samples = WorkloadSpec(image_fraction=0.5, text_median=1000.0, max_tokens=4096,
                           patches_range=(256, 4096)).draw(64, 0, tuple(model.dims.encoders))
    base = SimPlan(name="ds_omni", global_batch=64, micro_batches=2, pack_tokens=4096,
                   reorder="budget", reorder_group=8, zero_stage=1)
    grid = [base, base.replace(sp=2, pack_tokens=8192)]
    search = sim_common.Search(c, model, samples)
    names = ("megatron", "deepspeed", "bytescale", "veomni")
    tuned = search.baselines(grid, names=names)
    own = [sim_common.own_version(plan, base) for plan, _ in tuned.values()]
    plan, best = search.best(grid + [p for p in own if p is not None])
    for (name, (theirs, report)), mine in zip(tuned.items(), own):
        assert theirs is not None and mine is not None, name
        assert (mine.sp, mine.cp, mine.tp, mine.pp, mine.pack_tokens, mine.reorder) == (
            theirs.sp, theirs.cp, theirs.tp, theirs.pp, theirs.pack_tokens, "budget"), name
        assert sim_common.tokens_per_s(best) >= sim_common.tokens_per_s(report), name


def test_the_search_prints_the_papers_baselines_as_run():
    """`ds-omni plan --search`'s as-run baselines (`baselines.as_run`): Megatron-LM at the
    fastest fitting fixed tp x pp of `AS_RUN_TP_PP` (each checked by hand), the disaggregated
    pools and static CP, printed with their degrees."""
    from ds_omni.errors import DsOmniError
    from ds_omni.sim.search import format_search
    from ds_omni.sim.step import simulate
    from tests.unit.sim.test_sim_search import search_case
    c, m, samples, base = search_case()
    got = baselines.as_run(c, m, samples, base, 8192)
    assert set(got) == set(baselines.AS_RUN) and all("step_time" in b for b in got.values()), got
    fitting = []
    for tp, pp in baselines.AS_RUN_TP_PP:
        try:
            r = simulate(c, m, samples, baselines.megatron_as_run(base, tp, pp))
        except DsOmniError:
            continue
        fitting += [(r.step_time, f"tp={tp} pp={pp} sp=1 cp=1")] if r.fits else []
    assert (got["megatron_as_run"]["step_time"], got["megatron_as_run"]["plan"]) == min(fitting)
    text = format_search({"counts": {"candidates": 0, "dropped": 0, "simulated": 0,
                                     "pruned_by_bound": 0, "unexplored": 0}, "seconds": 0.0,
                          "top": [], "baselines": {}, "baselines_as_run": got, "dropped": []})
    assert "baselines as their papers ran them:" in text and "(tp=" in text, text


def test_tuned_baselines_hold_their_as_run_plans():
    """A tuned baseline is never slower than its family as run (`sim_megascale_omni.
    tuned_baselines`): small VLM, 16 GPUs, pools sized for the 5:5 mix. At 9:1 the tuned
    DistTrain's own rule (its pool by 9:1's FLOP share) loses to the as-run pool, the case the
    tuned space once missed: without the as-run plans the check below fails."""
    from benchmarks import sim_megascale_omni as bench
    from tests.unit.sim.test_sim_search import small_vlm
    from ds_omni.sim.workload import WorkloadSpec
    model, c = small_vlm(), cluster("h100", 16)
    draw = lambda f: WorkloadSpec(image_fraction=f, text_median=1000.0, max_tokens=4096,  # noqa
                                  patches_range=(256, 4096)).draw(64, 0, ("vision",))
    base = SimPlan(name="ds_omni", global_batch=64, micro_batches=2, pack_tokens=4096,
                   reorder="budget", reorder_group=8, zero_stage=1)
    grid = [base, base.replace(sp=2, pack_tokens=8192)]
    as_run = bench.as_run_plans(sim_common.Search(c, model, draw(0.5)), grid)
    rate = lambda found: sim_common.tokens_per_s(found[1])  # noqa: E731
    for mix in (0.1, 0.9):
        search = sim_common.Search(c, model, draw(mix))
        fixed = {name: sim_common.fixed(search, plan)["tokens_per_s"]
                 for name, (plan, _) in as_run.items()}
        tuned = bench.tuned_baselines(search, grid, as_run)
        assert rate(tuned["disttrain"]) >= fixed["disaggregated_as_run"], mix
        assert rate(tuned["megatron"]) >= fixed["megatron_as_run"], mix
    rule_only = search.baselines(grid, names=("disttrain",))["disttrain"]
    assert rate(rule_only) < fixed["disaggregated_as_run"]  # the planted miss is caught


def test_a_swinging_run_costs_the_pool_sized_once():
    """A run whose mix swings (`sim_common.Swing`: 1:9 then 9:1, small VLM, 16 GPUs) is its steps
    summed under one plan; the disaggregated pool sized once for the 1:9 step's share puts the
    encoders on the 9:1 step's critical path, so the run is slower than with the pool re-sized for
    each step (the mix swinging past the fixed pool). Planted: a Swing that read only its first
    step would report the 1:9 step's rate, which the check below tells apart."""
    from tests.unit.sim.test_sim_search import small_vlm
    from ds_omni.sim.workload import WorkloadSpec
    model, c = small_vlm(), cluster("h100", 16)
    draw = lambda f: WorkloadSpec(image_fraction=f, text_median=1000.0, max_tokens=4096,  # noqa
                                  patches_range=(256, 4096)).draw(64, 0, ("vision",))
    steps = [sim_common.Search(c, model, draw(f)) for f in (0.1, 0.9)]
    run = sim_common.Swing(c, model, steps[0].samples, steps=steps)
    base = SimPlan(global_batch=64, micro_batches=2, pack_tokens=4096, zero_stage=1)
    pool = lambda s: baselines.disaggregated_as_run(  # noqa: E731
        base, 16, baselines.encoder_share(model, s.samples))
    fixed, each = run.run(pool(steps[0])), [s.run(pool(s)) for s in steps]
    alone = [s.run(pool(steps[0])) for s in steps]
    assert fixed.tokens == sum(r.tokens for r in alone)
    assert fixed.step_time == pytest.approx(sum(r.step_time for r in alone), rel=1e-12)
    assert fixed.fits == all(r.fits for r in alone)
    assert pool(steps[0]).encoder_gpus < pool(steps[1]).encoder_gpus
    assert fixed.step_time > sum(r.step_time for r in each)
    first_only = sim_common.tokens_per_s(alone[0])
    assert sim_common.tokens_per_s(fixed) != pytest.approx(first_only, rel=1e-3)
