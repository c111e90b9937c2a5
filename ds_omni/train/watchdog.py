"""Peer watchdog: a rank that dies, stops or hangs ends the whole job within `train.peer_timeout_s`.

Without it the survivors wait in their next collective for the process group's timeout (30
minutes), or forever on a stopped rank. Each rank runs a daemon thread that every `interval`
samples its main thread's stack (inside a collective? where?), publishes a heartbeat to the
rendezvous store, and reads the heartbeats of the next `WATCHED_PEERS` ranks of a ring and the
abort key. Verdicts (`judge`, pure): silent (killed, stopped, host lost), hung (busy outside any
collective while this rank waits for it), failed (its training raised), store (the store does not
answer). The first verdict goes into the abort key; every rank prints it and exits with
`EXIT_PEER_FAILURE`; a culprit stopped on this host is killed. The training path pays one
attribute write a step; solo phases (saves, export) run under `watchdog.solo()`.
More: docs/fault_tolerance.md.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from ds_omni.parallel.dist import peer_gone

EXIT_PEER_FAILURE = 3
WATCHED_PEERS = 4
ABORT_KEY = "abort"
# a main-thread frame in one of these files means the rank is waiting in a collective
COLLECTIVE_FILES = ("torch/distributed/", "deepspeed/comm/", "ds_omni/parallel/")


@dataclass
class Beat:
    """One heartbeat: what a rank publishes about itself."""

    seq: int
    step: int = -1  # the training step its main thread is in (-1: not in the loop yet)
    waiting: bool = False  # its main thread is inside a collective
    solo: bool = False  # a phase where it may work alone while others wait (save, export)
    where: str = ""  # the innermost frames of its main thread
    state: str = "running"  # running | closed (finished) | failed
    note: str = ""  # the error, when failed
    host: str = ""
    pid: int = 0

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def loads(text: bytes | str) -> "Beat":
        return Beat(**json.loads(text))

    @property
    def busy(self) -> bool:
        return self.state == "running" and self.step >= 0 and not self.waiting and not self.solo

    @property
    def blocked(self) -> bool:
        return self.state == "running" and self.step >= 0 and self.waiting and not self.solo


@dataclass
class PeerView:
    """What one watcher has seen of one rank, in the watcher's monotonic clock."""

    changed_at: float  # when its heartbeat last moved
    beat: Beat | None = None
    busy_since: float | None = None  # busy at one place of one step since
    blocked_since: float | None = None  # waiting in a collective at one place of one step since
    failed_since: float | None = None

    def update(self, beat: Beat | None, now: float) -> None:
        if beat is None:  # not published yet: silence counts from the watcher's start
            return
        prev = self.beat
        if prev is None or beat.seq != prev.seq:
            self.changed_at = now
        same = prev is not None and (prev.step, prev.where) == (beat.step, beat.where)
        self.busy_since = _since(self.busy_since, beat.busy, same and prev.busy, now)
        self.blocked_since = _since(self.blocked_since, beat.blocked, same and prev.blocked, now)
        failed = beat.state == "failed"
        self.failed_since = (now if self.failed_since is None else self.failed_since) if failed \
            else None
        self.beat = beat


def _since(start: float | None, now_true: bool, was_true_here: bool, now: float) -> float | None:
    if not now_true:
        return None
    return start if was_true_here and start is not None else now


def judge(now: float, timeout: float, me: PeerView, peers: dict[int, PeerView],
          store_lost_since: float | None, grace: float) -> tuple[int | None, str] | None:
    """(culprit rank or None, why) once something is wrong for long enough, else None."""
    if store_lost_since is not None and now - store_lost_since >= timeout:
        return None, (f"the rendezvous store has not answered for {now - store_lost_since:.0f} s: "
                      f"the process hosting it ({_store_host()}) died, stopped or hangs")
    for rank, view in sorted(peers.items()):
        beat = view.beat
        if beat is not None and beat.state == "closed":
            continue
        if view.failed_since is not None and now - view.failed_since >= grace:
            return rank, f"rank {rank} failed ({beat.note}); its log has the details"
        silent = now - view.changed_at
        if silent >= timeout:
            return rank, (f"rank {rank} sent no heartbeat for {silent:.0f} s (killed, crashed, "
                          "stopped by SIGSTOP, or its node was lost)")
        if view.busy_since is not None and me.blocked_since is not None:
            stuck = min(now - view.busy_since, now - me.blocked_since)
            if stuck >= timeout:
                return rank, (f"rank {rank} is hung: for {stuck:.0f} s at step {beat.step} it has "
                              f"been busy outside any collective at {beat.where}, while this rank "
                              "waits for it in one")
    return None


