"""What every bad-input case shares: configs written to disk, `ds-omni` run in this process with
training itself stubbed out (the start-up checks decide: a case that gets past them reaches
`TRAINING_STARTED`), and a snapshot of a folder to show nothing was written where it must not be."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest

from ds_omni.cli import main
from tests.fixtures import ds_config, tiny_config_dict

TRAINING_STARTED = "training started: the start-up checks let this input through"


class TrainingStarted(Exception):
    pass


@pytest.fixture
def no_training(monkeypatch):
    """`ds-omni train` stops where the process group would start (nothing past preflight runs)."""
    from ds_omni.train import loop

    def stop(*args, **kwargs):
        raise TrainingStarted(TRAINING_STARTED)
    monkeypatch.setattr(loop.dist, "init_distributed", stop)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def config(out: Path, **train) -> dict:
    """The tiny LLaVA config (tests/fixtures.py) writing to `out`."""
    return copy.deepcopy(tiny_config_dict(str(out), **train))


def write(tmp_path: Path, cfg: dict, ds: dict | None = None) -> tuple[str, str]:
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds_config(2) if ds is None else ds))
    return str(c), str(d)


def train(capsys, cfg: str, ds: str, *extra: str) -> tuple[int | str, str]:
    """(exit status, or "started" when the checks let it through; stderr)."""
    try:
        code = main(["train", "--config", cfg, "--deepspeed", ds, *extra])
    except TrainingStarted:
        return "started", capsys.readouterr().err
    return code, capsys.readouterr().err


def refused(capsys, cfg: str, ds: str, *extra: str) -> str:
    """stderr of a start that must be refused: exit 2, one line, no traceback."""
    code, err = train(capsys, cfg, ds, *extra)
    assert code == 2, f"expected a refusal, got {code}: {err}"
    assert err.startswith("ds-omni: error: ") and "Traceback" not in err, err
    return err


def says(text: str, *words: str) -> None:
    missing = [w for w in words if w not in text]
    assert not missing, f"{missing} not in: {text}"


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `folder` (empty if it does not exist)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
