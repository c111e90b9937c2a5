"""The sweep's torchvision child process (`python -m ds_omni.coverage.child`; started by
`torchvision_rows.Child`, which says why): it imports torchvision from its Python side, defining
the two op schemas its fake kernels need when the compiled ops do not load, then checks each model
type read from stdin with the sweep's own `classify` and answers with one JSON line per type."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ds_omni.coverage.torchvision_rows import ENV

STUBBED_OPS = ("nms", "qnms")
"""The ops `torchvision/_meta_registrations.py` registers fake kernels for unconditionally."""
NMS_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def import_torchvision(path: Path) -> bool:
    """Import torchvision from `path` (before transformers looks for it); True when its compiled
    ops did not load and the two op schemas its fake kernels need were defined here instead."""
    import torch
    sys.path.insert(0, str(path))
    try:
        torch.ops.load_library(str(next((path / "torchvision").glob("_C*.so"))))
        stubbed = False
    except (StopIteration, OSError, RuntimeError):
        for op in STUBBED_OPS:
            torch.library.define(f"torchvision::{op}", NMS_SCHEMA)
        stubbed = True
    import torchvision  # noqa: F401
    return stubbed


def torchvision_note(model_type: str) -> str:
    """What a row checked here adds to its reason: which of the recipe's HF processor parts are
    torchvision classes, run (or only built) with torchvision's Python side."""
    from ds_omni.coverage.recipes import RECIPES
    _, processor = RECIPES[model_type]()
    tv = [name for name in ("image_processor", "video_processor")
          if any(c.__name__ == "TorchvisionBackend"
                 for c in type(getattr(processor, name, None)).__mro__)]
    if "image_processor" in tv:
        note = "HF's torchvision image processor run with torchvision's Python transforms"
        return note + (", its video processor built with them" if len(tv) == 2 else "")
    if tv:
        return ("HF's torchvision video processor (its processor reads its settings) built with "
                "torchvision's Python side")
    return "run with torchvision's Python side"


def main() -> None:
    """Answer the parent: one JSON line {model_type: {"supported", "reason"}} per type read."""
    stubbed = import_torchvision(Path(os.environ[ENV]))
    answer = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints would corrupt the answers
    from ds_omni.coverage.sweep import classify
    import torch
    torch.set_num_threads(1)  # as the sweep (sweep.sweep says why)
    with tempfile.TemporaryDirectory() as tmp:
        for line in sys.stdin:
            model_type = line.strip()
            result = classify(model_type, Path(tmp))
            if result.supported and stubbed:
                result.reason = f"{result.reason[:-1]}; {torchvision_note(model_type)})"
            answer.write(json.dumps({model_type: result.as_dict()}) + "\n")
            answer.flush()


if __name__ == "__main__":
    main()
