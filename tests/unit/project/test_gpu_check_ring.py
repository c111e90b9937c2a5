"""benchmarks/gpu_check_ring.py without a GPU: it skips with its reason (it is no CPU test), and
its CPU smoke run (torch's CPU flash kernel standing in for CUDA's, tiny rows) passes."""

import json

import torch

from tests.bench_scripts import load


def test_without_cuda_it_skips_saying_why(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got = load("gpu_check_ring", "gpu_check_ring").main(["--out", str(tmp_path)])
    assert "no CUDA device" in got["skipped"]
    assert json.loads((tmp_path / "gpu_check_ring.json").read_text()) == got


def test_cpu_smoke_compares_every_case(tmp_path):
    got = load("gpu_check_ring", "gpu_check_ring").main(["--cpu-smoke", "--out", str(tmp_path)])
    assert len(got["parity"]) == 9 and all(row["ok"] for row in got["parity"]), got["parity"]
    assert set(got["speed"]) == {"tokens", "torch", "cpu_flash"}
