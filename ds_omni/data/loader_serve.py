"""The loader process's own side (`loader_process.py` is the trainer's): it builds this rank's
`OmniLoader`, runs its step-ahead loop (`AheadFeed`) and answers the trainer's requests in order
(`Server`), every step's tensors handed over through a shared-memory slot (`handover.py`).
`serve` is the spawned process's target: requests in, replies out, until told to stop or
orphaned."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import traceback

import torch

from ds_omni.data.cores import CorePlan, pin_self
from ds_omni.data.handover import Sender, encode
from ds_omni.data.loader import OmniLoader
from ds_omni.data.loader_world import World, join_world
from ds_omni.data.prefetch import Prefetcher, _Made


class AheadFeed(Prefetcher):
    """The step-ahead loop of the loader process: each step is pickled as it is made (on the
    thread, while the trainer trains; its tensors' bytes are written into the shared-memory slot
    only at its reply: `handover.py`), and nothing is pinned (no CUDA in this process)."""

    early = False
    """Whether the step being taken was asked for early (`LoaderProcess.next_step` asks for the
    next step as soon as it has one): it is then one of the `ahead` steps made while the
    trainer trains the step before it, so `data.prefetch_steps` keeps its meaning."""

    def _make(self) -> _Made:
        batch = self.loader.next_step()
        return _Made(encode(batch), self.loader._step_start, self.loader._position(),
                     self.loader.take_skipped())

    def _take(self) -> _Made:
        """A step made ahead, without waking the thread (`release` does, after the reply): it
        would take the GIL from the reply's pipe writes (the hand-over took 5-20 ms a step)."""
        with self._cond:
            if self._made:
                return self._made.popleft()
        return super()._take()

    def _ahead_now(self) -> int:
        """A step asked for early is itself one of the `ahead` made while a step trains."""
        return self.ahead - self.early

    def release(self) -> None:
        """Let the thread make steps up to `ahead` past the steps taken (the reply is out)."""
        with self._cond:
            limit = self.position["step"] + self._ahead_now()
            self._limit = max(self._limit, limit if self.until is None else min(limit, self.until))
            self._cond.notify_all()


def serve(parts, pack_workers: int, world: World | None, conn,
           cores: CorePlan, prefix: str) -> None:
    """The loader process: requests in, replies out, until told to stop or orphaned."""
    torch.set_num_threads(1)  # the trainer keeps the other cores
    pin_self(cores.loader)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; we follow it
    try:
        loader = parts.build(join_world(world), pack_workers, cores.pack_workers)
        server = Server(loader, world.timeout_s if world else 1800.0, Sender(prefix))
        reply = ("ok", loader._position())
    except Exception as e:
        server, reply = None, ("error", _failure(e))
    conn.send_bytes(pickle.dumps(reply))
    parent = mp.parent_process()
    watch = [conn] + ([parent.sentinel] if parent is not None else [])
    try:
        while server is not None:
            if conn not in mp.connection.wait(watch):  # the training process is gone
                break
            try:
                op, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if not server.answer(conn, op, args):
                break
    finally:  # closed, orphaned, or the trainer's end of the pipe broke mid-reply
        if server is not None:
            server.sender.close()
    os._exit(0)  # no interpreter shutdown: libraries' exit handlers (datasets sleeps 5 s)


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {e} (in loader process pid {os.getpid()}):\n" \
           f"{traceback.format_exc()}"


class Server:
    """Answers the trainer's requests with the loader and its step-ahead loop."""

    def __init__(self, loader: OmniLoader, timeout_s: float, sender: Sender):
        self.loader, self.timeout_s, self.sender = loader, timeout_s, sender
        self.feed = AheadFeed(loader, 0, timeout_s=timeout_s)

    def answer(self, conn, op: str, args: tuple) -> bool:
        """Reply to one request; False: stop serving."""
        try:
            if op == "next":  # args: (True,) when asked early (`LoaderProcess._ask_next_early`)
                self.feed.early = bool(args and args[0])
                encoded = self.feed.next_step()
                made = self.feed.taken
                # the request for this step has come: the trainer copied the last one out
                header = self.sender.send(encoded)
                conn.send_bytes(pickle.dumps(
                    ("batch", (sent_position(made), made.skipped, header)),
                    protocol=pickle.HIGHEST_PROTOCOL))
                self.feed.release()
                return True
            value = getattr(self, f"_{op}")(*args)
        except Exception as e:  # every failure goes back as a reply: the trainer says it
            value, op = _failure(e), "error"
        conn.send_bytes(pickle.dumps(("error" if op == "error" else "ok", value)))
        return op != "close"

    def _go_to(self, position: dict) -> None:
        """Stop making steps ahead and go to the trainer's `position` (its steps taken)."""
        self.feed.position = position
        self.feed.close()
        self.feed.taken = None

    def _state_dict(self, position: dict) -> dict:
        return self.loader.state_dict(position)

    def _load_state_dict(self, state: dict) -> dict:
        self.feed.close()
        self.loader.load_state_dict(state)
        return self._prefetch(self.loader._position(), self.feed.ahead, self.feed.until)

    def _set_weights(self, position: dict, weights: dict) -> dict:
        self._go_to(position)
        self.loader.set_weights(weights)
        return self.loader._position()

    def _restore(self, position: dict) -> dict:
        self._go_to(position)
        return self.loader._position()

    def _prefetch(self, position: dict, steps: int, until: int | None) -> dict:
        self._go_to(position)
        self.feed = AheadFeed(self.loader, steps, until=until, timeout_s=self.timeout_s)
        return self.feed.position

    def _counts(self):
        return self.loader.counts

    def _placement(self) -> dict:
        """Where this process and its pack workers run, as the kernel says."""
        pool = self.loader.batches.pool
        return {"loader": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                "pack_workers": [sorted(os.sched_getaffinity(p.pid)) for p in pool._procs]
                if pool is not None else []}

    def _load_samples(self, keys: list[str]) -> list:
        return self.loader.load_samples(keys)

    def _close(self, abort: bool) -> None:
        self.feed.close(abort=abort)
        self.loader.close()
        self.sender.close()


def sent_position(made: _Made) -> dict:
    """The loader's position after the step just made: what the trainer resumes from."""
    return made.after