def _store_host() -> str:
    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"torchrun's agent at {address}"
    return f"rank 0 at {address}, which hosts it under this launcher"


def watched_peers(rank: int, world: int, count: int = WATCHED_PEERS) -> list[int]:
    """The next `count` ranks of a ring: every rank is watched by `count` others."""
    return [(rank + k) % world for k in range(1, min(world, count + 1))]


def main_thread_place(frames=None, depth: int = 3) -> tuple[bool, str]:
    """(is the main thread inside a collective, its innermost `depth` frames as text)."""
    frames = sys._current_frames() if frames is None else frames
    frame = frames.get(threading.main_thread().ident)
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    waiting = any(c in f.f_code.co_filename.replace(os.sep, "/") for f in stack
                  for c in COLLECTIVE_FILES)
    where = " <- ".join(f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"
                        for f in stack[:depth])
    return waiting, where


def local_state(beat: Beat | None) -> str:
    """What this host can see of a rank's process: '' unless it runs here."""
    if beat is None or beat.host != socket.gethostname() or not beat.pid:
        return ""
    try:
        stat = Path(f"/proc/{beat.pid}/stat").read_text()
    except OSError:
        return f"pid {beat.pid} on this host has exited"
    state = stat.rsplit(")", 1)[1].split()[0]
    if state in ("Z", "X"):  # a zombie: dead, not yet reaped by its launcher
        return f"pid {beat.pid} on this host has exited"
    if state in ("T", "t"):
        return f"pid {beat.pid} on this host is stopped (SIGSTOP or a debugger)"
    return f"pid {beat.pid} on this host is still running"


