"""Checkpoint and resume: N steps, stop, resume, N steps == 2N steps of the oracle.

The uninterrupted run is `tests/oracle.py` in the test process (plain PyTorch on the global batches
2 loaders make in loader order), not another launch: the same samples at every step, the same
losses.
"""

import json
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests import oracle
from tests.e2e.launch import train, write_configs
from tests.fixtures import tiny_config

pytestmark = pytest.mark.e2e
N = 3


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    cfg, ds, out = write_configs(tmp_path / "split", steps=2 * N)
    first = train("deepspeed", 2, cfg, ds, "--stop-after", str(N))
    assert first.returncode == 0, first.stdout[-3000:]
    assert (Path(out) / "checkpoints" / "latest").read_text().strip() == f"step{N:08d}"
    second = train("deepspeed", 2, cfg, ds, "--resume")
    assert second.returncode == 0, second.stdout[-3000:]

    from ds_omni.model.build import build_model
    ref_cfg = tiny_config(str(tmp_path / "ref"), steps=2 * N)
    keys = oracle.reference_step_keys(ref_cfg, build_model(ref_cfg.model), 2, 2 * N)
    full = oracle.run_reference(ref_cfg, keys)
    split = read_metrics(out)
    assert [r["step"] for r in split] == list(range(2 * N))
    assert [r["sample_keys"] for r in split] == keys
    assert [r["loss"] for r in split] == pytest.approx(full.losses, rel=1e-5)
    # the next step was loaded on the prefetch thread (on by default) while each step trained
    assert all(0 <= r["data_wait_s"] <= r["step_s"] for r in split)
    state = json.loads((Path(out) / "checkpoints" / f"step{2 * N:08d}" / "loader_state.json").read_text())
    assert state["version"] == 2 and state["dp_size"] == 2 and state["step"] == 2 * N


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    cfg, ds, _ = write_configs(tmp_path, steps=2)
    res = train("single", 1, cfg, ds, "--resume")
    assert res.returncode == 2
    assert "--resume: no checkpoint in" in res.stdout and "Traceback" not in res.stdout
