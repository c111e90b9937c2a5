"""Checkpoint and resume: 2N steps in one run == N steps, stop, resume, N steps."""

import json
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests.e2e.launch import train, write_configs

pytestmark = pytest.mark.e2e
N = 3


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    cfg, ds, out_full = write_configs(tmp_path / "full", steps=2 * N)
    assert train("deepspeed", 2, cfg, ds).returncode == 0

    cfg, ds, out = write_configs(tmp_path / "split", steps=2 * N)
    first = train("deepspeed", 2, cfg, ds, "--stop-after", str(N))
    assert first.returncode == 0, first.stdout[-3000:]
    assert (Path(out) / "checkpoints" / "latest").read_text().strip() == f"step{N:08d}"
    second = train("deepspeed", 2, cfg, ds, "--resume")
    assert second.returncode == 0, second.stdout[-3000:]

    full, split = read_metrics(out_full), read_metrics(out)
    assert [r["step"] for r in split] == list(range(2 * N))
    assert split[-1]["loss"] == pytest.approx(full[-1]["loss"], abs=1e-6)
    assert [r["sample_keys"] for r in split] == [r["sample_keys"] for r in full]
    state = json.loads((Path(out) / "checkpoints" / f"step{2 * N:08d}" / "loader_state.json").read_text())
    assert state["version"] == 2 and state["dp_size"] == 2 and state["step"] == 2 * N


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    cfg, ds, _ = write_configs(tmp_path, steps=2)
    res = train("single", 1, cfg, ds, "--resume")
    assert res.returncode == 2
    assert "--resume: no checkpoint in" in res.stdout and "Traceback" not in res.stdout
