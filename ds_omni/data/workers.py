"""Data worker processes: the heavy part of loading a step, off the loader's own thread.

A loader step has a light part that talks to the other ranks (reading, measuring, the reordering's
all-gathers, the state) and a heavy part that does not (decoding media, HF processors, tokenising,
packing). With pack workers the heavy part runs in spawned processes, each a pure function of its
job (`PackJob` -> `Packed`), so batches are the same with or without them and resuming needs
nothing from them. Under `data.workers` N >= 1 the loader process drives N - 1 of these
(`loader_process.py`). Results come back pickled with tensors as numpy arrays (`dumps`: a tenth of
torch's unpickling time). A worker that dies is a `DataError` naming it and its exit code at the
next step that needs it, never a hang; workers exit by themselves when the trainer is gone.
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ds_omni.batch import MicroBatch
from ds_omni.data.cores import pin_pid
from ds_omni.data.cost import CostModel
from ds_omni.data.packing import SeqShard, empty_micro_batch, pack, pack_shards
from ds_omni.data.processing import Sample, SampleProcessor
from ds_omni.errors import DataError
from ds_omni.parallel.long_short import LongItems


# benchmarks/feed_rate.py: the shipped processors (CLIP 336, Qwen2-VL, SigLIP, Whisper) need at
# most 1.5 CPU cores to feed one H200 at 45 % MFU (the 1.4B LLaVA; a 7B backbone under 0.6)
FEED_WORKERS_PER_GPU = 2


def resolve_workers(setting: int | str, *, cuda: bool | None = None, cores: int | None = None,
                    local_ranks: int | None = None) -> int:
    """`data.workers` as a count. "auto": 0 without a GPU (CPU runs and tests load in the
    training process), else FEED_WORKERS_PER_GPU per rank, at most the cores each of the host's
    ranks has beyond its own training thread."""
    if setting != "auto":
        return int(setting)
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return 0
    cores = cores or len(os.sched_getaffinity(0))
    local = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or \
        max(1, torch.cuda.device_count())
    return max(0, min(FEED_WORKERS_PER_GPU, cores // local - 1))


class ItemCost:
    """Modelled cost of encoding one item (what the reshard plan balances); picklable."""

    def __init__(self, cost_model: CostModel):
        self.cost_model = cost_model

    def __call__(self, encoder: str, item) -> float:
        return float(self.cost_model.encoder_cost(encoder, np.array(item.cost_seqs())).sum())


@dataclass
class PackJob:
    """One micro-batch to make: its samples' raw parts, in order, and how to pack them."""

    parts: list[tuple[str, Any, dict, str]]  # (source, text, media, sample id) per sample
    shard: tuple | None = None  # (rank, size[, RowCut]) in the group that splits the row
    shard_empty: bool = True  # a micro-batch with no good sample is sharded too (else whole)
    every_shard: bool = False  # the SP group's reader: make every rank's shard of the row
    sp_block: tuple[int, int] | None = None  # per-sequence SP: (first rank, size) of the block


@dataclass
class SampleFailure:
    """An unexpected exception (not a bad sample) while processing a sample, as text: its
    traceback is that of the process it happened in."""

    message: str
    traceback: str


@dataclass
class Packed:
    """A made micro-batch, and per sample of the job: None (packed) or why it was left out."""

    micro_batch: MicroBatch
    problems: list[DataError | SampleFailure | None]
    peers: list[MicroBatch] | None = None
    """`PackJob.every_shard`: the shards of the SP group's other ranks, in group-rank order."""
    items_made: int = 0  # encoder items processed (decoded images, clips, videos)


class Packer:
    """Processes and packs micro-batches (`PackJob` -> `Packed`): what a worker runs, and what
    the loader runs itself without workers."""

    def __init__(self, processors: dict[str, SampleProcessor], item_cost: ItemCost,
                 long_items: LongItems | None = None):
        self.processors, self.item_cost, self.long_items = processors, item_cost, long_items
        first = next(iter(processors.values()))
        self.item_processors, self.family = first.item_processors, first.family

    def __call__(self, job: PackJob) -> Packed:
        got = [self._process(*p) for p in job.parts]
        samples = [s for s in got if isinstance(s, Sample)]
        shard = (SeqShard(*job.shard[:2], self.item_cost, self.long_items, block=job.sp_block,
                          cut=job.shard[2] if len(job.shard) > 2 else None) if job.shard else None)
        problems = [None if isinstance(s, Sample) else s for s in got]
        made = sum(len(s.items) for s in samples)
        if job.every_shard:  # one processing of the row, every rank's shard of it
            shards = (pack_shards(samples, self.item_processors, shard) if samples else
                      [empty_micro_batch(self.family, self.item_processors,
                                         dataclasses.replace(shard, rank=r))
                       for r in range(shard.size)])
            return Packed(shards[0], problems, shards[1:], made)
        mb = (pack(samples, self.item_processors, shard) if samples else
              empty_micro_batch(self.family, self.item_processors,
                                shard if job.shard_empty else None))
        return Packed(mb, problems, items_made=made)

    def _process(self, source: str, text, media: dict, sample_id: str):
        try:
            return self.processors[source](text=text, media=media, sample_id=sample_id,
                                           source=source)
        except DataError as e:
            return e
        except Exception as e:  # a bug or a failing library: the loader reports it
            return SampleFailure(f"{type(e).__name__}: {e}", traceback.format_exc())


