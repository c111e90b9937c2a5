"""The step simulator end to end on small clusters: the critical path moves with the load, the
loader's and the encoders' planners of training are the ones it runs, baselines are plain
plans, and bad input fails with a clear error."""

import numpy as np
import pytest

from ds_omni.data import reorder
from ds_omni.data.cost import EncoderDims, ModelDims
from ds_omni.errors import ConfigError, DataError, LaunchError, ModelError
from ds_omni.parallel import reshard
from ds_omni.parallelize import encoder_pool
from ds_omni.sim import baselines
from ds_omni.sim.cluster import cluster
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import simulate
from ds_omni.sim.timeline import Timeline
from ds_omni.sim.workload import Samples, WorkloadSpec, from_check_report


def llava_7b() -> ModelSpec:
    """A Llama-2-7B-like LLM with a CLIP-L-like vision tower."""
    return ModelSpec.from_dims(ModelDims(hidden=4096, layers=32, intermediate=11008, vocab=32000,
                                         encoders={"vision": EncoderDims(hidden=1024, layers=24,
                                                                         intermediate=4096)}))


def text_samples(tokens) -> Samples:
    empty = np.zeros(0, dtype=np.int64)
    return Samples(np.asarray(tokens, dtype=np.int64), empty, np.array([], dtype=str), empty, empty)


def test_timeline_sync_and_critical_path_by_hand():
    tl = Timeline(2, ("work", "meet"))
    tl.run([0, 1], "work", [1.0, 3.0])
    tl.sync([0, 1], [0, 0], "meet", 0.5)
    assert tl.step_time == pytest.approx(3.5)
    assert tl.idle.tolist() == pytest.approx([2.0, 0.0])
    # the step's end (either rank's collective) waited on rank 1's work
    assert tl.critical_path() == [{"rank": 1, "phase": "work", "seconds": 3.0},
                                  {"rank": 0, "phase": "meet", "seconds": 0.5}]


def test_critical_path_follows_the_heavy_rank_and_reordering_evens_it():
    c, m = cluster("h100", 2, 2), llava_7b()
    plan = SimPlan(reorder="loader_order", global_batch=8, micro_batches=2, pack_tokens=40000)
    heavy_first = text_samples([30000] + [1000] * 7)
    heavy_last = text_samples([1000] * 7 + [30000])
    first = simulate(c, m, heavy_first, plan)
    last = simulate(c, m, heavy_last, plan)
    assert (first.critical_rank, last.critical_rank) == (0, 1)  # rank 0 reads samples 0-3
    assert first.critical_phase == "llm_bwd"
    assert first.idle[1] > 0.5 * first.step_time and first.idle[0] < 0.05 * first.step_time
    balanced = simulate(c, m, text_samples([30000, 30000] + [1000] * 6),
                        plan.replace(reorder="fixed", reorder_group=2))
    unbalanced = simulate(c, m, text_samples([30000, 30000] + [1000] * 6), plan)
    assert max(balanced.idle) < 0.1 * max(unbalanced.idle)  # LPT puts one long one per rank
    assert balanced.step_time < 0.75 * unbalanced.step_time


def _counting(monkeypatch, owner, name: str) -> list:
    calls, original = [], getattr(owner, name)

    def counted(*a, **k):
        calls.append(1)
        return original(*a, **k)
    monkeypatch.setattr(owner, name, counted)
    return calls


def test_the_simulator_runs_trainings_planners(monkeypatch):
    fixed = _counting(monkeypatch, reorder, "assign_fixed")
    pool = _counting(monkeypatch, encoder_pool, "plan_round")
    resharded = _counting(monkeypatch, reshard, "place_items")  # plan_reshard's decisions
    c, m = cluster("h100", 8, 8), llava_7b()
    work = WorkloadSpec(image_fraction=0.8, max_tokens=8192, patches_range=(64, 2048))
    plan = SimPlan(sp=2, zero_stage=3, global_batch=32, micro_batches=2, pack_tokens=16384,
                   reorder_group=4)
    simulate(c, m, work, plan.replace(encoder_mode="pool"))
    assert len(fixed) == 1 and len(pool) == 2  # one reorder group; one pool plan per round
    simulate(c, m, work, plan)
    assert len(resharded) == 2 * 4  # per round, each of the 4 SP groups' rows
    # the planners' output is what the step runs: loader order in place of LPT changes it
    ordered = simulate(c, m, work, plan.replace(reorder="loader_order"))
    assert ordered.step_time != simulate(c, m, work, plan).step_time


