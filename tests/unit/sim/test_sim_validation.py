"""`benchmarks/sim_validation.py` end to end on two plans (slow: two real 2-rank trainings, the
collective and compute calibrations before them): every figure the results file promises is
there and consistent, the prediction came from the fitted cluster, and the calibration ran on
other batches than the validated ones."""

from __future__ import annotations

import json

import pytest

from benchmarks import sim_calibration, sim_validation


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_config_validation_end_to_end(tmp_path):
    names = ["dp2_text", "pp2_stage0_text"]  # a pipeline: its cost-based stage split finite
    result = sim_validation.main(["--configs", *names, "--rounds", "2", "--warmup", "1",
                                  "--batches", "3", "--comm-repeats", "2", "--out",
                                  str(tmp_path)])
    saved = json.loads((tmp_path / "sim_validation.json").read_text())
    assert (tmp_path / "sim_validation.png").stat().st_size > 0
    assert [r["name"] for r in saved["configs"]] == names
    for row in saved["configs"]:
        assert row["measured_s"] > 0 and row["measured_wall_s"] > 0 and row["predicted_s"] > 0
        assert len(row["measured_cpu_per_round"]) == 2  # the warm-up round is left out
        assert row["error"] == pytest.approx((row["predicted_s"] - row["measured_s"])
                                             / row["measured_s"])
        assert row["predicted_phases_s"]  # the critical path was walked
    errors = sorted(abs(r["error"]) for r in saved["configs"])
    assert saved["median_abs_error"] == pytest.approx(sum(errors) / 2)
    assert saved["max_abs_error"] == pytest.approx(errors[-1])
    assert saved["pairwise_order_agreement"] in (0.0, 1.0)  # one pair
    assert saved["measured_pairs"] in (0, 1) and saved["order_of_measured_pairs"] in (0.0, 1.0)
    assert all(len(r["measured_batch_per_round"]) == 2 for r in saved["configs"])
    fitted = json.loads((tmp_path / "sim_validation_cluster.json").read_text())
    assert fitted["intra_latency"] == saved["calibration"]["comm"]["alpha_s"] > 0
    assert fitted["intra_bw"] == saved["calibration"]["comm"]["beta_bytes_per_s"] > 0
    compute = saved["calibration"]["compute"]["2"]  # the machine of the 2-rank plans
    assert compute["machine"]["flops_per_s"] > 0 and compute["machine"]["step_s"] >= 0
    assert compute["machine"]["micro_batch_s_per_param"] > 0
    sizes = sim_calibration.CALIBRATION["pipeline"][1]
    assert len(compute["profiles"]) == 2 * 2  # two processes at once, two mixes each
    assert all(p["micro_batches"] == 3 * len(sizes) for p in compute["profiles"].values())
    assert compute["engine"]["world"] == 2  # the 2-rank engine runs were timed in the
    # measured launch (its 2 rounds after the warm-up, each micro-batch size), and the step's
    # fixed cost reaches the simulated cluster
    specs = sim_calibration.engine_specs(names)
    assert len(compute["engine"]["residual_s"]) == 2 * len(specs) == 16  # dp (both mixes), sp, pp
    raw = json.loads((tmp_path / "sim_validation_raw.json").read_text())
    assert set(raw["engine_logs"]["2"]) == {f"{n}/{m}" for n, m in specs}
    assert compute["machine"]["step_s"] == compute["engine"]["step_s"]
    for term in sim_calibration.ENGINE_TERMS:  # a call's, a pipeline pass's, a p2p byte's
        assert compute["machine"][term] == compute["engine"][term] >= 0
    assert compute["machine"]["compute_scale"] == compute["engine"]["compute_scale"] > 0
    assert saved["command"].startswith(".venv/bin/python benchmarks/sim_validation.py --rounds 2")
    assert result["configs"] == saved["configs"]


def test_calibration_runs_on_other_batches_than_the_validated_ones(tmp_path):
    from tests.fixtures import long_source, text_source
    sources = {"text": text_source(tmp_path), "long": long_source(tmp_path, weight=0.14)}
    validated = sim_validation.config("dp2_image", str(tmp_path), sources, 3)
    calibration = sim_validation.config("dp2_image", str(tmp_path), sources, 3, seed=1234)
    assert validated.data.seed != calibration.data.seed
    assert len(sim_validation.CONFIGS) >= 10
    assert {w for w, _, _ in sim_validation.CONFIGS.values()} == {2, 4}
    assert {k for _, k, _ in sim_validation.CONFIGS.values()} == {"image", "text", "longtail",
                                                                   "moe"}