class WorkerPool:
    """`n` spawned processes, each running `fn` (picklable, sent once) on the jobs of `map`.

    A step's jobs go to the workers in contiguous parts, one message each way per worker: every
    hand-off between the trainer's threads and a worker waits for the GIL (up to its 5 ms switch
    interval while the step's host thread holds it), so there are as few as possible.

    `cores`: worker i is held to `cores[i]` (`cores.py`; none: unpinned, or where not given).

    One `map` at a time: the prefetch thread's and any other caller's maps take turns (two
    readers of one pipe would split a reply between them)."""

    def __init__(self, fn, n: int, *, timeout_s: float = 1800.0,
                 cores: tuple[tuple[int, ...], ...] = ()):
        if n < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {n}")
        ctx = mp.get_context("spawn")  # not fork: the trainer has threads (gloo, prefetch)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._conns, self._procs = [], []
        for i in range(n):  # they start importing now, while the model is being built
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(fn, theirs), name=f"ds-omni-data-worker-{i}",
                               daemon=True)
            proc.start()
            pin_pid(proc.pid, cores[i] if i < len(cores) else ())
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)

    def map(self, jobs: list) -> list:
        """`fn(job)` for each job, in order. A dead worker or an exception in `fn` raises."""
        with self._lock:
            return self._map(jobs)

    def _map(self, jobs: list) -> list:
        if self._procs is None:
            raise DataError("the data worker pool is closed")
        n = len(self._procs)
        bounds = [len(jobs) * i // n for i in range(n + 1)]
        busy = [(c, p, jobs[a:b]) for c, p, a, b in zip(self._conns, self._procs, bounds,
                                                          bounds[1:]) if b > a]
        for conn, proc, part in busy:
            try:
                conn.send_bytes(pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                self._died(proc)
        replies = [self._receive(conn, proc) for conn, proc, _ in busy]
        failed = [payload for ok, payload in replies if not ok]
        if failed:
            raise DataError(f"a data worker failed: {failed[0]}")
        return [out for _, payload in replies for out in payload]

    def _receive(self, conn, proc) -> tuple[bool, Any]:
        ready = mp.connection.wait([conn, proc.sentinel], timeout=self.timeout_s)
        if not ready:
            self.close(wait_s=0)
            raise DataError(f"the data workers returned no micro-batch in {self.timeout_s:.0f} s")
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._died(proc)

    def _died(self, proc) -> None:
        proc.join(1.0)
        self.close(wait_s=0)
        raise DataError(
            f"data worker process {proc.name} (pid {proc.pid}) died with "
            f"{_exit_text(proc.exitcode)} (its own error, if any, is in this rank's log above). If "
            "the machine ran out of memory, lower data.workers or the batch size; a script that "
            "trains must do so under `if __name__ == \"__main__\":` (workers import it); "
            "data.workers 0 loads in the training process")

    def close(self, wait_s: float = 5.0) -> None:
        """Tell the workers to stop; end those still running after `wait_s`."""
        procs, self._procs = self._procs, None
        if not procs:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        for proc in procs:
            proc.join(wait_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
        for conn in self._conns:
            conn.close()

    def __del__(self):  # nothing that can block: it may run while the interpreter shuts down
        for p in getattr(self, "_procs", None) or []:
            p.terminate()


class _Pickler(pickle.Pickler):
    """Plain CPU tensors as numpy arrays (a tensor that is a view sends only what it shows)."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad \
                and obj.layout == torch.strided and obj.dtype in _NUMPY_DTYPES:
            return torch.from_numpy, (obj.numpy().copy() if not obj.is_contiguous() else
                                      obj.numpy(),)
        return NotImplemented


_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool}


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}" + (
                " (killed: often the out-of-memory killer)" if -code == signal.SIGKILL else "")
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _serve(fn, conn) -> None:
    """A worker's loop: parts of a step in, their pickled results out, until told to stop or
    orphaned."""
    torch.set_num_threads(1)  # the training process keeps the other cores
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; we follow it
    parent = mp.parent_process()
    watch = [conn] + ([parent.sentinel] if parent is not None else [])
    while True:
        if conn not in mp.connection.wait(watch):  # the training process is gone
            break
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:  # every failure goes back as a reply: the trainer sees the error, not a death
            part = pickle.loads(message)
            if part is None:
                break
            reply = dumps((True, [fn(job) for job in part]))
        except Exception as e:
            reply = pickle.dumps((False, f"{type(e).__name__}: {e} (in worker pid {os.getpid()}):"
                                         f"\n{traceback.format_exc()}"))
        conn.send_bytes(reply)
    os._exit(0)  # no interpreter shutdown: libraries' exit handlers (datasets sleeps 5 s) are moot
