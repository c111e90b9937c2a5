"""The coverage sweep's rows that need torchvision, run in one child process.

Many of transformers' image processors (and all its video processors) exist only as torchvision
classes, and PyPI's torchvision wheel is a CUDA build whose compiled ops do not load next to a CPU
torch. `make setup` installs its Python side outside the venv's import path (`torchvision-py`):
an ordinary process must never see it, or transformers would take torchvision for available and
fail at import. The sweep hands the types that need it to one child process
(`python -m ds_omni.coverage.child`) that puts the folder on its sys.path, defines the two op
schemas (`torchvision::nms`, `qnms`) when the compiled ops do not load, and answers with one JSON
line per type. A normally installed torchvision is used in the sweep's own process; without
either, the rows say why they are not checked. This module is the sweep's side: where that
folder lies, why a row goes without it, and the child's handle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "DS_OMNI_TORCHVISION"
"""Overrides where torchvision's Python side lies (default: `torchvision-py` in the venv)."""
CHILD = "ds_omni.coverage.child"
"""The child's module (`python -m`): it imports the sweep, which imports this module."""
TIMEOUT_S = 480
"""How long the sweep waits for the child once its own rows are done (pytest stops at 600)."""


def wanted_dir() -> Path:
    """Where torchvision's Python side is looked for: $DS_OMNI_TORCHVISION, else `torchvision-py`
    in the venv (where `make setup` installs it)."""
    return Path(os.environ.get(ENV) or Path(sys.prefix) / "torchvision-py")


def torchvision_dir() -> Path | None:
    """`wanted_dir()` when torchvision's Python side is there, else None."""
    path = wanted_dir()
    return path if (path / "torchvision" / "__init__.py").is_file() else None


def importable_here() -> bool:
    """Whether this process imports a normally installed torchvision (then no child is needed)."""
    from transformers.utils import is_torchvision_available
    return is_torchvision_available()


def missing_reason(error: str) -> str:
    """A row's reason when its recipe needs torchvision and neither way to it is at hand."""
    return (f"its recipe needs torchvision ({error.split('. ')[0].strip('.')}), and the PyPI "
            "torchvision wheel (a CUDA build) does not load next to a CPU torch unless its Python "
            f"side is in {wanted_dir()} (make setup puts it in the venv's torchvision-py; {ENV} "
            "names another folder)")


def needs_torchvision(error: BaseException) -> bool:
    """Whether `error` is an HF class saying it requires torchvision (its placeholder's
    ImportError)."""
    return isinstance(error, ImportError) and "torchvision" in str(error).lower()


# ------------------------------------------------------------------------------ parent side
class Child:
    """The sweep's one child process: takes model types as the sweep meets them (stdin, one a
    line) and answers once it is told there are no more."""

    def __init__(self, path: Path):
        self.sent: list[str] = []
        self.log = tempfile.TemporaryFile("w+")
        package_root = str(Path(__file__).resolve().parents[2])  # the ds_omni this process runs
        paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {**os.environ, ENV: str(path), "PYTHONPATH": os.pathsep.join(paths)}
        self.proc = subprocess.Popen([sys.executable, "-m", CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)

    def send(self, model_type: str) -> None:
        self.sent.append(model_type)
        self.proc.stdin.write(model_type + "\n")
        self.proc.stdin.flush()

    def results(self, timeout: float = TIMEOUT_S) -> dict[str, dict]:
        """{model_type: {"supported", "reason"}} for every type sent; a type the child did not
        answer (it failed or ran out of time) says so, with the end of the child's log."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            why = f"timed out after {timeout:.0f} s"
        else:
            why = f"exited with code {self.proc.returncode}"
        answers = parse_answers(out)
        self.log.seek(0)
        tail = " | ".join(self.log.read().strip().splitlines()[-3:])[-300:]
        self.log.close()
        failed = {"supported": False, "reason": f"the torchvision child process {why} before "
                                                f"checking it ({tail})"}
        return {t: answers.get(t, failed) for t in self.sent}


def parse_answers(out: str) -> dict[str, dict]:
    """The child's JSON lines merged (a line that is not JSON, a library's print, is skipped)."""
    answers = {}
    for line in out.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        answers.update(value if isinstance(value, dict) else {})
    return answers
