"""Data loading off the critical path: the next steps' batches are made on a thread while the
current step trains.

The thread runs `OmniLoader.next_step` up to `data.prefetch_steps` steps ahead and the trainer
takes the batches in order: the same samples and order as a loader called step by step. What the
trainer sees of the loader is its position after the step it took last (state, skipped samples,
`step`), never the prefetched one; a weight change or rewind drops the prefetched steps. The
thread's all-gathers go over the loader's own gloo groups (`step_comm`), never interleaving with
the step's. Stopping is in lockstep: the thread finishes every step it was allowed (the same count
on every rank), so no rank is left in an all-gather; on an error it gets a minute, then is
abandoned (a daemon). A thread holds the GIL against the step, so with `data.workers` >= 1 this
loop runs in the loader process instead (`loader_process.py`).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

import torch

from ds_omni.data.loader import OmniLoader, StepBatch
from ds_omni.errors import DataError

ABORT_WAIT_S = 60.0  # how long a failing run waits for the thread's last allowed steps


@dataclass
class _Made:
    """One step made ahead: its batch, the loader's position before and after it, the samples it
    skipped."""

    batch: StepBatch
    before: dict
    after: dict
    skipped: list[dict]


class TakenSteps:
    """`step` and `skipped` of the steps the trainer took, from `position` (the loader's
    position after them), whatever was made ahead: the `Prefetcher`'s and the loader process's."""

    position: dict

    @property
    def step(self) -> int:
        return self.position["step"]

    @property
    def skipped(self) -> dict[str, int]:
        return dict(self.position["local"]["skipped"])


class Prefetcher(TakenSteps):
    """Wraps one rank's `OmniLoader` for the training loop: `next_step`, `state_dict`, `rewind`,
    `set_weights`, `take_skipped`, `skipped`, `comm` as the loader has them, for the steps taken.

    `steps` = 0 loads each step when it is asked for (no thread). `until`: no step at or past
    it is made (the run's last step). `close()` when done: it stops the thread and leaves the
    loader at the position of the steps taken."""

    def __init__(self, loader: OmniLoader, steps: int, *, until: int | None = None,
                 timeout_s: float = 1800.0):
        if steps and loader.step_comm is loader.comm and loader.dp_size > 1:
            raise ValueError("a loader whose steps run on a prefetch thread needs process groups "
                             "of its own for them: build it with step_comm (groups."
                             "loader_step_comm), or prefetch 0 steps")
        self.loader, self.ahead, self.until, self.timeout_s = loader, steps, until, timeout_s
        self.comm, self.sources = loader.comm, loader.sources
        self.position = loader._position()  # after the steps taken
        self.taken: _Made | None = None
        self.last_wait_s = 0.0  # how long the last `next_step` waited for its batch
        self._skip_log: list[dict] = []
        self._cond = threading.Condition()
        self._made: collections.deque[_Made] = collections.deque()
        self._limit = 0  # the thread makes steps below this loader step
        self._closing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------- the loop's view
    def next_step(self) -> StepBatch:
        t0 = time.perf_counter()
        made = self._take() if self.ahead > 0 else self._make()
        self.last_wait_s = time.perf_counter() - t0
        self.taken, self.position = made, made.after
        self._skip_log += made.skipped
        return made.batch

    def take_skipped(self) -> list[dict]:
        out, self._skip_log = self._skip_log, []
        return out

    def state_dict(self) -> dict:
        """The data state after the steps taken (collective over the loader's `comm`)."""
        return self.loader.state_dict(self.position)

    def set_weights(self, weights: dict[str, float]) -> None:
        """New mixing weights from the next step to be taken (call on every rank)."""
        self.close()
        self.loader.set_weights(weights)

    def rewind(self) -> None:
        """Undo the last step taken (it was not trained)."""
        self.close()
        if self.taken is not None:
            self.position = self.taken.before
            self.loader.restore(self.position)
            self.taken = None

    def close(self, abort: bool = False) -> None:
        """Stop the thread after the steps it was allowed (the same number on every rank, so every
        all-gather it began completes) and put the loader back at the position of the steps
        taken. `abort` (an error is on its way): wait at most ABORT_WAIT_S and leave the loader
        as it is."""
        thread = self._thread
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if thread is not None:
            thread.join(min(ABORT_WAIT_S, self.timeout_s) if abort else self.timeout_s)
            if thread.is_alive():
                if abort:
                    return
                raise DataError(f"the data prefetch thread did not stop within "
                                f"{self.timeout_s:.0f} s")
        self._thread, self._closing, self._error = None, False, None
        self._made.clear()
        if not abort:
            self.loader.restore(self.position)

    # ---------------------------------------------------------------------------- the thread
    def _make(self) -> _Made:
        batch = self.loader.next_step()
        if torch.cuda.is_available():  # page-locked, so the copy to the GPU does not block
            batch.micro_batches = [mb.pin_memory() for mb in batch.micro_batches]
        return _Made(batch, self.loader._step_start, self.loader._position(),
                     self.loader.take_skipped())

    def _ahead_now(self) -> int:
        """The steps past the one being taken that may be made while it trains."""
        return self.ahead

    def _take(self) -> _Made:
        want = self.position["step"]
        with self._cond:
            ahead = self._ahead_now()
            self._limit = want + 1 + ahead if self.until is None else \
                min(want + 1 + ahead, self.until)
            self._limit = max(self._limit, want + 1)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ds-omni-prefetch",
                                                daemon=True)
                self._thread.start()
            ok = self._cond.wait_for(lambda: self._made or self._error is not None,
                                     timeout=self.timeout_s)
            if self._made:
                return self._made.popleft()
        if not ok:
            raise DataError(f"no batch from the data prefetch thread in {self.timeout_s:.0f} s")
        raise self._error

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self.loader.step < self._limit or self._closing)
                    if self.loader.step >= self._limit:
                        return
                made = self._make()
                with self._cond:
                    self._made.append(made)
                    self._cond.notify_all()
        except BaseException as e:  # handed to the trainer, raised by `next_step`
            with self._cond:
                self._error = e
                self._cond.notify_all()