class Watchdog:
    """The heartbeat thread of one rank. `Watchdog.start(...)` or None when there is no peer."""

    def __init__(self, rank: int, world: int, timeout_s: float, store, on_verdict=None,
                 interval_s: float | None = None, now: float | None = None):
        self.rank, self.world, self.timeout = rank, world, timeout_s
        self.interval = interval_s or min(5.0, timeout_s / 6)
        self.store = store
        self.on_verdict = on_verdict or _exit
        self.step = -1
        self._solo = 0
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds-omni-watchdog", daemon=True)
        self._io: threading.Thread | None = None  # a store exchange that has not come back
        self._signals = None  # (wake-up pipe, previous handler, previous wake-up fd)
        self._ending = threading.Lock()
        start = time.monotonic() if now is None else now
        self.me = PeerView(changed_at=start)
        self.peers = {r: PeerView(changed_at=start) for r in watched_peers(rank, world)}
        self.store_lost_since: float | None = None
        self.verdict: str | None = None

    @classmethod
    def start(cls, rank: int, world: int, timeout_s: float, on_verdict=None) -> "Watchdog | None":
        """Call from the main thread, after the process group exists."""
        if world < 2 or not timeout_s:
            return None
        dog = cls(rank, world, timeout_s, _connect(timeout_s), on_verdict)
        dog._publish(dog._beat())
        dog.await_peers()
        dog._catch_sigterm()
        dog._thread.start()
        return dog

    def await_peers(self) -> None:
        """Read the watched ranks' first beats before training starts (at most the timeout), so
        that each peer's pid and host are known even if it stops before this thread's first
        tick: a stopped rank 0 also stops the store it hosts, and a peer never read is named
        without its state (`local_state`)."""
        keys = [f"beat/{r}" for r in self.peers]
        wait = timedelta(seconds=self.timeout)
        try:
            self._with_deadline(lambda: self.store.wait(keys, wait), deadline_s=self.timeout,
                                once=True)
            self._read_peers_once_more()
        except Exception:  # not all came within the timeout: the ticks judge the silence
            return

    @contextmanager
    def solo(self):
        """A phase where this rank may work while the others wait for it (save, export)."""
        self._solo += 1
        try:
            yield
        finally:
            self._solo -= 1

    def close(self, failed: str | None = None) -> None:
        """Stop watching; tell the peers this rank finished (or failed, with why)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 2)
        self._release_sigterm()
        beat = self._beat()
        beat.state, beat.note = ("failed", failed[:500]) if failed else ("closed", "")
        try:
            self._with_deadline(lambda: self._publish(beat))
        except Exception:  # the store may be gone with its host: nothing left to tell
            pass

    def _beat(self) -> Beat:
        waiting, where = main_thread_place()
        self._seq += 1
        return Beat(seq=self._seq, step=self.step, waiting=waiting, solo=self._solo > 0,
                    where=where, host=socket.gethostname(), pid=os.getpid())

    def _publish(self, beat: Beat) -> None:
        self.store.set(f"beat/{self.rank}", beat.dumps())

    def _run(self) -> None:
        while not self._wait():
            found = self.tick(time.monotonic())
            if found is not None and not self._stop.is_set():
                self._end(*found)
                return

    def tick(self, now: float) -> tuple[int | None, str] | None:
        """One round: publish, read the peers and the abort key, judge."""
        beat = self._beat()
        self.me.update(beat, now)
        try:
            aborted, texts = self._with_deadline(lambda: self._exchange(beat))
            if aborted:
                return None, aborted
            for rank, text in zip(self.peers, texts):
                self.peers[rank].update(Beat.loads(text) if text else None, now)
            self.store_lost_since = None
        except Exception:  # no answer in time, or a closed connection: its host is in trouble
            if self.store_lost_since is None:
                self.store_lost_since = now
        return judge(now, self.timeout, self.me, self.peers, self.store_lost_since,
                     grace=2 * self.interval)

    def _exchange(self, beat: Beat) -> tuple[str | None, list[bytes | None]]:
        """Publish this rank's beat; read the abort key and the watched ranks' beats."""
        self._publish(beat)
        if self.store.check([ABORT_KEY]):
            return self.store.get(ABORT_KEY).decode(), []
        return None, self._read_peers()

    def _read_peers(self) -> list[bytes | None]:
        """The watched ranks' last published beats (None: not published yet)."""
        keys = [f"beat/{r}" for r in self.peers]
        present = [k for k in keys if self.store.check([k])]
        values = dict(zip(present, self.store.multi_get(present))) if present else {}
        return [values.get(k) for k in keys]

    def _with_deadline(self, fn, deadline_s: float | None = None, once: bool = False):
        """fn() on a helper thread, given up after `interval` seconds (or `deadline_s`): a
        TCPStore client whose server is stopped blocks in recv() for ever, whatever its timeout
        says. A request of the ticks is refused while an earlier one hangs; a `once` request (the
        SIGTERM path, which may run while a tick's request is in flight) is not."""
        if not once and self._io is not None and self._io.is_alive():
            raise TimeoutError("an earlier store request has not come back")
        box = {}

        def call():
            try:
                box["value"] = fn()
            except BaseException as e:
                box["error"] = e
        io = threading.Thread(target=call, name="ds-omni-watchdog-io", daemon=True)
        if not once:
            self._io = io
        io.start()
        io.join(deadline_s or max(self.interval, 1.0))
        if io.is_alive():
            raise TimeoutError("the store did not answer")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _catch_sigterm(self) -> None:
        """A launcher ends the other ranks with SIGTERM when one rank dies: this thread wakes up
        (through the signal's wake-up fd, whatever the main thread is blocked in), says which
        peer is gone and ends the rank, instead of dying silently."""
        if threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._signals = (read, write, previous, signal.set_wakeup_fd(write))

    def _on_sigterm(self, *_) -> None:
        """The main thread's part, when it runs Python before the watchdog thread gets to it."""
        self._terminated()

    def _terminated(self) -> None:
        """Say which watched rank is gone (once, whichever thread comes first) and end."""
        if not self._ending.acquire(blocking=False):
            return
        self._read_peers_once_more()
        why = self.diagnose() or "no watched rank looked dead"
        print(f"ds-omni: rank {self.rank}: terminated (SIGTERM: a launcher sends it when "
              f"another rank has ended); {why}", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    def _read_peers_once_more(self) -> None:
        """Before naming the peer that is gone: its last beat from the store. A launcher ends
        the survivors as soon as it sees a rank die, which can be before this thread's first
        read (a rank that dies within one interval of the start); the store outlives the dead
        rank (torchrun's agent hosts it, or rank 0 when rank 0 is not the one gone). At most one
        second: a launcher kills what has not exited a few seconds after its SIGTERM."""
        try:
            texts = self._with_deadline(self._read_peers, deadline_s=1.0, once=True)
        except Exception:  # the store went with its host: diagnose from what was seen
            return
        now = time.monotonic()
        for rank, text in zip(self.peers, texts):
            if text:
                self.peers[rank].update(Beat.loads(text), now)

    def _release_sigterm(self) -> None:
        if self._signals is None:
            return
        read, write, previous, wakeup = self._signals
        self._signals = None
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGTERM, previous)
        os.close(read)
        os.close(write)

    def _wait(self) -> bool:
        """Sleep one interval (True: stop); ends the rank on a SIGTERM."""
        if self._signals is None:
            return self._stop.wait(self.interval)
        ready, _, _ = select.select([self._signals[0]], [], [], self.interval)
        if ready and signal.SIGTERM in os.read(self._signals[0], 64):
            self._terminated()
        return self._stop.is_set()

    def diagnose(self) -> str | None:
        """After a collective failed on this rank: which watched peer is gone or stopped (as this
        host sees it), or whose heartbeat stopped; None if all look alive."""
        now = time.monotonic()
        for rank, view in sorted(self.peers.items()):
            if view.beat is not None and view.beat.state != "running":
                continue  # finished, or failed with its own message
            seen = local_state(view.beat)
            if "exited" in seen or "stopped" in seen:
                return f"rank {rank} is gone: {seen}"
            if now - view.changed_at > 2 * self.interval and not seen:
                return f"rank {rank} has sent no heartbeat for {now - view.changed_at:.0f} s"
        return None

    def explain(self, error: BaseException, poll_s: float = 0.02) -> str | None:
        """After this rank's training raised `error`: which watched peer's end explains it.
        Two gaps would hide a peer killed mid-collective, so when the error says a connection
        closed this first reads the peers' beats once more (the peer may have died before this
        thread's first read, as under SIGTERM), then looks again until one is seen gone, for
        at most one interval: the kernel closes a dying process's sockets before the process
        becomes a zombie, and on a loaded host the collective's error can come in between.
        (A peer on another host shows nothing here: its heartbeat has to stop.)"""
        if not peer_gone(error):
            return self.diagnose()
        self._read_peers_once_more()
        cause = self.diagnose()
        deadline = time.monotonic() + self.interval
        while cause is None and time.monotonic() < deadline:
            time.sleep(poll_s)
            cause = self.diagnose()
        return cause

    def _end(self, culprit: int | None, why: str) -> None:
        """Say why (before anything that may block or make the launcher end this rank), stop a
        culprit stopped on this host, record the verdict for the others, then `on_verdict`."""
        view = self.peers.get(culprit)
        seen = local_state(view.beat) if view is not None else ""
        kill = "stopped" in seen
        if seen:
            why += f"; {seen}" + (", killing it so that the launcher can end the job"
                                  if kill else "")
        self.verdict = f"rank {self.rank}: {why}"
        print(f"ds-omni: watchdog: {self.verdict}\nds-omni: watchdog: ending rank {self.rank} "
              f"(exit {EXIT_PEER_FAILURE}); `ds-omni supervise` restarts a run from its last "
              "checkpoint", file=sys.stderr, flush=True)
        if kill:
            try:
                os.kill(view.beat.pid, signal.SIGKILL)  # a launcher's SIGTERM waits for SIGCONT
            except OSError:
                pass
        if self.store_lost_since is None:
            try:  # the first verdict is the job's: the others read it instead of their own
                self._with_deadline(lambda: self.store.compare_set(ABORT_KEY, "", why))
            except Exception:
                pass
        self.on_verdict(self.verdict)


def _exit(verdict: str) -> None:
    sys.stdout.flush()
    os._exit(EXIT_PEER_FAILURE)


def _connect(timeout_s: float):
    """A TCPStore client of its own on the launcher's rendezvous address, with a short timeout
    (the process group's client waits up to its full timeout), under a prefix of this attempt."""
    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=max(2.0, min(10.0, timeout_s / 4))))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ds_omni_watchdog/{attempt}/", store)
