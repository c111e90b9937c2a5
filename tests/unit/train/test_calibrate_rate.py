"""The simulator's compute calibration: one FLOP/s rate and a cost a micro-batch per parameter
fitted from micro-batches of varied sizes of two models (`train.calibrate.fit_rate`),
recovered from synthetic timings of a known machine; the fitted per-micro-batch and optimizer seconds charged by the
simulator; the pipeline's stage split finite when the cost model prices the LLM at zero."""

import math

import numpy as np
import pytest

from ds_omni.data.cost import EncoderDims, ModelDims
from ds_omni.errors import ConfigError
from ds_omni.sim.cluster import cluster
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import simulate
from ds_omni.sim.workload import Samples
from ds_omni.train.calibrate import fit_rate
from tests import plants

RATE, PER_PARAM = 3.2e9, 8e-9  # the synthetic machine: FLOP/s, seconds a micro-batch a parameter


def synthetic(seed: int = 0, noise: float = 0.02) -> tuple[np.ndarray, ...]:
    """[K] FLOPs of micro-batches spanning 100x of two models (2 M and 7 M parameters), their
    parameters and their seconds on the synthetic machine, with +-noise relative jitter."""
    rng = np.random.default_rng(seed)
    flops = np.exp(rng.uniform(np.log(5e7), np.log(5e9), 40))
    params = np.where(np.arange(40) % 2, 2e6, 7e6)
    seconds = (flops / RATE + params * PER_PARAM) * (1 + rng.uniform(-noise, noise, flops.size))
    return flops, seconds, params


def check_recovers(flops, seconds, params) -> None:
    rate, per_param = fit_rate(flops, seconds, params)
    assert rate == pytest.approx(RATE, rel=0.03)
    assert per_param == pytest.approx(PER_PARAM, rel=0.1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_a_known_rate_and_overhead(seed):
    check_recovers(*synthetic(seed))


def test_fit_without_noise_is_exact():
    flops, params = np.array([1e8, 4e8, 2e9]), np.array([2e6, 7e6, 7e6])
    rate, per_param = fit_rate(flops, flops / RATE + params * PER_PARAM, params)
    assert (rate, per_param) == (pytest.approx(RATE, rel=1e-9), pytest.approx(PER_PARAM, rel=1e-9))


def test_fit_refuses_micro_batches_of_one_size():
    with pytest.raises(ConfigError, match="different sizes"):
        fit_rate(np.full(6, 1e9), np.full(6, 0.3), 1e6)
    with pytest.raises(ConfigError, match="do not grow"):  # seconds fall as FLOPs rise
        fit_rate(np.array([1e8, 1e9, 1e10]), np.array([3.0, 2.0, 1.0]), 1e6)


@pytest.mark.parametrize("name", plants.for_launch("calibrate_rate"))
def test_plant_breaks_the_recovery(name):
    data = synthetic(0)
    with plants.applied(name, 0), pytest.raises(AssertionError):
        check_recovers(*data)


# ------------------------------------------------------------------ the simulator's side
def small_vlm(scales=None) -> ModelSpec:
    return ModelSpec.from_dims(ModelDims(hidden=256, layers=4, intermediate=512, vocab=1000,
                                         encoders={"vision": EncoderDims(hidden=256, layers=6,
                                                                         intermediate=1024)}),
                               scales=scales)


def image_samples(n: int = 16) -> Samples:
    """n samples of 96 tokens, each with one 64-patch image (65 of its rows)."""
    idx = np.arange(n, dtype=np.int64)
    return Samples(np.full(n, 96, dtype=np.int64), idx, np.array(["vision"] * n),
                   np.full(n, 64, dtype=np.int64), np.full(n, 65, dtype=np.int64))


def cpu(world: int, **fields):
    return cluster("cpu", world, world, flops=RATE, achievable=1.0, **fields)


@pytest.mark.parametrize("pp", [1, 2])
def test_fitted_overheads_are_charged_once_a_micro_batch_and_a_parameter(pp):
    m, plan = small_vlm(), SimPlan(dp=2 // pp, pp=pp, global_batch=16, micro_batches=4,
                                   pack_tokens=4096, checkpointing=False)
    base = simulate(cpu(2), m, image_samples(), plan)
    framework = simulate(cpu(2, micro_batch_s_per_param=1e-8), m, image_samples(), plan)
    extra = framework.step_time - base.step_time
    per_micro = m.total_params() * 1e-8
    if pp == 1:  # each rank runs its 4 micro-batches and holds the whole model
        assert extra == pytest.approx(4 * per_micro, rel=1e-6)
    else:  # each stage its own parameters' share: at least the 4 micro-batches of a stage
        assert 0.3 * 4 * per_micro < extra < 2 * 4 * per_micro
        assert framework.summary()["critical_path"]["by_phase"]["llm_bwd"] > base.summary()[
            "critical_path"]["by_phase"]["llm_bwd"]
    optimizer = simulate(cpu(2, optimizer_s_per_param=1e-8, step_s=0.03), m, image_samples(),
                         plan)
    by_phase = optimizer.summary()["critical_path"]["by_phase"]
    assert by_phase["optimizer"] > 0.03  # the phase ran, on the critical path
    if pp == 1:  # ZeRO-1 over dp=2: each rank updates half of the parameters
        assert optimizer.step_time - base.step_time == pytest.approx(
            m.trainable_params() / 2 * 1e-8 + 0.03, rel=1e-6)


def test_stage_split_is_finite_when_the_llm_is_priced_at_zero():
    # what an NNLS fit on collinear micro-batches once gave: all weight on the vision term
    m = small_vlm(scales={"llm_quad": 0.0, "llm_lin": 0.0})
    for placement in ("stage0", "uniform"):
        report = simulate(cpu(2), m, image_samples(), SimPlan(
            pp=2, global_batch=16, micro_batches=4, pack_tokens=4096,
            encoder_placement=placement))
        assert math.isfinite(report.step_time) and report.step_time > 0


def test_the_engines_step_cost_reaches_the_cluster():
    """`machine_fields` hands the engine calibration's `step_s` to the cluster (it was dropped:
    the validation's simulated steps missed 0.17 s a step on 2 ranks); a profile without an
    engine calibration has none."""
    from ds_omni.train.calibrate import machine_fields
    profiled = {"flops_per_s": RATE, "micro_batch_s_per_param": 1e-8,
                "optimizer_s_per_param": 2e-8}
    assert machine_fields(profiled)["step_s"] == 0.0
    fields = machine_fields(profiled | {"step_s": 0.05})
    m, plan = small_vlm(), SimPlan(dp=2, global_batch=16, micro_batches=4, pack_tokens=4096)
    with_step = simulate(cluster("cpu", 2, 2, **fields), m, image_samples(), plan)
    without = simulate(cluster("cpu", 2, 2, **machine_fields(profiled)), m, image_samples(), plan)
    assert with_step.step_time - without.step_time == pytest.approx(0.05, rel=1e-6)
