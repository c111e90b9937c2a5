"""`ds-omni supervise`: run a training command again after a failure, from its newest complete
checkpoint, with a back-off, until it succeeds or `max_restarts` restarts are spent.

    ds-omni supervise --max-restarts 5 --backoff 30 -- \\
        deepspeed --num_gpus 8 --module ds_omni train --config my.json --deepspeed zero2.json

Each attempt runs in a process group of its own; when its launcher returns, whatever is left of
the group (a rank the launcher could not reap) is killed, so the next attempt starts clean.
A restart adds `--resume` when a complete checkpoint exists (`checkpoint.newest_complete`, the
same choice `--resume` makes); without one the command runs again from the start. The cause of
each failure (the watchdog's verdict, the error ds-omni printed, or the last line of a traceback)
goes to stderr and, with the checkpoint it resumes from, to `<output_dir>/restarts.jsonl`.
An error ds-omni itself reports (`ds-omni: error:`: bad config, bad data, a non-finite loss
under on_nonfinite="stop") is not retried: it would fail again in the same place.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ds_omni.train import checkpoint

RESTARTS_FILE = "restarts.jsonl"
MAX_BACKOFF_S = 600.0
_CAUSE_PATTERNS = (re.compile(r"ds-omni: watchdog: (.*)"), re.compile(r"ds-omni: (rank \d+: .*)"),
                   re.compile(r"ds-omni: error: (.*)"))
_TRACEBACK_LAST = re.compile(r"^(\w+(\.\w+)*(Error|Exception|Interrupt)\b.*)")


@dataclass
class Attempt:
    returncode: int
    tail: list[str]  # the last lines of its output
    # the first lines of the whole output that say why ("ds-omni: ..."): a launcher's and the
    # other ranks' teardown can print more than the tail holds after them
    telling: list[str] = field(default_factory=list)

    @property
    def cause(self) -> str:
        return failure_cause([*self.telling, *self.tail], self.returncode)

    @property
    def retryable(self) -> bool:
        """A failure ds-omni diagnosed as the input's fault is not (see the module docstring);
        one that a watchdog or a dead peer explains is, even when ranks printed errors too."""
        lines = "\n".join([*self.telling, *self.tail])
        return "ds-omni: error:" not in lines or "ds-omni: watchdog:" in lines


def failure_cause(lines: list[str], returncode: int) -> str:
    """The most telling line of a failed attempt's output."""
    for pattern in _CAUSE_PATTERNS:
        found = [m.group(1) for line in lines if (m := pattern.search(line))]
        if found:
            return found[0]
    for line in reversed(lines):
        if m := _TRACEBACK_LAST.match(line.strip()):
            return m.group(1)
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def backoff_s(base: float, restart: int) -> float:
    """Seconds before restart number `restart` (1, 2, ...): base, 2 x base, 4 x base, ..."""
    return min(MAX_BACKOFF_S, base * 2 ** (restart - 1)) if base > 0 else 0.0


def resume_command(command: list[str], output_dir: str | Path) -> tuple[list[str], str | None]:
    """(the command of a restart, the checkpoint it resumes from or None: from the start)."""
    tag, _ = checkpoint.newest_complete(checkpoint.checkpoint_root(output_dir))
    if tag is None or "--resume" in command:
        return list(command), tag
    return [*command, "--resume"], tag


def output_dir_of(command: list[str]) -> str:
    """`train.output_dir` of a `ds-omni train` command (its --config and --set arguments)."""
    from ds_omni.config import load_config
    from ds_omni.errors import ConfigError
    config, sets = None, []
    for i, arg in enumerate(command[:-1]):
        if arg == "--config":
            config = command[i + 1]
        elif arg == "--set":
            sets.append(command[i + 1])
    if config is None:
        raise ConfigError("ds-omni supervise: the command has no --config, so its checkpoints "
                          "cannot be found; pass --output-dir (the run's train.output_dir)")
    return load_config(config, sets).train.output_dir


def is_telling(line: str) -> bool:
    return any(pattern.search(line) for pattern in _CAUSE_PATTERNS)


def run_attempt(command: list[str], tail_lines: int = 60, telling_lines: int = 20) -> Attempt:
    """Run `command` in a new process group, passing its output through; kill what is left of the
    group when it returns."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, errors="replace", bufsize=1)
    tail: deque[str] = deque(maxlen=tail_lines)
    telling: list[str] = []
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
            if len(telling) < telling_lines and is_telling(line):
                telling.append(line.rstrip("\n"))
        proc.wait()
    except BaseException:  # the supervisor is told to stop: the run stops too, gently first
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        raise
    finally:
        _signal_group(proc.pid, signal.SIGKILL)
    return Attempt(proc.returncode, list(tail), telling)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:  # nothing left
        pass


def supervise(command: list[str], output_dir: str | Path, max_restarts: int, backoff: float,
              run=run_attempt, sleep=time.sleep) -> int:
    """Run `command` until it succeeds; returns the exit status to end with."""
    log = Path(output_dir) / RESTARTS_FILE
    attempt = run(command)
    restarts = 0
    while attempt.returncode != 0:
        cause = attempt.cause
        if not attempt.retryable:
            _say("not restarting: the command failed with an error a restart would repeat: "
                 + cause)
            return attempt.returncode
        if restarts >= max_restarts:
            _say(f"giving up after {restarts} restart(s) (--max-restarts {max_restarts}); "
                 f"last failure: {cause}")
            return attempt.returncode
        restarts += 1
        wait = backoff_s(backoff, restarts)
        again, tag = resume_command(command, output_dir)
        where = f"from checkpoint {tag}" if tag else "from the start (no complete checkpoint)"
        _say(f"restart {restarts}/{max_restarts} in {wait:.0f} s, {where}; the command failed "
             f"(exit {attempt.returncode}): {cause}")
        _record(log, {"time": time.time(), "restart": restarts, "returncode": attempt.returncode,
                      "cause": cause, "resume_from": tag})
        sleep(wait)
        attempt = run(again)
    if restarts:
        _say(f"the command succeeded after {restarts} restart(s)")
    return 0


def _say(message: str) -> None:
    print(f"ds-omni supervise: {message}", file=sys.stderr, flush=True)


def _record(path: Path, entry: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
