"""Checkpoints: DeepSpeed's engine state plus what ds_omni owns, and resuming from them.

Layout under `<output_dir>/checkpoints/`:

    latest                      tag of the newest complete checkpoint (written last, by DeepSpeed)
    model/                      HF config, tokenizer and processor: enough to export without the run
    step00000010/               DeepSpeed files (model, optimizer, LR schedule) for any ZeRO stage
        loader_state.json       the data position (JSON, versioned, global over ranks)
        rng_rank{r}.pt          RNG states of rank r: torch CPU and CUDA, numpy, Python `random`
                                (tensors and numbers only: loads with weights_only)
        trainer_state.json      step counter

DeepSpeed's own files are pickles that DeepSpeed reads; load only checkpoints you wrote.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from ds_omni.errors import LaunchError
from ds_omni.parallel.dist import barrier

CHECKPOINT_DIR = "checkpoints"
MODEL_META_DIR = "model"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def check_writable(directory: str | Path) -> None:
    """Fail at start-up, naming the path, if the output directory cannot be written."""
    p = Path(directory)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise LaunchError(f"output directory {str(p)!r} is not writable ({e.strerror or e}); set "
                          "train.output_dir to a directory you can write") from None


def save_model_meta(root: Path, built) -> None:
    """HF config + tokenizer + processor, so a checkpoint can be exported on its own."""
    meta = root / MODEL_META_DIR
    meta.mkdir(parents=True, exist_ok=True)
    built.hf_config.save_pretrained(str(meta))
    built.family.save_processor(meta, built.hf_config, built.tokenizer, built.model_dir)


def save(engine, output_dir: str | Path, step: int, loader_state: dict, rank: int) -> Path:
    """Write a complete checkpoint for `step`; every rank calls this."""
    root = checkpoint_root(output_dir)
    tag = tag_for(step)
    # DeepSpeed writes `latest` after its files; ds_omni's files go in first so that a checkpoint
    # named by `latest` is always whole.
    (root / tag).mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), root / tag / f"rng_rank{rank}.pt")
    if rank == 0:
        (root / tag / "loader_state.json").write_text(json.dumps(loader_state, indent=1))
        (root / tag / "trainer_state.json").write_text(json.dumps({"step": step}))
    barrier()
    engine.save_checkpoint(str(root), tag=tag)
    return root / tag


def latest_tag(output_dir: str | Path) -> str | None:
    latest = checkpoint_root(output_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def load(engine, output_dir: str | Path, rank: int) -> tuple[int, dict]:
    """Restore the newest checkpoint; returns (step, loader state)."""
    root = checkpoint_root(output_dir)
    tag = latest_tag(output_dir)
    if tag is None:
        raise LaunchError(f"--resume: no checkpoint in {str(root)!r} (no 'latest' file); start "
                          "without --resume or point train.output_dir at the earlier run")
    path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise LaunchError(f"--resume: DeepSpeed could not load checkpoint {str(root / tag)!r}")
    scheduler = engine.lr_scheduler
    if getattr(scheduler, "last_batch_iteration", -1) >= 0:  # the LR of the step that runs next
        scheduler.step(scheduler.last_batch_iteration)
    step = json.loads((root / tag / "trainer_state.json").read_text())["step"]
    loader_state = json.loads((root / tag / "loader_state.json").read_text())
    rng_file = root / tag / f"rng_rank{rank}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than wrote the checkpoint
        set_rng_state(torch.load(rng_file, weights_only=True))
    return step, loader_state


def rng_state() -> dict:
    """Every global generator a step may draw from (dropout, augmentation, user code): torch CPU
    and CUDA, numpy and Python `random`, as tensors and numbers, so it loads with weights_only."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # MT19937: 624 uint32 keys
    version, internal, gauss_next = random.getstate()  # 624 words + position
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
             "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved (a checkpoint from before numpy / Python were saved holds
    "torch" only; CUDA states are set for the devices both runs have)."""
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"],
                             s["has_gauss"], s["cached_gaussian"]))
    if "python" in state:
        s = state["python"]
        random.setstate((s["version"], tuple(s["state"].tolist()), s["gauss_next"]))
    if state.get("cuda") and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
