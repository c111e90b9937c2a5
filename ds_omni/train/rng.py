"""The global random generators a training step may draw from, saved into and restored from
checkpoints (`checkpoint.save` / `checkpoint.load`)."""

from __future__ import annotations

import random

import numpy as np
import torch


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
