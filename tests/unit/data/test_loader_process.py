"""The loader in a process of its own (`data.workers` >= 1) against the loader in the training
process (`data.workers` 0), one rank: the same batches, skipped samples, state, rewinds and
weight changes; its death and its silence are errors that name it, never a hang. (Several
ranks, SP's shared reading and resuming: tests/dist/test_loader_process.py.)"""

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds_omni.data.build import cost_model_for
from ds_omni.data.loader_process import LoaderParts, LoaderProcess, feed_for
from ds_omni.data.rank_place import LoaderComms, LongSplits, RankPlace
from tests import plants
from tests.unit.data.test_loader import _all_tensors, _logged, _worker_loader, built  # noqa: F401


def _parts(built, tmp) -> LoaderParts:
    loader = _worker_loader(built, tmp, workers=0)  # its sources, processors and config
    parts = LoaderParts(loader.cfg, loader.processors, cost_model_for(built, []), 8,
                        RankPlace(num_micro=2),
                        LongSplits())
    loader.close()
    return parts


def _same(a, b) -> None:
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.keys == b.keys and a.stats == b.stats and a.step == b.step
    for ta, tb in zip(_all_tensors(a), _all_tensors(b), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


@pytest.mark.slow
def test_the_loader_process_makes_the_steps_of_the_loader_in_process(built, tmp_path):
    parts = _parts(built, tmp_path)
    here = parts.build(LoaderComms(), 0)
    there = LoaderProcess(parts, 1, timeout_s=60)
    feed = feed_for(there, 2)  # its step-ahead loop, in the loader process
    held = []
    for _ in range(4):  # the corrupt images are skipped by policy on both sides
        held.append((here.next_step(), feed.next_step()))
        _same(*held[-1])
        assert _logged(here) == _logged(feed)
    for a, b in held:  # still: each step was copied out of the shared-memory slot
        _same(a, b)
    assert here.skipped == feed.skipped and here.state_dict() == feed.state_dict()
    here.rewind(), feed.rewind()  # the last step is read again, from the trainer's position
    _same(here.next_step(), feed.next_step())
    here.set_weights({"img": 1.0, "txt": 3.0}), feed.set_weights({"img": 1.0, "txt": 3.0})
    for _ in range(2):
        _same(here.next_step(), feed.next_step())
    state = here.state_dict()
    feed.close()
    assert there.state_dict() == state and there.counts.rows > 0
    resumed = LoaderProcess(parts, 1, timeout_s=60)  # a resume: the state of the run in-process
    resumed.load_state_dict(state)
    for _ in range(2):
        _same(here.next_step(), resumed.next_step())
    resumed.close()
    here.close()

    os.kill(there.pid, signal.SIGKILL)  # dead: this step's error at once (every rank stops)
    t0 = time.perf_counter()
    batch = there.next_step()
    assert time.perf_counter() - t0 < 10 and len(batch.micro_batches) == 2 and not batch.keys
    assert "rank 0: the loader process (pid" in batch.error
    assert "died with signal SIGKILL" in batch.error and "data.workers 0" in batch.error
    assert not _segments(there)  # the trainer unlinked the slot it left


@pytest.mark.slow
def test_the_next_step_is_asked_for_early_and_kept_across_other_requests(built, tmp_path):
    """While steps are made ahead, the request for the next step goes out as soon as a step is
    received; a request in between (the state for a checkpoint) reads that reply first and
    keeps its step for the next `next_step`: the same steps as in-process, none skipped."""
    parts = _parts(built, tmp_path)
    here = parts.build(LoaderComms(), 0)
    there = LoaderProcess(parts, 1, timeout_s=60)
    feed = feed_for(there, 1)
    _same(here.next_step(), feed.next_step())
    assert there._asked_next  # out while this step trains
    assert here.state_dict() == feed.state_dict()  # the steps taken, not the one asked early
    for _ in range(3):
        _same(here.next_step(), feed.next_step())
    assert there.early_replies == 3  # every step after the first came from an early request
    feed.close()
    assert there.state_dict() == here.state_dict()  # the step asked early was dropped
    here.close(), there.close()
    failing = LoaderProcess(parts, 1, timeout_s=60)  # a run that fails with a step asked early
    feed = feed_for(failing, 1)
    feed.next_step()
    t0 = time.perf_counter()
    failing.close(abort=True)  # ended, not told: that step may wait on a peer that is gone
    assert time.perf_counter() - t0 < 10 and not failing._proc.is_alive()
    assert not _segments(failing)


@pytest.mark.parametrize("plant", plants.for_launch("early_reply"))
@pytest.mark.slow
def test_plant_early_reply(built, tmp_path, plant):
    with plants.applied(plant, 0), pytest.raises(AssertionError):
        test_the_next_step_is_asked_for_early_and_kept_across_other_requests(built, tmp_path)


def _segments(loader: LoaderProcess) -> list[Path]:
    """The shared-memory segments of `loader`'s hand-over that exist."""
    return list(Path("/dev/shm").glob(f"{loader._receiver.prefix}*"))


_TRAINER = """
import os, pickle, signal, sys
from ds_omni.data.loader_process import LoaderProcess, feed_for
if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        loader = LoaderProcess(pickle.load(f), 1, timeout_s=60)
    feed = feed_for(loader, 2)
    feed.next_step(), feed.next_step()
    print(loader._receiver.prefix, loader.pid, flush=True)
    if sys.argv[2] == "close":
        feed.close()
        loader.close()
    else:  # the trainer dies: its loader process sees it and unlinks the slot
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.parametrize("end", ["close", "trainer_killed"])
def test_no_shared_memory_is_left_whoever_ends_first(built, tmp_path, end):
    """A trainer in a process of its own closes its loader process, or is killed: either way no
    shared-memory segment is left and multiprocessing's resource tracker has nothing to warn
    about (its warnings go to the trainer's stderr, read to its end: every process that holds it,
    the loader process and the tracker too, has exited)."""
    (tmp_path / "parts.pkl").write_bytes(pickle.dumps(_parts(built, tmp_path)))
    (tmp_path / "trainer.py").write_text(_TRAINER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, str(tmp_path / "trainer.py"),
                          str(tmp_path / "parts.pkl"), end], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == (0 if end == "close" else -signal.SIGKILL), run.stderr
    prefix, pid = run.stdout.split()
    assert not list(Path("/dev/shm").glob(f"{prefix}*"))
    assert "resource_tracker" not in run.stderr and "leaked" not in run.stderr, run.stderr
    status = Path(f"/proc/{pid}/status")  # exited (a zombie until something reaps it)
    assert not status.exists() or "State:\tZ" in status.read_text()


@pytest.mark.slow
def test_a_silent_loader_process_is_an_error_and_a_bad_build_says_why(built, tmp_path):
    import dataclasses
    parts = _parts(built, tmp_path)
    silent = LoaderProcess(parts, 1, timeout_s=3)
    assert silent.position["step"] == 0  # built (the first use waits for that)
    os.kill(silent.pid, signal.SIGSTOP)  # then hung: stops answering
    t0 = time.perf_counter()
    batch = silent.next_step()
    assert time.perf_counter() - t0 < 10 and "gave no answer in 3 s" in batch.error
    assert not silent._proc.is_alive()  # ended, not left stopped
    missing = dataclasses.replace(parts, data=dataclasses.replace(parts.data, sources=[
        dataclasses.replace(parts.data.sources[0], path=str(tmp_path / "nowhere.parquet"))]))
    with pytest.raises(Exception, match="could not build the loader"):
        LoaderProcess(missing, 1, timeout_s=60).state_dict()  # its first use says it
