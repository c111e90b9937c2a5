"""The bubbles schedule on simulated ranks (`ds_omni.sim.bubble_sim`): encoder work moves into the
pipeline's idle slots, what does not fit stays on the critical path, and "auto" picks it only
where the cost model predicts a gain."""

from __future__ import annotations

import pytest

from ds_omni.data.cost import EncoderDims, ModelDims
from ds_omni.parallel.bubbles import picks_bubbles, typical_schedule
from ds_omni.sim import bubble_sim
from ds_omni.sim.cluster import cluster
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import Step, simulate
from ds_omni.sim.workload import WorkloadSpec
from tests import plants


def vlm(llm_layers: int, vit_layers: int, vit_hidden: int, dummy_len: int = 1024) -> ModelSpec:
    return ModelSpec.from_dims(ModelDims(
        hidden=4096, layers=llm_layers, intermediate=11008, vocab=32000,
        encoders={"vision": EncoderDims(hidden=vit_hidden, layers=vit_layers,
                                        intermediate=4 * vit_hidden, dummy_len=dummy_len)}))


def draw(image_fraction: float, patches=(512, 2048), max_tokens: int = 4096):
    return WorkloadSpec(image_fraction=image_fraction, max_tokens=max_tokens,
                        patches_range=patches).draw(32, seed=0, encoders=("vision",))


def phase_seconds(report, phase: str) -> float:
    return sum(seg["seconds"] for seg in report.critical_path if seg["phase"] == phase)


def test_bubbles_take_encoder_work_off_the_critical_path():
    """PP=4, 8 micro-batches, images in 9 samples of 10: the encoder forwards run in the
    warm-up slots and the backwards in the cool-down, so the step is shorter than "uniform"'s
    and less of its critical path encodes; the same work is done (only moved)."""
    c, m, samples = cluster("h100", 8, 8), vlm(16, 32, 1280), draw(0.9)
    plan = SimPlan(pp=4, global_batch=32, micro_batches=8, pack_tokens=8192)
    uniform = simulate(c, m, samples, plan.replace(encoder_placement="uniform"))
    bubbles = simulate(c, m, samples, plan.replace(encoder_placement="bubbles"))
    assert bubbles.step_time < 0.97 * uniform.step_time
    uniform_enc, bubbles_enc = (phase_seconds(r, "encode_fwd") + phase_seconds(r, "encode_bwd")
                                for r in (uniform, bubbles))
    assert bubbles_enc < 0.8 * uniform_enc
    assert sum(bubbles.compute) == pytest.approx(sum(uniform.compute), rel=0.02)


def test_encoder_work_the_bubbles_cannot_hold_stays_on_the_critical_path():
    """Images far larger than the idle slots: most encoder work is not hidden; the step is
    then about "uniform"'s (never much below it: the work did not vanish), and the plan's
    hidden share says so."""
    c, m = cluster("h100", 8, 8), vlm(8, 48, 1664)
    samples = draw(1.0, patches=(8192, 16384), max_tokens=8192)
    plan = SimPlan(pp=2, global_batch=32, micro_batches=4, pack_tokens=16384)
    uniform = simulate(c, m, samples, plan.replace(encoder_placement="uniform"))
    bubbles = simulate(c, m, samples, plan.replace(encoder_placement="bubbles"))
    assert bubbles.step_time == pytest.approx(uniform.step_time, rel=0.1)
    step = Step(c, m, samples, plan.replace(encoder_placement="bubbles"))
    from ds_omni.sim.pipeline_sim import stage_plan
    step.stage_plan = stage_plan(step)
    ops = bubble_sim.BubbleOps(step, [step.ranks_of(0, step.pplan.dp, s) for s in range(2)])
    assert max(ops.hidden_share) < 0.5