def test_a_plan_equal_to_a_baseline_takes_the_same_time():
    c, m = cluster("h100", 16, 8), llava_7b()
    samples = WorkloadSpec(image_fraction=0.5, max_tokens=8192).draw(64, seed=3,
                                                                     encoders=("vision",))
    plan = SimPlan(pp=2, global_batch=64, micro_batches=4, pack_tokens=16384)
    by_hand = SimPlan(name="by hand", pp=2, global_batch=64, micro_batches=4, pack_tokens=16384,
                      reorder="loader_order", long_items=False, encoder_mode="replicated",
                      encoder_placement="stage0", stage_split="layers", zero_stage=1)
    assert simulate(c, m, samples, baselines.megatron(plan)).step_time == \
        simulate(c, m, samples, by_hand).step_time
    reports = baselines.compare(c, m, samples, plan.replace(pp=1, encoder_mode="pool"))
    assert set(reports) == {"plan", *baselines.BASELINES}, reports
    assert all(r.step_time > 0 for r in reports.values())
    assert reports["disttrain"].plan["encoder_gpus"] >= 1


def test_memory_by_zero_stage_and_what_does_not_fit():
    c, m = cluster("h100", 8, 8), llava_7b()
    samples = text_samples([4000] * 16)
    plan = SimPlan(global_batch=16, micro_batches=2, pack_tokens=8192)
    z1 = simulate(c, m, samples, plan)
    z3 = simulate(c, m, samples, plan.replace(zero_stage=3))
    assert z3.memory["params"] == pytest.approx(z1.memory["params"] / 8)
    assert z3.memory["optimizer"] == pytest.approx(z1.memory["optimizer"])  # both partitioned
    assert z1.fits and z3.peak_memory < z1.peak_memory
    z0 = simulate(c, m, samples, plan.replace(zero_stage=0))
    assert not z0.fits  # 16 bytes x 7.4 B parameters on one 80 GiB GPU


def test_bad_input_errors():
    m = llava_7b()
    with pytest.raises(ModelError, match="no plan fits"):
        simulate(cluster("cpu", 1, 1), m, text_samples([100]), SimPlan(global_batch=1))
    with pytest.raises(DataError, match="no samples"):
        simulate(cluster("h100", 8), m, text_samples([]), SimPlan(global_batch=8))
    with pytest.raises(DataError, match="at least one sample"):
        WorkloadSpec().draw(0, seed=0)
    with pytest.raises(DataError, match="has no such encoder"):
        WorkloadSpec(audio_fraction=0.2).draw(8, seed=0, encoders=("vision",))
    with pytest.raises(LaunchError):  # dp x sp x pp must match the GPUs: training's own check
        simulate(cluster("h100", 8), m, text_samples([100] * 8), SimPlan(dp=3, global_batch=8))
    with pytest.raises(ConfigError, match="encoder_mode"):
        SimPlan(encoder_mode="everywhere")
    with pytest.raises(DataError, match="no checked samples"):
        from_check_report({"sources": {}})


def test_workload_from_a_data_check_report():
    report = {"sources": {"a": {"checked": 100, "modalities": {"image": 40, "audio": 0,
                                                               "video": 0, "text_only": 60},
                                "tokens": {"buckets": {"<=512": 50, "<=2048": 50}},
                                "items_per_sample": {"0": 60, "1": 20, "3": 20}}}}
    spec = from_check_report(report)
    assert spec.image_fraction == pytest.approx(0.4) and spec.audio_fraction == 0
    assert spec.images_geometric_p == pytest.approx(0.5)  # two images per image sample
    s = spec.draw(400, seed=1, encoders=("vision",))
    text_only = np.setdiff1d(np.arange(400), s.item_sample)
    assert 256 <= s.tokens[text_only].min() and s.tokens[text_only].max() <= 2048
    assert spec.draw(400, seed=1, encoders=("vision",)).tokens.tolist() == s.tokens.tolist()


