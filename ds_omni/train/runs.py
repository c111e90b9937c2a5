"""Which run a checkpoint belongs to, so that `--resume` never mixes two runs in one folder.

A run started without `--resume` takes a new id (written to `<output_dir>/run_id`);
every checkpoint it saves carries that id in its `trainer_state.json`, and `--resume` takes the
newest complete checkpoint of the folder's current run (the id of `run_id`, or of the checkpoint
`latest` names), passing over those of an earlier run that `train.overwrite_output_dir` replaced.
Checkpoints from before run ids carry none and belong to any run.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

RUN_FILE = "run_id"


def checkpoint_run(directory: Path) -> str | None:
    """The run id in a checkpoint directory's trainer_state.json (None: unreadable, or older)."""
    try:
        value = json.loads((directory / "trainer_state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value.get("run_id") if isinstance(value, dict) else None


def current_run(root: Path) -> str | None:
    """The run the checkpoints under `root` continue: `run_id`, else that of the checkpoint
    `latest` names, else None (any)."""
    path = root.parent / RUN_FILE
    if path.is_file():
        return path.read_text().strip() or None
    latest = root / "latest"
    return checkpoint_run(root / latest.read_text().strip()) if latest.is_file() else None


def same_run(run: str | None, directory: Path) -> str | None:
    """None if the checkpoint in `directory` belongs to `run`, else why not."""
    theirs = checkpoint_run(directory)
    if run is None or theirs is None or theirs == run:
        return None
    return (f"written by an earlier run in this folder (run {theirs}; the current run is {run}, "
            "started with train.overwrite_output_dir)")


def set_run(root: Path, run: str | None = None) -> str:
    """Make `run` (default: a new id) the current run of the checkpoints under `root` (in
    `root`'s parent, the output_dir); returns it. Rank 0 only."""
    run = run or uuid.uuid4().hex[:12]
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f"{RUN_FILE}.tmp"
    tmp.write_text(run)
    os.replace(tmp, root.parent / RUN_FILE)
    return run


def run_of(root: Path) -> str:
    """The current run's id for a checkpoint being saved (made if none was set)."""
    return current_run(root) or set_run(root)
