"""benchmarks/gpu_mfu.py runs (tiny dims, in-process) and reports figures that hold together,
its FLOP model checked against torch's FLOP counter."""

import json

import numpy as np
import pytest
import torch

from tests import bench_scripts


def _bench():
    return bench_scripts.load("gpu_mfu", "gpu_mfu")


def test_tiny_run_writes_sane_figures(tmp_path):
    bench = _bench()
    out = tmp_path / "gpu_mfu.json"
    result = bench.main(["--tiny", "--profile", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["ds_omni_kernel"] == ("varlen" if torch.cuda.is_available() else "sdpa")
    checks = saved["checks_before_training"]
    # both sides train the same model on the same samples: the same loss before training
    assert checks["loss_rel_diff"] < 1e-5 and abs(checks["loss_ds_omni"] - np.log(256)) < 0.5
    # the FLOP model is within 20 % of what torch counts for ds_omni's forward + backward (torch
    # counts causal attention as the full square, and no input gradient for the first layer)
    assert 0.8 < checks["flop_counter_over_model"] < 1.2
    work = saved["workload"]
    assert 0 < work["image_samples_share"] < 1 and 0 < work["baseline_padding_share"] < 1
    assert 0 < work["tokens_per_step"] <= work["rows_per_step"] * work["row_tokens"]
    for side in ("ds_omni", "baseline"):
        fig = saved[side]
        assert len(fig["step_s_all"]) == work["timed_steps"] == 2 and fig["tokens_per_s"] > 0
        per_token = fig["model_tflops_per_s"] * 1e12 / fig["tokens_per_s"]
        # every real token passes the decoder layers: at least 6 x their parameters
        assert per_token > 6 * saved["model"]["flop_model"]["llm_body_params"]
        assert fig["mfu"] is None or 0 < fig["mfu"] < 1  # no peak is known for a CPU
    assert saved["speedup_tokens_per_s"] > 0
    for side in ("ds_omni", "baseline"):  # one profiled step each: the top ops by time
        profile = saved["profile"][side]
        assert profile["wall_s"] > 0 and profile["top"] and profile["top"][0]["total_ms"] > 0


def test_peak_by_device_name():
    bench = _bench()
    assert bench.peak_tflops("NVIDIA H200") == bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_tflops("cpu") is None and bench.peak_tflops("cpu", 100.0) == 100.0


def test_kernel_check_restores_the_kernel():
    """The GPU run compares varlen with per-sample SDPA through `kernel_loss`: same loss for two
    kernels that agree, and the model keeps "auto" after it."""
    bench = _bench()
    hf, omni = bench.build_models(bench.TINY, torch.device("cpu"), torch.float32)
    step = bench.draw_steps(np.random.default_rng(0), bench.TINY, bench.Mix(text_median=60.0), 1,
                            2, 256, 128)[0]
    cpu = torch.device("cpu")
    assert bench.kernel_loss(omni, step, bench.TINY, cpu, "eager") == pytest.approx(
        bench.kernel_loss(omni, step, bench.TINY, cpu, "sdpa"), rel=1e-6)
    assert omni.backbone.attention.kernel == ("varlen" if torch.cuda.is_available() else "sdpa")
