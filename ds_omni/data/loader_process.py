"""The loader in a process of its own: with `data.workers` >= 1 the trainer only receives finished
micro-batches.

The whole `OmniLoader` and its step-ahead loop (`Prefetcher`) run in one spawned loader process
per rank (its side: `loader_serve.py`), with N - 1 pack workers (`workers.WorkerPool`); the
trainer keeps `LoaderProcess`, a thin proxy with the loop's interface (next step, state_dict,
load_state_dict, set_weights, rewind, skipped, counts, close), and pays per step a request, a
small reply and the hand-over (`handover.py`). The next step is requested as soon as one is
received, so the round trip is off the critical path. The loader processes form their own gloo
world (`loader_world.py`), never a training group. The samples and batches are those of
`data.workers` 0, and the checkpointed position is the trainer's, whatever was made ahead. A
loader process that dies or stops answering is a `DataError` naming rank, pid and exit code,
delivered as the step's error so every rank stops, never a hang.
More: docs/internals.md, "The loader process"; docs/data.md, "Loading ahead".
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import secrets
from dataclasses import dataclass

import torch

from ds_omni.config import DataConfig
from ds_omni.data.cores import CorePlan, pin_pid, pin_trainer, release_trainer
from ds_omni.data.cost import CostModel
from ds_omni.data import loader_serve
from ds_omni.data.handover import Receiver
from ds_omni.data.loader import OmniLoader, StepBatch
from ds_omni.data.packing import SeqShard, empty_micro_batch
from ds_omni.data.prefetch import Prefetcher, TakenSteps
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.loader_world import world_of
from ds_omni.data.rank_place import LoaderComms, LongSplits, RankPlace, SharedReading
from ds_omni.data.sources import Source
from ds_omni.data.workers import ItemCost, _exit_text
from ds_omni.errors import DataError

START_TIMEOUT_S = 600.0  # the loader process's start: imports, sources opened, groups made


@dataclass
class LoaderParts:
    """What an `OmniLoader` is built from, all picklable (the loader process gets a copy)."""

    data: DataConfig
    processors: dict[str, SampleProcessor]
    cost_model: CostModel
    global_batch_size: int
    place: RankPlace
    splits: LongSplits

    def build(self, comms: LoaderComms, pack_workers: int,
              worker_cores: tuple[tuple[int, ...], ...] = ()) -> OmniLoader:
        """The loader, with `pack_workers` processes of its own for decoding and packing (on
        `worker_cores`, one tuple per worker; () unpinned)."""
        data = dataclasses.replace(self.data, workers=pack_workers)
        sources = [Source(s, chunk_rows=data.chunk_rows) for s in data.sources]
        return OmniLoader(sources, self.processors, self.cost_model, data,
                          global_batch_size=self.global_batch_size, place=self.place,
                          comms=comms, splits=self.splits, worker_cores=worker_cores)


class LoaderProcess(TakenSteps):
    """This rank's loader, run in a spawned process (`data.workers` >= 1): the `OmniLoader`
    interface the training loop uses. `comm`: the trainer's own collectives (token totals,
    logging); the loader processes rebuild their groups from `parts.place` (its plan and rank,
    when more than one rank loads). `cores`: where this rank's processes run (`cores.plan_cores`):
    the trainer is held to its cores until the loader closes."""

    def __init__(self, parts: LoaderParts, workers: int, *, comm=None,
                 shared: SharedReading | None = None, timeout_s: float = 1800.0,
                 cores: CorePlan | None = None):
        from ds_omni.data.rank_place import LocalComm
        place = parts.place
        self.comm = comm or LocalComm()
        self.dp_rank, self.dp_size, self.num_micro = place.dp_rank, place.dp_size, place.num_micro
        rank = place.rank
        self.cost_model, self.timeout_s, self.rank = parts.cost_model, timeout_s, rank
        first = next(iter(parts.processors.values()))
        self.item_processors, self.family = first.item_processors, first.family
        self.shard = (SeqShard(place.sp_rank, place.sp_size, ItemCost(parts.cost_model),
                               parts.splits.long_items, cut=place.row_cut)
                      if place.sp_size > 1 else None)
        self.sources = {s.name: s for s in parts.data.sources}  # (their configs, by name)
        world = world_of(place, shared, timeout_s)
        ctx = mp.get_context("spawn")  # not fork: the trainer has threads (gloo, DeepSpeed)
        mine, theirs = ctx.Pipe()
        # its shared-memory slots' names (`handover.py`): a token too, since a pid is reused
        prefix = f"dso_{os.getpid()}_{rank}_{secrets.token_hex(3)}_"
        self._receiver = Receiver(prefix)
        # pack workers are the loader process's children: a daemon may have none
        self.cores = cores or CorePlan(why_not="no plan given")
        self._proc = ctx.Process(target=loader_serve.serve, args=(parts, workers - 1, world, theirs,
                                                      self.cores, prefix),
                                 name=f"ds-omni-loader-rank{rank}", daemon=workers == 1)
        self._proc.start()
        pin_pid(self._proc.pid, self.cores.loader)  # now: its imports run on its own core
        self._pinned = pin_trainer(self.cores)
        theirs.close()
        self._conn, self._closed = mine, False
        atexit.register(self._end)  # before multiprocessing joins its non-daemon children
        self.last_wait_s = 0.0
        self._skip_log: list[dict] = []
        self._position: dict | None = None  # None: the loader process has not said it is built
        self.taken_before: dict | None = None
        # the step-ahead loop's settings (`prefetch`): whether to ask for a step early
        self._ahead, self._until = 0, None
        self._asked_next = False  # a "next" request sent early, its reply not read yet
        self._early: tuple | None = None  # that reply, read before another request went out
        self.early_replies = 0  # steps taken from a request sent early (the mechanism's counter)

    @property
    def position(self) -> dict:
        """The loader's position after the steps taken (the trainer holds it). Its first use
        waits for the loader process to have built the loader, not the constructor: the loader
        processes of all ranks join their world together, and rank 0 builds its loader before
        the other ranks start building theirs (`setup_training`: it makes the builtin assets
        first), so a constructor that waited would wait for a peer that never comes."""
        if self._position is None:
            self._position = self._built()
        return self._position

    @position.setter
    def position(self, value: dict) -> None:
        self._position = value

    def _built(self) -> dict:
        """The loader process's first message: built (its position), or why it could not be."""
        try:  # it imports torch and the processors' libraries, opens the sources, joins the world
            status, value = pickle.loads(self._receive(max(self.timeout_s, START_TIMEOUT_S)))
        except (EOFError, OSError):
            self._died()
        if status == "error":
            self._end()
            raise DataError(f"rank {self.rank}: the loader process could not build the loader: "
                            f"{value}")
        return value

    @property
    def pid(self) -> int:
        return self._proc.pid

    # ---------------------------------------------------------------------- the loop's view
    def next_step(self) -> StepBatch:
        """The next step's batch; a dead or silent loader process is this step's error.

        While the loader process makes steps ahead (`prefetch`), the request for the following
        step goes out as soon as this one is received, so its reply (a few KB over the pipe, its
        tensors written into the shared-memory slot: `handover.py`) is made while this step
        trains, and the next call only reads it: the loader process's wake-up, its reply and the
        trainer's own wait leave the step's critical path (benchmarks/handover.py: 1.24-1.42 ->
        0.94 ms wall a step here, and any delay of the reply behind the step-ahead thread). The slot stays
        safe: this step was copied out before the request that lets the slot be rewritten."""
        import time
        t0 = time.perf_counter()
        try:
            after, skipped, batch = self._next_reply()
            self._ask_next_early(after)
        except DataError as e:
            batch = StepBatch(step=self.step, micro_batches=[
                empty_micro_batch(self.family, self.item_processors, self.shard)] * self.num_micro,
                error=str(e))
            after, skipped = self.position, []
        self.last_wait_s = time.perf_counter() - t0
        self.taken_before, self.position = self.position, after
        self._skip_log += skipped
        return batch

    def take_skipped(self) -> list[dict]:
        out, self._skip_log = self._skip_log, []
        return out

    def state_dict(self) -> dict:
        """The data state after the steps taken (every rank calls it: it gathers)."""
        return self._ask("state_dict", self.position)

    def load_state_dict(self, state: dict) -> None:
        self.position = self._ask("load_state_dict", state, moves=True)
        self.taken_before = None

    def set_weights(self, weights: dict[str, float]) -> None:
        """New mixing weights from the next step to be taken (call on every rank)."""
        self.position = self._ask("set_weights", self.position, weights, moves=True)

    def rewind(self) -> None:
        """Undo the last step taken (it was not trained)."""
        if self.taken_before is not None:
            self.position = self._ask("restore", self.taken_before, moves=True)
            self.taken_before = None

    def prefetch(self, steps: int, until: int | None = None) -> "ProcessFeed":
        """Make up to `steps` steps ahead (never one at or past `until`); `close()` the returned
        feed to stop."""
        self.position = self._ask("prefetch", self.position, steps, until, moves=True)
        self._ahead, self._until = steps, until
        return ProcessFeed(self)

    @property
    def counts(self):
        """What this rank's loader read and processed (`sample_reader.ReadCounts`)."""
        return self._ask("counts")

    def placement(self) -> dict:
        """The cores the loader process and its pack workers run on, read back from it."""
        return self._ask("placement")

    def load_samples(self, keys: list[str]) -> list:
        return self._ask("load_samples", keys)

    def close(self, abort: bool = False) -> None:
        """Stop the loader process (and its pack workers). `abort` (an error is on its way) with
        a step asked for early: ended at once, not told, since it answers in order and that step
        may wait on a peer that is gone (`_end` kills it if it does not stop)."""
        if self._closed:
            return
        if not (abort and self._asked_next):
            try:
                self._ask("close", abort, moves=True)
            except DataError:
                pass
        self._end()

    # ---------------------------------------------------------------------------- requests
    def _next_reply(self) -> tuple:
        """(position after, skipped samples, batch) of the next step: the reply read early, or
        the one to the request sent early, or a request's now."""
        if self._early is not None:
            reply, self._early = self._early, None
        elif self._asked_next:
            self._asked_next = False
            reply = self._reply()
        else:
            return self._value(self._request("next"))
        if not self._proc.is_alive():  # its death is this step's error, as if asked now
            self._died()
        self.early_replies += 1
        return self._value(reply)

    def _ask_next_early(self, after: dict) -> None:
        """Send the request for the step after `after` now, where the step-ahead loop makes it
        anyway (the same steps on every rank: their loader processes stop in lockstep)."""
        if self._ahead > 0 and (self._until is None or after["step"] < self._until):
            self._send("next", True)
            self._asked_next = True

    def _ask(self, op: str, *args, moves: bool = False):
        """Send a request, wait for its reply: a dead or silent loader process raises. A reply
        to a "next" sent early is read first (the loader process answers in order): kept for
        the next `next_step`, or dropped where `moves` (the request puts the loader at another
        position, so that step is made again if it is still wanted)."""
        if self._asked_next:
            self._asked_next = False
            self._early = self._reply()
        if moves:
            self._early = None
        return self._value(self._request(op, *args))

    def _request(self, op: str, *args) -> tuple:
        self._send(op, *args)
        return self._reply()

    def _send(self, op: str, *args) -> None:
        if self._closed:
            raise DataError(f"rank {self.rank}: the loader process is closed")
        self.position  # noqa: B018 (its first message, "built", comes before any reply)
        try:
            self._conn.send_bytes(pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._died()

    def _reply(self) -> tuple:
        """The next reply, as (status, value); a step's batch is copied out of the shared-memory
        slot here, before any further request lets the loader process rewrite it."""
        try:
            status, value = pickle.loads(self._receive())
            if status == "batch":  # position, skipped, and the step's hand-over header
                after, skipped, header = value
                return status, (after, skipped, self._receiver.receive(header))
        except (EOFError, OSError):
            self._died()
        return status, value

    def _value(self, reply: tuple):
        status, value = reply
        if status == "error":
            raise DataError(f"rank {self.rank}: the loader process (pid {self.pid}) failed: "
                            f"{value}")
        return value

    def _receive(self, timeout_s: float | None = None) -> bytes:
        timeout_s = timeout_s or self.timeout_s
        ready = mp.connection.wait([self._conn, self._proc.sentinel], timeout=timeout_s)
        if self._conn in ready:
            return self._conn.recv_bytes()
        if not ready:
            self._end(wait_s=0)
            raise DataError(f"rank {self.rank}: the loader process (pid {self.pid}) gave no "
                            f"answer in {timeout_s:.0f} s (hung: its stack is in this "
                            "rank's log if it was started with faulthandler); data.workers 0 "
                            "loads in the training process")
        raise EOFError

    def _died(self):
        self._proc.join(1.0)
        code = self._proc.exitcode
        self._end()
        raise DataError(
            f"rank {self.rank}: the loader process (pid {self.pid}) died with "
            f"{_exit_text(code) if code is not None else 'no exit code yet'} (its own error, "
            "if any, is in this rank's log above). If the machine ran out of memory, lower "
            "data.workers or the batch size; a script that trains must do so under "
            "`if __name__ == \"__main__\":` (the loader process imports it); data.workers 0 "
            "loads in the training process")

    def _end(self, wait_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._conn.close()  # a loader process waiting for a request sees it and exits
        self._proc.join(wait_s)
        if self._proc.is_alive():  # SIGKILL: a stopped (or hung) process ignores SIGTERM
            self._proc.kill()
            self._proc.join(5.0)
        self._receiver.close(sender_gone=True)  # what a loader process killed left
        if self._pinned:
            release_trainer()
        atexit.unregister(self._end)


class ProcessFeed:
    """What the training loop takes steps from (the `Prefetcher`'s interface) while the loader
    process makes them ahead; `close()` stops that and leaves it at the steps taken."""

    def __init__(self, loader: LoaderProcess):
        self.loader, self.comm, self.sources = loader, loader.comm, loader.sources

    step = property(lambda self: self.loader.step)
    skipped = property(lambda self: self.loader.skipped)
    last_wait_s = property(lambda self: self.loader.last_wait_s)

    def next_step(self) -> StepBatch:
        return self.loader.next_step()

    def take_skipped(self) -> list[dict]:
        return self.loader.take_skipped()

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def set_weights(self, weights: dict[str, float]) -> None:
        self.loader.set_weights(weights)

    def rewind(self) -> None:
        self.loader.rewind()

    def close(self, abort: bool = False) -> None:
        if abort:  # an error is on its way: the loader process is ended with the run
            return
        self.loader.prefetch(0)


def feed_for(loader, steps: int, *, until: int | None = None, timeout_s: float = 1800.0):
    """The training loop's feed: the loader process's own step-ahead loop, or a `Prefetcher`
    thread over an in-process loader."""
    if isinstance(loader, LoaderProcess):
        return loader.prefetch(steps, until)
    return Prefetcher(loader, steps, until=until, timeout_s=timeout_s)
