"""Failures and resume, through the real launcher: a soak under `ds-omni supervise` with two killed
ranks and a stopped one ends exactly as an uninterrupted run would.

The uninterrupted run is `tests/oracle/` in the test process (plain PyTorch on the global batches
2 loaders make in loader order), not another launch: the same samples at every step, the same
losses. The soak also stands for the stop-and-resume test it replaced (a resume reproducing the
oracle); `--stop-after` by tests/unit/train/test_train_loop.py. The other kill points: in a backward
(deepspeed launcher), tests/e2e/test_sequence_parallel_run.py; in the loader under torchrun,
tests/e2e/test_launchers.py.
"""

import json
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests import oracle
from tests.e2e.faulty import fired_at
from tests.e2e.launch import BIN, launcher_cmd, run, write_configs
from tests.fixtures import tiny_config

pytestmark = pytest.mark.e2e
STEPS, SAVE_EVERY, PEER_TIMEOUT = 25, 5, 10
# the deepspeed launcher's part of the kill points (see the module docstring); rank 0 hosts
# the rendezvous store under this launcher. Rank 1 dies (SIGKILL) in the save after step 10,
# before its manifest: the job falls back to step 5. Rank 0 dies in the optimizer step of step
# 15, and freezes (SIGSTOP) in the forward of step 20: only the watchdog can end that job (nothing
# exits). Both come right after a save, so no step is trained twice for them.
FAULTS = "kill:1:save:10,kill:0:optimizer:15,stop:0:forward:20"


# Slow tier: the quick tier's costliest test (about 2 min: 4 launches). Its mechanisms stay in
# the quick tier: a rank killed and the job resumed exactly under `ds-omni supervise`
# (tests/e2e/test_launchers.py, torchrun) and through the deepspeed launcher
# (tests/e2e/test_sequence_parallel_run.py); a hung rank named by the watchdogs
# (tests/dist/test_fault_tolerance.py) and a SIGSTOPped one told apart
# (tests/unit/train/test_watchdog.py); an incomplete save passed over, and keep_checkpoints
# (tests/unit/train/test_checkpoint.py).
@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~4 launches
def test_supervised_run_survives_killed_and_stopped_ranks(tmp_path):
    cfg, ds, out = write_configs(tmp_path / "soak", steps=STEPS, save_every=SAVE_EVERY,
                                 keep_checkpoints=2, peer_timeout_s=PEER_TIMEOUT)
    training = launcher_cmd("deepspeed", 2)[:-1] + ["tests.e2e.faulty", "train", "--config", cfg,
                                                    "--deepspeed", ds]
    res = run([str(BIN / "ds-omni"), "supervise", "--max-restarts", "3", "--backoff", "0", "--",
               *training], timeout=1400,
              env={"DS_OMNI_TEST_FAULTS": FAULTS, "DS_OMNI_TEST_FAULT_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-5000:]

    restarts = [json.loads(x) for x in (Path(out) / "restarts.jsonl").read_text().splitlines()]
    assert [r["resume_from"] for r in restarts] == [
        "step00000005", "step00000015", "step00000020"], restarts
    in_save, in_optimizer, stopped = (r["cause"] for r in restarts)
    log = res.stdout[-6000:]  # (a failed check shows what the ranks said)
    assert "rank 1 is gone" in in_save and "has exited" in in_save, (in_save, log)
    assert "rank 0 is gone" in in_optimizer and "has exited" in in_optimizer, (in_optimizer, log)
    assert "rank 0 sent no heartbeat" in stopped and "is stopped (SIGSTOP" in stopped, (
        stopped, log)
    # every process of each job ended (the launcher returned) within a bounded time: a dead peer
    # is seen at once, a frozen one within the peer timeout; plus the launcher's teardown
    for fired, restart in zip(fired_at(tmp_path, 3), restarts):
        assert restart["time"] - fired < PEER_TIMEOUT + 20, (restart, restart["time"] - fired)

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
        "step00000020", "step00000025"]  # keep_checkpoints=2; the half-written save is gone


def test_resume_without_checkpoint_is_a_clear_error_before_anything_starts(tmp_path, capsys,
                                                                          monkeypatch):
    """Said by the checks before the process group, the model and DeepSpeed (`preflight`)."""
    from ds_omni.cli import main
    from ds_omni.train import loop
    monkeypatch.setattr(loop, "setup_training", None)  # never reached
    monkeypatch.setattr(loop.dist, "init_distributed", None)
    cfg, ds, out = write_configs(tmp_path, steps=2)
    assert main(["train", "--config", cfg, "--deepspeed", ds, "--resume"]) == 2
    assert "--resume: no checkpoint in" in capsys.readouterr().err
    (Path(out) / "checkpoints" / "step00000001").mkdir(parents=True)  # a save cut short
    assert main(["train", "--config", cfg, "--deepspeed", ds, "--resume"]) == 2
    assert "no complete checkpoint in" in capsys.readouterr().err