def test_pipeline_runs_1f1b_as_the_two_stage_formula_says():
    """Two stages, four equal micro-batches, free links: stage s's forward F_s and backward B_s
    follow its share of the LLM's layers (the boundaries training computes); 1F1B then takes
    max(F0 + M (F1 + B1) + B0, M (F0 + B0) + F1 + B1)."""
    from ds_omni.sim.cluster import Cluster
    from ds_omni.sim.pipeline_sim import stage_plan
    from ds_omni.sim.step import Step
    free = Cluster(gpus=2, gpus_per_node=2, flops=1e15, hbm_bytes=1e12, intra_bw=1e30,
                   intra_latency=0.0, inter_bw=1e30, inter_latency=0.0)
    m, samples = llava_7b(), text_samples([4096] * 8)
    for split in ("cost", "parameters"):
        plan = SimPlan(pp=2, global_batch=8, micro_batches=4, pack_tokens=8192,
                       stage_split=split, zero_stage=0, checkpointing=True)
        step = Step(free, m, samples, plan)
        times = np.array(stage_plan(step).layer_time)
        micro = float(m.cost.llm_cost(np.array([4096, 4096])).sum())  # one micro-batch
        f = micro * times / times.sum() / 3 / free.flops_per_s
        b = 3 * f  # backward 2 forwards, and one more recomputed
        want = max(f[0] + 4 * (f[1] + b[1]) + b[0], 4 * (f[0] + b[0]) + f[1] + b[1])
        assert simulate(free, m, samples, plan).step_time == pytest.approx(want, rel=1e-12)


def test_uniform_encoder_placement_unloads_stage_zero():
    c, m = cluster("h100", 8, 8), llava_7b()
    samples = WorkloadSpec(image_fraction=1.0, max_tokens=8192,
                           patches_range=(1024, 4096)).draw(32, seed=0, encoders=("vision",))
    plan = SimPlan(pp=4, global_batch=32, micro_batches=8, pack_tokens=16384)
    stage0 = simulate(c, m, samples, plan)
    uniform = simulate(c, m, samples, plan.replace(encoder_placement="uniform"))
    assert uniform.step_time < stage0.step_time
    assert stage0.critical_path[0]["rank"] < 2  # the first stage's ranks start the chain


def test_joint_pipeline_touches_its_encoder_replicas_once_a_step():
    """`uniform`: each stage encodes its share of the step's items once, before the schedule
    (`parallelize.joint`), so the replicas' per-micro-batch weight cost is paid once a step,
    not once per micro-batch; each stage steps 1/P of the encoders (their owners), and the
    owners' gradients and parameters cross the pipeline once a step. On a machine with free
    FLOPs, only the per-parameter costs are left: checked against those terms by hand."""
    from ds_omni.sim import comm
    from ds_omni.sim.cluster import Cluster
    from ds_omni.sim.pipeline_sim import stage_params, stage_plan
    from ds_omni.sim.step import Step
    c = Cluster(gpus=2, gpus_per_node=2, flops=1e30, hbm_bytes=1e12, intra_bw=1e9,
                intra_latency=1e-4, inter_bw=1e9, inter_latency=1e-4,
                micro_batch_s_per_param=1e-9, optimizer_s_per_param=1e-8)
    m = llava_7b()
    samples = WorkloadSpec(image_fraction=1.0, max_tokens=4096,
                           patches_range=(256, 512)).draw(8, seed=0, encoders=("vision",))
    plan = SimPlan(pp=2, global_batch=8, micro_batches=4, pack_tokens=8192,
                   encoder_placement="uniform", zero_stage=0, checkpointing=False)
    r = simulate(c, m, samples, plan)
    step = Step(c, m, samples, plan)
    step.stage_plan = stage_plan(step)
    enc = m.encoder_params("vision")
    for s in range(2):
        params, trained = stage_params(step, s)
        llm = params - enc
        assert trained == pytest.approx(llm + enc / 2)  # the owner's half of the encoder
        want = (4 * llm + enc) * c.micro_batch_s_per_param + trained * c.optimizer_s_per_param
        assert r.compute[s] == pytest.approx(want, rel=1e-9)
    link = comm.link_of(c, [0, 1])
    shards = comm.reduce_scatter(enc * 2, 2, link) + comm.all_gather(enc * 2, 2, link)
    assert min(r.comm) > shards  # plus the stages' activations and the rows to stage 0