def test_the_validated_model_keeps_its_attention_heads(tmp_path):
    """The encoders' heads decide whether long-short SP may split an item (Ulysses needs them
    divisible by the group); `ModelSpec.from_dims` dropped them and the tiny ViT (hidden 32,
    4 heads) fell back to hidden // 64 = 1 head, so the simulator split nothing that training
    split (sp2x2_long_short predicted equal to static)."""
    from benchmarks.sim_validation import config, flop_model
    from tests.fixtures import long_source, text_source
    sources = {"text": text_source(tmp_path), "long": long_source(tmp_path, weight=0.14,
                                                                  words=1200)}
    model = flop_model(config("sp2x2_long_short_longtail", str(tmp_path), sources, 1))
    assert model.heads("vision") == 4 and model.bytes_per_param == 4
    assert model.cost.scales == type(model.cost)(model.dims).scales  # the FLOPs unscaled


def _row(name, rounds, predicted, batches=("b0", "b1", "b2")):
    return {"name": name, "measured_cpu_per_round": list(rounds), "predicted_s": predicted,
            "measured_s": sum(rounds) / len(rounds), "measured_batch_per_round": list(batches)}


def test_the_measurement_orders_a_pair_only_where_every_round_agrees():
    """Paired rounds (the same batch each round): ordered only when every round's difference has
    one sign; rounds of other batches: only when they do not overlap."""
    fast, slow = _row("a", [1.0, 2.0, 0.5], 1.0), _row("b", [1.1, 2.2, 0.6], 2.0)
    assert sim_validation.measured_apart(fast, slow) == -1
    assert sim_validation.measured_apart(slow, fast) == 1
    swapped = _row("c", [1.1, 1.9, 0.6], 2.0)  # one round the other way: no order known
    assert sim_validation.measured_apart(fast, swapped) == 0
    # other batches: the same figures overlap (0.5-2.0 against 0.6-2.2), no order
    other = _row("d", [1.1, 2.2, 0.6], 2.0, batches=("x", "y", "z"))
    assert sim_validation.measured_apart(fast, other) == 0
    apart = _row("e", [2.5, 3.0, 2.1], 2.0, batches=("x", "y", "z"))
    assert sim_validation.measured_apart(fast, apart) == -1


def test_the_order_target_counts_the_pairs_the_measurement_orders():
    a, b = _row("a", [1.0, 2.0, 0.5], 1.0), _row("b", [1.1, 2.2, 0.6], 2.0)
    c = _row("c", [1.05, 1.9, 0.55], 0.5)  # below b every round; against a, one round each way
    share, wrong, pairs = sim_validation.order_of_measured_pairs([a, b, c])
    assert (share, wrong, pairs) == (1.0, [], 2)  # a < b, c < b; a vs c has no measured order
    b_first = dict(b, predicted_s=0.8)  # predicted before a (1.0), still after c (0.5)
    share, wrong, pairs = sim_validation.order_of_measured_pairs([a, b_first, c])
    assert (share, wrong, pairs) == (0.5, [("a", "b")], 2)


def test_the_launch_load_slows_the_profiled_compute_and_the_profile_comes_back():
    """`with_engine` prices the profile's compute `compute_scale` times slower (the measured
    launch's load: a cost that grows with the work), adds the engine's own terms, and leaves the
    ring kernel's in-launch rate alone; `profiled_machine` undoes it (a stored world's engine is
    fitted again on its profile, `sim_validation.refit_engines`)."""
    profile = {"flops_per_s": 5e10, "micro_batch_s_per_param": 4e-9,
               "optimizer_s_per_param": 7e-9, "pool_item_s": 1e-5, "ring_flops_per_s": 7e9}
    engine = {"compute_scale": 2.5, "engine_micro_batch_s_per_param": 1e-9, "step_s": 0.1,
              "a2a_call_s": 1e-3, "pipe_pass_s": 2e-3, "p2p_byte_s": 3e-9}
    fitted = sim_calibration.with_engine({"machine": profile}, engine)["machine"]
    assert fitted["flops_per_s"] == pytest.approx(2e10)
    assert fitted["micro_batch_s_per_param"] == pytest.approx(4e-9 * 2.5 + 1e-9)
    assert fitted["optimizer_s_per_param"] == pytest.approx(7e-9 * 2.5)
    assert fitted["pool_item_s"] == pytest.approx(2.5e-5)
    assert fitted["ring_flops_per_s"] == 7e9  # timed in the launch already
    assert (fitted["step_s"], fitted["a2a_call_s"]) == (0.1, 1e-3)
    assert (fitted["pipe_pass_s"], fitted["p2p_byte_s"]) == (2e-3, 3e-9)  # the pipeline's
    unpriced = dict(profile, step_s=0.0, a2a_call_s=0.0, pipe_pass_s=0.0, p2p_byte_s=0.0)
    back = sim_calibration.profiled_machine({"machine": fitted, "engine": engine})
    assert back == pytest.approx(unpriced)
    # a stored machine from before the scale (no compute_scale): its engine terms come off
    old = sim_calibration.with_engine({"machine": profile}, dict(engine, compute_scale=1.0))
    old["machine"].pop("compute_scale")
    assert sim_calibration.profiled_machine(old) == pytest.approx(unpriced)
