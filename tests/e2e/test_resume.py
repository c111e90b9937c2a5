"""Failures and resume, through the real launcher: a soak under `ds-omni supervise` with a killed
and a stopped rank ends exactly as an uninterrupted run would.

The uninterrupted run is `tests/oracle.py` in the test process (plain PyTorch on the global batches
2 loaders make in loader order), not another launch: the same samples at every step, the same
losses. The soak also stands for the stop-and-resume test it replaced (a resume reproducing the
oracle); `--stop-after` is checked by tests/e2e/test_sequence_parallel_run.py.
"""

import json
import os
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests import oracle
from tests.e2e.launch import BIN, launcher_cmd, run, write_configs
from tests.fixtures import tiny_config

pytestmark = pytest.mark.e2e
STEPS, SAVE_EVERY, PEER_TIMEOUT = 60, 10, 10
# rank 1 dies (SIGKILL) in the save after step 20, before its manifest: the job falls back to
# step 10; rank 0, which hosts the rendezvous store under this launcher, freezes (SIGSTOP) in a
# forward of step 35: only the watchdog can end that job (nothing exits), and it resumes at 30
FAULTS = "kill:1:save:20,stop:0:forward:35"


@pytest.mark.timeout(1500)  # ~3 launches; 855 s once on a 2-core machine at load 17
def test_supervised_run_survives_a_killed_and_a_stopped_rank(tmp_path):
    cfg, ds, out = write_configs(tmp_path / "soak", steps=STEPS, save_every=SAVE_EVERY,
                                 keep_checkpoints=2, peer_timeout_s=PEER_TIMEOUT)
    training = launcher_cmd("deepspeed", 2)[:-1] + ["tests.e2e.faulty", "train", "--config", cfg,
                                                    "--deepspeed", ds]
    res = run([str(BIN / "ds-omni"), "supervise", "--max-restarts", "3", "--backoff", "0", "--",
               *training], timeout=1400,
              env={"DS_OMNI_TEST_FAULTS": FAULTS, "DS_OMNI_TEST_FAULT_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-5000:]

    restarts = [json.loads(x) for x in (Path(out) / "restarts.jsonl").read_text().splitlines()]
    assert [r["resume_from"] for r in restarts] == ["step00000010", "step00000030"], restarts
    killed, stopped = (r["cause"] for r in restarts)
    assert "rank 1 is gone" in killed and "has exited" in killed, killed
    assert "rank 0 sent no heartbeat" in stopped and "is stopped (SIGSTOP" in stopped, stopped
    # the frozen job ended within the peer timeout plus the launcher's teardown
    frozen_at = os.stat(tmp_path / "fired-1").st_mtime
    assert restarts[1]["time"] - frozen_at < PEER_TIMEOUT + 15, restarts[1]["time"] - frozen_at

    keys, losses = oracle.stream_reference(tiny_config(str(tmp_path / "ref"), steps=STEPS), 2, STEPS)
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert [r["sample_keys"] for r in got] == keys  # none lost, none seen twice
    assert [r["loss"] for r in got] == pytest.approx(losses, rel=1e-5)
    # the next step was loaded on the prefetch thread (on by default) while each step trained
    assert all(0 <= r["data_wait_s"] <= r["step_s"] for r in got)
    root = Path(out) / "checkpoints"
    state = json.loads((root / f"step{STEPS:08d}" / "loader_state.json").read_text())
    assert state["version"] == 2 and state["dp_size"] == 2 and state["step"] == STEPS
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(("step", ".step"))) == [
        "step00000050", "step00000060"]  # keep_checkpoints=2; the half-written save is gone