def test_a_disttrain_baseline_without_llm_gpus_is_an_error_not_a_crash():
    """2 GPUs under pp=2: no GPU is left for the LLM beside the encoders' one; the search
    reports that baseline's error (it used to stop on an empty max())."""
    from ds_omni.sim.baselines import baseline_plans
    from ds_omni.sim.search import _baselines
    c, m = cluster("h100", 2, 2), llava_7b()
    samples = WorkloadSpec(image_fraction=1.0, max_tokens=4096,
                           patches_range=(256, 512)).draw(8, seed=0, encoders=("vision",))
    plan = SimPlan(pp=2, global_batch=8, micro_batches=4, pack_tokens=8192, zero_stage=1)
    assert baseline_plans(plan, 2, m, samples)["disttrain"].encoder_gpus == 2
    res = _baselines(c, m, samples, plan, {})
    assert "must leave GPUs for the LLM" in res["disttrain"]["error"]
    assert res["megatron"]["step_time"] > 0


def test_each_ulysses_call_pays_the_fitted_call_cost():
    """`Cluster.a2a_call_s` (fitted on CPU from sp runs): a rank's communication grows by it
    once per Ulysses all-to-all call: 4 a layer in forward, 4 in backward, 4 more recomputing
    under checkpointing, each micro-batch (text only: no encoder calls)."""
    import dataclasses
    from ds_omni.sim import comm
    m, samples = llava_7b(), text_samples([4096] * 8)
    base = cluster("h100", 2, 2)
    for ckpt in (False, True):
        plan = SimPlan(sp=2, global_batch=8, micro_batches=4, pack_tokens=8192,
                       checkpointing=ckpt)
        plain = simulate(base, m, samples, plan)
        paid = simulate(dataclasses.replace(base, a2a_call_s=1e-3), m, samples, plan)
        calls = m.dims.layers * comm.ULYSSES_CALLS * (2 + ckpt) * 4
        assert paid.comm[0] - plain.comm[0] == pytest.approx(calls * 1e-3, rel=1e-9)


def test_zero3_ranks_without_images_run_the_encoders_dummy():
    """Training's rule (`encoder_dummies_needed`): under ZeRO-3 a micro-batch with no image
    still runs the vision tower once on its dummy input; under ZeRO-1 it does not."""
    dims = ModelDims(hidden=4096, layers=32, intermediate=11008, vocab=32000, encoders={
        "vision": EncoderDims(hidden=1024, layers=24, intermediate=4096, dummy_len=577)})
    m, c = ModelSpec.from_dims(dims), cluster("h100", 8, 8)
    samples, plan = text_samples([2000] * 16), SimPlan(global_batch=16, micro_batches=2,
                                                       pack_tokens=8192)
    z1 = simulate(c, m, samples, plan)
    z3 = simulate(c, m, samples, plan.replace(zero_stage=3))
    dummy = float(m.cost.encoder_cost("vision", [577])[0])
    assert np.asarray(z3.compute) - np.asarray(z1.compute) == pytest.approx(
        [2 * dummy / c.flops_per_s] * 8, rel=1e-9)  # one dummy per round, 2 rounds
