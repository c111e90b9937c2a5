"""A tensor-parallel checkpoint (parallel.tp > 1) made whole again, for the HF export.

Each TP rank's DeepSpeed model states (`mp_rank_XX_model_states.pt`, XX its TP rank) hold its
shards of the backbone's split projections and a whole copy of everything else. DeepSpeed's
`zero_to_fp32` reads one model-parallel rank only, so ds_omni writes at training time which
parameters are split, along which dim and into which sizes (`tp_layout.json` in the checkpoint's
model/ directory; AutoTP's split can be uneven: with fewer KV heads than TP ranks some ranks hold
zero-width attention shards) and concatenates the ranks' shards here. The weights are the ones
the model states hold: fp32 under fp32 training (the parity tests' case), the 16-bit copies
under bf16 (the fp32 master copy stays in the optimizer shards, as for a pipeline checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ds_omni.errors import ModelError

TP_LAYOUT = "tp_layout.json"


def save_tp_layout(meta_dir: Path, layout: dict[str, dict]) -> None:
    """{parameter name: {"dim": split dim, "sizes": [each TP rank's width]}}."""
    (meta_dir / TP_LAYOUT).write_text(json.dumps(layout, indent=1))


def tp_layout_of(meta_dir: Path) -> dict[str, dict] | None:
    """The checkpoint's TP layout (None: not tensor-parallel)."""
    path = meta_dir / TP_LAYOUT
    return json.loads(path.read_text()) if path.is_file() else None


def merge_tp_states(directory: Path, layout: dict[str, dict]) -> dict[str, torch.Tensor]:
    """The whole model state of a TP checkpoint directory: every TP rank's model states, split
    parameters concatenated along their dim in TP-rank order, the rest from TP rank 0."""
    tp = tp_degree(layout)
    files = [directory / f"mp_rank_{r:02d}_model_states.pt" for r in range(tp)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelError(f"the tensor-parallel checkpoint {str(directory)!r} (tp={tp}) lacks "
                         f"{missing}; was it copied whole?")
    states = [torch.load(f, map_location="cpu", weights_only=True)["module"] for f in files]
    return merge_tp(states, layout, directory)


def tp_degree(layout: dict[str, dict]) -> int:
    return len(next(iter(layout.values()))["sizes"])


def merge_tp(states: list[dict], layout: dict[str, dict], where: Path) -> dict[str, torch.Tensor]:
    """One state from each TP rank's `states` (same keys): the split parameters of `layout`
    concatenated along their dim in TP-rank order, the rest from TP rank 0."""
    out = dict(states[0])
    for name, split in layout.items():
        parts = [s[name] for s in states]
        widths = [p.shape[split["dim"]] for p in parts]
        if widths != split["sizes"]:
            raise ModelError(f"{name}: the TP shards of {str(where)!r} are {widths} wide, "
                             f"its tp_layout.json says {split['sizes']}")
        out[name] = torch.cat(parts, dim=split["dim"])
    return out