def test_auto_is_the_placement_training_chooses_and_never_a_predicted_loss():
    """"auto" is simulated as the placement training resolves it to (the cost model's typical
    step of the drawn mix, `auto_placement`); it is "bubbles" only where that model predicts a
    gain, and there the simulated step of the drawn batch is not slower than "uniform"'s beyond
    the 1 % margin."""
    from ds_omni.sim.pipeline_sim import stage_plan
    c, picked = cluster("h100", 8, 8), set()
    cases = [(vlm(32, 24, 1024, 576), 0.5, 4, 4), (vlm(32, 24, 1024, 576), 0.9, 4, 8),
             (vlm(16, 32, 1280), 0.9, 4, 8), (vlm(8, 48, 1664), 0.1, 2, 4),
             (vlm(8, 48, 1664), 0.9, 4, 4)]
    for m, fraction, pp, micro in cases:
        samples = draw(fraction)
        plan = SimPlan(pp=pp, global_batch=32, micro_batches=micro, pack_tokens=8192,
                       encoder_placement="auto")
        step = Step(c, m, samples, plan)
        bubble_sim.resolve_auto(step, stage_plan)
        chosen = step.plan.encoder_placement
        picked.add(chosen)
        times = {w: simulate(c, m, samples, plan.replace(encoder_placement=w)).step_time
                 for w in ("auto", "bubbles", "uniform")}
        assert times["auto"] == times[chosen]
        typical = typical_schedule(m.cost, stage_plan(step).layer_time,
                                   *bubble_sim.typical_inputs(step))
        assert (chosen == "bubbles") == picks_bubbles(typical)
        if chosen == "bubbles":
            assert times["bubbles"] <= 1.01 * times["uniform"]
    assert picked == {"bubbles", "uniform"}  # both choices are made on this grid


def test_the_schedule_steps_are_deepspeeds():
    """Forward of m at step 2m + s, backward at 2m + 2P - 1 - s (`parallel.bubbles.step_micro`)."""
    from ds_omni.parallel.bubbles import step_micro
    for P in (2, 4):
        for s in range(P):
            for m in range(3):
                assert step_micro(bubble_sim.sched_step("F", m, s, P), s, P) == (m, True)
                assert step_micro(bubble_sim.sched_step("B", m, s, P), s, P) == (m, False)


@pytest.mark.parametrize("inside", [{"sp": 2}, {"tp": 2}])
def test_bubbles_beside_sp_and_tp_encode_on_every_rank(inside):
    """pp2 x sp2 and pp2 x tp2 (dp 2): each SP shard's column of stages plans its reshard plan's
    items, each TP rank's every item (training's `BubbleSetup.start`): every rank encodes some
    (none left to one rank of a pipeline), the TP ranks alike, and the step does the work
    "uniform" does (the same items, not dropped nor encoded twice over SP)."""
    c, m, samples = cluster("h100", 8, 8), vlm(16, 32, 1280), draw(0.9)
    plan = SimPlan(pp=2, global_batch=32, micro_batches=4, pack_tokens=8192, **inside)
    uniform = simulate(c, m, samples, plan.replace(encoder_placement="uniform"))
    bubbles = simulate(c, m, samples, plan.replace(encoder_placement="bubbles"))
    assert sum(bubbles.compute) == pytest.approx(sum(uniform.compute), rel=0.02)
    step = Step(c, m, samples, plan.replace(encoder_placement="bubbles"))
    from ds_omni.sim.pipeline_sim import stage_plan
    step.stage_plan = stage_plan(step)
    ops = bubble_sim.BubbleOps(step, [step.ranks_of(0, step.pplan.dp, s) for s in range(2)])
    work = sum(ops.fwd.values())  # [D] each rank's encoder forward seconds, both stages
    assert work.shape == (8 // 2,) and (work > 0).all(), work
    if "tp" in inside:
        assert (work[0::2] == work[1::2]).all(), work


@pytest.mark.parametrize("plant", plants.for_launch("sim_bubbles"))
@pytest.mark.parametrize("inside", [{"sp": 2}, {"tp": 2}])
def test_plant_sim_bubbles_is_caught(plant, inside):
    with plants.applied(plant, 0), pytest.raises(AssertionError):
        test_bubbles_beside_sp_and_tp_encode_on_every_rank(inside)
