"""`python -m tests.e2e.faulty train ...`: `ds-omni train` with faults planted, for tests only.

    DS_OMNI_TEST_FAULTS="kill:1:save:20,stop:0:forward:35"  DS_OMNI_TEST_FAULT_DIR=/tmp/x

Each fault is `action:rank:point:step`: at `point` of step `step`, rank `rank` kills itself with
SIGKILL ("kill", a dying process or node), stops itself with SIGSTOP ("stop", a frozen node), or
waits forever outside any collective ("hang", a deadlock). Points: "loader" (inside the loader: the
step's samples are read and measured, their processing and packing starts; with prefetch on, the
default, that is on the prefetch thread while the step before trains), "forward", "backward",
"optimizer" (DeepSpeed's engine calls of that training step, on the main thread), "save" (DeepSpeed
has written its files of the checkpoint saved after `step` steps; its manifest is not written yet).
A fault fires once per DS_OMNI_TEST_FAULT_DIR (a marker file there), so a supervised restart runs
past it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

_STEP = [-1]  # the step the main thread trains


def _faults() -> list[tuple[int, str, str, int, int]]:
    out = []
    for i, spec in enumerate(filter(None, os.environ.get("DS_OMNI_TEST_FAULTS", "").split(","))):
        action, rank, point, step = spec.split(":")
        out.append((i, action, point, int(rank), int(step)))
    return out


def _maybe_fire(point: str, step: int) -> None:
    rank = int(os.environ.get("RANK", "0"))
    for i, action, where, at_rank, at_step in _faults():
        if (where, at_rank, at_step) != (point, rank, step):
            continue
        try:  # fire once: the first process to create the marker does
            fd = os.open(Path(os.environ["DS_OMNI_TEST_FAULT_DIR"]) / f"fired-{i}",
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)
        except FileExistsError:
            continue
        print(f"faulty: rank {rank}: {action} at {point} of step {step}", flush=True)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            threading.Event().wait()


def fired_at(directory: str | Path, count: int) -> list[float]:
    """When each of the first `count` faults fired (its marker's time), for tests to bound what
    followed."""
    return [os.stat(Path(directory) / f"fired-{i}").st_mtime for i in range(count)]


def _wrap(owner, name: str, before=None, after=None) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before:
            before(*args)
        out = inner(*args, **kwargs)
        if after:
            after(out, *args)
        return out
    setattr(owner, name, wrapper)


def plant() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from ds_omni.data.step_load import MicroBatchLoader
    from ds_omni.train import checkpoint, loop

    def training(_engine, batch, *_):
        _STEP[0] = batch.step
    _wrap(loop, "train_step", before=training)  # the loop's own name for it
    _wrap(MicroBatchLoader, "load", before=lambda _, mine, stats, step: _maybe_fire("loader", step))
    for point, name in (("forward", "forward"), ("backward", "backward"), ("optimizer", "step")):
        _wrap(DeepSpeedEngine, name, before=lambda *_, p=point: _maybe_fire(p, _STEP[0]))
    _wrap(checkpoint, "_digest_share",
          before=lambda directory, *_: _maybe_fire("save", int(directory.name[5:13])))


if __name__ == "__main__":
    plant()
    from ds_omni.cli import main
    sys.exit(main())
