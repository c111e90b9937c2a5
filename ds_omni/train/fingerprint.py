"""What a checkpoint must match to be resumed: the run that wrote it, in a few facts.

`trainer_state.json` keeps `run_fingerprint` of the engine that saved; `--resume` compares it
with its own engine before DeepSpeed reads a byte, so another model, ZeRO stage or
tensor/expert-parallel degree is said in words (what differs, what to do), never found as a
shape error deep inside DeepSpeed's loading.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from ds_omni.errors import LaunchError


def run_fingerprint(engine) -> dict:
    """What a checkpoint must match to be resumed by `engine`: the model family, every
    parameter's name and shape (ZeRO-3's full shape), the ZeRO stage, how many ranks wrote
    DeepSpeed's shards, and the backbone's tensor- and expert-parallel degrees."""
    module = engine.module
    whole = getattr(module, "whole_model_shapes", None)  # a pipeline stage: the whole pipeline's
    tp, ep = model_parallel_degrees(module)
    return {"family": getattr(getattr(module, "family", None), "name", None),
            "params": whole() if whole else {n: list(getattr(p, "ds_shape", p.shape))
                                             for n, p in module.named_parameters()},
            "zero_stage": engine.zero_optimization_stage(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "tp": tp, "ep": ep}


def model_parallel_degrees(module) -> tuple[int, int]:
    """(tp, ep) a built model runs at, read from the layers DeepSpeed put in: an AutoTP layer's
    group size, an AutoEP layer's `ep_size` (1 and 1 without them). A model with such layers has
    imported their modules: if they are not imported, there are none (and DeepSpeed, which logs
    to stdout when imported, is not imported for nothing)."""
    layers = sys.modules.get("deepspeed.module_inject.layers")
    moe = sys.modules.get("deepspeed.module_inject.auto_ep_layer")
    tp = next((m.tp_world_size for m in module.modules()
               if isinstance(m, layers.TensorParallel_Layer)), 1) if layers else 1
    ep = next((m.ep_size for m in module.modules()
               if isinstance(m, moe.AutoEPMoELayer)), 1) if moe else 1
    return int(tp), int(ep)


RESTART_FROM_HF = (
    "To go on at another degree, export the checkpoint to HF's layout (`ds-omni convert "
    "--checkpoint {root} --out DIR`: the shards and experts are joined) and start a new run "
    "from it (model.pretrained DIR) at the new degree; the weights carry over, the optimizer "
    "state and the data position do not (set train.output_dir to a new directory)")


def check_model_parallel(saved: dict | None, now: dict, directory: Path) -> None:
    """A checkpoint resumes at the tp and ep that wrote it: their parameters are cut for them
    (AutoTP shards of another width, AutoEP experts of another count per rank)."""
    if not saved:
        return
    for key in ("tp", "ep"):
        before, after = saved.get(key, 1), now[key]
        if before != after:
            raise LaunchError(
                f"--resume: checkpoint {str(directory)!r} was written at parallel.{key}="
                f"{before}, this run has parallel.{key}={after}; resume with parallel.{key}="
                f"{before}. " + RESTART_FROM_HF.format(root=directory.parent))


def fingerprint_differences(saved: dict | None, now: dict, shown: int = 3) -> list[str]:
    """What differs between the run that wrote a checkpoint and this one, in words (empty: it
    may be resumed). A checkpoint from before fingerprints (`saved` None) is not checked."""
    if not saved:
        return []
    out = []
    if saved["family"] != now["family"]:
        out.append(f"model family {saved['family']!r} in the checkpoint, {now['family']!r} now")
    old, new = saved["params"], now["params"]
    for names, what in ((sorted(set(old) - set(new)), "only in the checkpoint"),
                        (sorted(set(new) - set(old)), "only in this model")):
        if names:
            out.append(f"{len(names)} parameter(s) {what} (e.g. {', '.join(names[:shown])})")
    reshaped = [n for n in sorted(set(old) & set(new)) if old[n] != new[n]]
    if reshaped:
        out.append(f"{len(reshaped)} parameter(s) of another shape (e.g. " + ", ".join(
            f"{n}: {old[n]} in the checkpoint, {new[n]} now" for n in reshaped[:shown]) + ")")
    if saved["zero_stage"] != now["zero_stage"]:
        out.append(f"ZeRO stage {saved['zero_stage']} in the checkpoint, {now['zero_stage']} now "
                   "(DeepSpeed's optimizer files differ by stage)")
    return out
