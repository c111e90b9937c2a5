"""Run a function on N ranks over gloo, with a hard timeout that reports where each rank is stuck.

    results = run_on_ranks(fn, world_size=2, args=(...), timeout=120)

`fn(rank, world_size, *args)` must be importable (a module-level function): ranks are spawned
processes. Each joins a process group through `deepspeed.init_distributed` on a free port. If a rank
raises, the test fails with that rank's traceback; if any rank is still running at the deadline,
every rank's Python stacks are dumped (faulthandler) and the test fails with them instead of
blocking CI.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from ds_omni.parallel.dist import free_port

REPO = Path(__file__).resolve().parents[1]


class RanksFailed(AssertionError):
    pass


def _child(fn, rank, world_size, port, workdir, timeout, args):
    workdir = Path(workdir)
    stacks = open(workdir / f"rank{rank}.stacks", "w")
    faulthandler.dump_traceback_later(timeout, exit=True, file=stacks)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    try:
        import deepspeed
        from ds_omni.parallel.dist import skip_shm_op
        skip_shm_op()  # training never uses it: no 30-60 s build at the first launch
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=timeout),
                                   verbose=False)
        result = fn(rank, world_size, *args)
        (workdir / f"rank{rank}.result").write_bytes(pickle.dumps(result))
    except BaseException:
        (workdir / f"rank{rank}.error").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        faulthandler.cancel_dump_traceback_later()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, args: tuple = (), timeout: float = 120.0) -> list:
    """`[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]`, each computed on its own rank."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ds_omni_ranks_") as workdir:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, workdir, timeout, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        _wait(procs, Path(workdir), deadline=time.monotonic() + timeout + 30)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        return _collect(Path(workdir), procs, hung, timeout)


def _wait(procs, workdir: Path, deadline: float) -> None:
    """Until all ranks exit or the deadline; once one rank fails, the rest get a short grace."""
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        failed = any(p.exitcode not in (None, 0) for p in procs) or any(workdir.glob("*.error"))
        if failed:
            deadline = min(deadline, time.monotonic() + 5)
        time.sleep(0.05)


def _collect(workdir: Path, procs, hung: list[int], timeout: float) -> list:
    errors = {r: (workdir / f"rank{r}.error").read_text() for r in range(len(procs))
              if (workdir / f"rank{r}.error").exists()}
    stacks = {r: (workdir / f"rank{r}.stacks").read_text() for r in range(len(procs))
              if (workdir / f"rank{r}.stacks").exists()
              and (workdir / f"rank{r}.stacks").read_text().strip()}
    if errors:
        raise RanksFailed("\n".join(f"--- rank {r} raised:\n{tb}" for r, tb in errors.items()))
    if hung or stacks or any(p.exitcode != 0 for p in procs):
        detail = "\n".join(f"--- rank {r} stacks:\n{s}" for r, s in stacks.items())
        raise RanksFailed(f"ranks {hung or [r for r, p in enumerate(procs) if p.exitcode]} did not "
                          f"finish within {timeout:.0f}s (exit codes "
                          f"{[p.exitcode for p in procs]}):\n{detail}")
    return [pickle.loads((workdir / f"rank{r}.result").read_bytes()) for r in range(len(procs))]
