"""Data worker processes: the heavy part of loading a step, off the training process.

A loader step has a light part that talks to the other ranks (reading rows, measuring them,
the grouped reordering's all-gathers, the state) and a heavy part that does not: decoding the
media, the HF image/audio processors, tokenising and packing each micro-batch. With
`data.workers` = N > 0 the heavy part runs in N spawned processes; the light part, and with it
every collective and every piece of loader state, stays in the training process (on the
prefetch thread). A worker is a pure function of its job (`PackJob` -> `Packed`), so the
batches are the same with or without workers, and resuming needs nothing from them.

The GIL is why: decoding and the HF processors hold it long enough that a thread doing them
slows the training step's own host thread (benchmarks/prefetch.py: 49 % of the loading hidden
with a thread, in wall time).

Results come back pickled, tensors as numpy arrays (`dumps`): one copy, no shared-memory file per
tensor, and a tenth of the unpickling time of torch's own tensor pickling, which the training
process pays.
A worker that dies (killed, out of memory) is a `DataError` naming it and its exit code at
the next step that needs it, never a hang; workers exit when told, and by themselves when the
training process is gone.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import queue
import signal
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ds_omni.data.cost import CostModel
from ds_omni.data.packing import MicroBatch, SeqShard, empty_micro_batch, pack
from ds_omni.data.processing import Sample, SampleProcessor
from ds_omni.errors import DataError

POLL_S = 0.5  # how often a waiting side checks that the other is still alive


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
    shard: tuple[int, int] | None = None  # (rank, size) in the Ulysses group that splits the row
    shard_empty: bool = True  # a micro-batch with no good sample is sharded too (else whole)


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


class Packer:
    """Processes and packs micro-batches (`PackJob` -> `Packed`): what a worker runs, and what
    the loader runs itself without workers."""

    def __init__(self, processors: dict[str, SampleProcessor], item_cost: ItemCost):
        self.processors, self.item_cost = processors, item_cost
        first = next(iter(processors.values()))
        self.item_processors, self.family = first.item_processors, first.family

    def __call__(self, job: PackJob) -> Packed:
        got = [self._process(*p) for p in job.parts]
        samples = [s for s in got if isinstance(s, Sample)]
        shard = SeqShard(*job.shard, self.item_cost) if job.shard else None
        mb = (pack(samples, self.item_processors, shard) if samples else
              empty_micro_batch(self.family, self.item_processors,
                                shard if job.shard_empty else None))
        return Packed(mb, [None if isinstance(s, Sample) else s for s in got])

    def _process(self, source: str, text, media: dict, sample_id: str):
        try:
            return self.processors[source](text=text, media=media, sample_id=sample_id,
                                           source=source)
        except DataError as e:
            return e
        except Exception as e:  # a bug or a failing library: the loader reports it
            return SampleFailure(f"{type(e).__name__}: {e}", traceback.format_exc())


class WorkerPool:
    """`n` spawned processes, each running `fn` (picklable, sent once) on the jobs of `map`."""

    def __init__(self, fn, n: int, *, timeout_s: float = 1800.0):
        if n < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {n}")
        ctx = mp.get_context("spawn")  # not fork: the trainer has threads (gloo, prefetch)
        self.timeout_s, self._round = timeout_s, 0
        self._tasks, self._results = ctx.Queue(), ctx.Queue()
        self._procs = [ctx.Process(target=_serve, args=(fn, self._tasks, self._results),
                                   name=f"ds-omni-data-worker-{i}", daemon=True)
                       for i in range(n)]
        for p in self._procs:  # they start importing now, while the model is being built
            p.start()

    def map(self, jobs: list) -> list:
        """`fn(job)` for each job, in order. A dead worker or an exception in `fn` raises."""
        if self._procs is None:
            raise DataError("the data worker pool is closed")
        self._round += 1
        for i, job in enumerate(jobs):
            self._tasks.put((self._round, i, job))
        out: dict[int, Any] = {}
        waited = 0.0
        while len(out) < len(jobs):
            try:
                rnd, i, ok, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                waited += POLL_S
                if waited > self.timeout_s:
                    raise DataError(f"the data workers returned no micro-batch in "
                                    f"{self.timeout_s:.0f} s") from None
                continue
            if rnd != self._round:  # left over from a round an error interrupted
                continue
            if not ok:
                raise DataError(f"a data worker failed: {payload}")
            out[i] = pickle.loads(payload)
        return [out[i] for i in range(len(jobs))]

    def _check_alive(self) -> None:
        for p in self._procs:
            if p.exitcode is not None:
                self.close(wait_s=0)
                raise DataError(
                    f"data worker process {p.name} (pid {p.pid}) died with {_exit_text(p.exitcode)}"
                    " (its own error, if any, is in this rank's log above). If the machine ran "
                    "out of memory, lower data.workers or the batch size; a script that trains "
                    "must do so under `if __name__ == \"__main__\":` (workers import it); "
                    "data.workers 0 loads in the training process")

    def close(self, wait_s: float = 5.0) -> None:
        """Tell the workers to stop; end those still running after `wait_s`."""
        procs, self._procs = self._procs, None
        if not procs:
            return
        for _ in procs:
            self._tasks.put(None)
        for p in procs:
            p.join(wait_s)
            if p.is_alive():
                p.terminate()
                p.join(1.0)
        self._tasks.cancel_join_thread()
        self._results.cancel_join_thread()

    def __del__(self):  # no queue work here: it may run while the interpreter shuts down
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


def _serve(fn, tasks, results) -> None:
    """A worker's loop: jobs in, pickled results out, until told to stop or orphaned."""
    torch.set_num_threads(1)  # the training process keeps the other cores
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; we follow it
    parent = mp.parent_process()
    while True:
        try:
            task = tasks.get(timeout=POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                os._exit(0)
            continue
        if task is None:
            break
        rnd, i, job = task
        try:
            results.put((rnd, i, True, dumps(fn(job))))
        except Exception as e:
            results.put((rnd, i, False, f"{type(e).__name__}: {e} (in worker pid {os.getpid()}):"
                                        f"\n{traceback.format_exc()}"))
    results.close()
    results.join_thread()  # what was put has been sent
    os._exit(0)  # no interpreter shutdown: libraries' exit handlers (datasets sleeps 5 s) are moot
