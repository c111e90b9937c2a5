"""benchmarks/gpu_check.py's CPU smoke run (tiny sizes; the CUDA-only kernel is skipped): the
varlen part compares kernels and times them, the memory part trains one step each way, and (slow
tier) the train part trains through the launcher and exports."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest


def _gpu_check(monkeypatch):
    """The script as a module; what its `main` puts on the paths is undone after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def test_cpu_smoke_writes_figures(tmp_path, monkeypatch):
    check = _gpu_check(monkeypatch)
    summary = check.main(["--cpu-smoke", "--out", str(tmp_path), "--parts", "varlen,memory"])
    assert all(part["error"] is None for part in summary.values()), summary
    varlen = json.loads((tmp_path / "varlen.json").read_text())
    assert set(varlen["layers"]) == {"causal", "sliding_window", "gqa"}
    for layer in varlen["layers"].values():
        diffs = layer["sdpa"]["max_abs_diff_vs_fp32"]
        # bf16 against fp32 on unit-variance inputs: a few bf16 spacings, never zero
        assert set(diffs) == {"out", "dq", "dk", "dv"} and all(0 < d < 0.2 for d in diffs.values())
        assert layer["sdpa"]["fwd_bwd_ms"] > 0
    assert varlen["max_sample"] > varlen["layers"]["sliding_window"]["window"]  # the band acts
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["tokens"] <= memory["row_tokens"] and memory["plain"]["step_s"] > 0
    assert memory["checkpointed"]["step_s"] > 0


@pytest.mark.slow
def test_cpu_smoke_trains_through_the_launcher_and_exports(tmp_path, monkeypatch):
    """The train part as the GPU run makes it (the deepspeed launcher by module, 1 process, the
    demo model, its HF export loaded back), 2 steps of the fp32 config on CPU: about a minute."""
    check = _gpu_check(monkeypatch)
    summary = check.main(["--cpu-smoke", "--out", str(tmp_path), "--parts", "train"])
    assert summary["train"]["error"] is None, summary
    train = json.loads((tmp_path / "train.json").read_text())
    assert train["returncode"] == 0, train["output_tail"]
    assert train["report"]["steps"] == 2 and train["export"]["finite"], train
    assert train["export"]["class"] == "LlavaForConditionalGeneration"
