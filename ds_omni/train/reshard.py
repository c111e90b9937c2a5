"""Resuming on another plan (parallel.pp, tp or ep changed, or a pipeline on another number of
ranks): ds_omni's own consolidation, not DeepSpeed's universal checkpoint.

`resharded_checkpoint` makes the newest checkpoint whole in HF's layout (`consolidate_checkpoint`:
pipeline names mapped, AutoTP's shards joined, AutoEP's experts stacked) before the model is
parallelized, so the new plan shards it as it shards `model.pretrained`;
`checkpoint.load(resharded=True)` then gives the engine the step and the LR schedule and the
loader its data position, and `restore_moments` the optimizer Adam's moments and step (whole in
the checkpoint, `ds_omni.train.moments`), so the run continues as on the old plan. Why not
DeepSpeed's universal checkpoint: `ds_to_universal` re-slices a tensor-parallel parameter only
by the name patterns a model's `universal_checkpoint_info` supplies (Megatron's), which AutoTP's
(possibly uneven) splits and the pipeline's stage-local names would need ds_omni to write and
keep; on the same pp / tp / ep, `checkpoint.load` still uses it (another number of
data-parallel ranks, moments re-partitioned exactly).
More: docs/fault_tolerance.md, "Resuming on another plan".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ds_omni.model.convert import consolidate_checkpoint
from ds_omni.train import checkpoint, moments


def saved_layout(directory: Path, run: dict | None) -> dict[str, int]:
    """{"pp", "tp", "ep", "world_size"} the checkpoint in `directory` was written under (the
    run's fingerprint, and DeepSpeed's own record of the pipeline's degree)."""
    run = run or {}
    states = directory / "mp_rank_00_model_states.pt"  # absent under ZeRO-3 (never with pp)
    dims = (torch.load(states, map_location="cpu", weights_only=False).get(
        "checkpoint_parallel_dimensions") or {}) if states.is_file() else {}
    return {"pp": int(dims.get("pp_degree", 1)), "tp": int(run.get("tp", 1)),
            "ep": int(run.get("ep", 1)), "world_size": int(run.get("world_size", 0))}


def needs_reshard(saved: dict[str, int], plan) -> bool:
    """Another pp, tp or ep, or a pipeline on another number of ranks (whose ZeRO shards
    DeepSpeed's loading cannot re-partition)."""
    now = {"pp": plan.pp, "tp": plan.tp, "ep": plan.ep}
    return any(saved[k] != v for k, v in now.items()) or (
        plan.pp > 1 and saved["world_size"] not in (0, plan.world_size))


@dataclass
class Resharded:
    """Another plan's checkpoint made whole: its `weights` (OmniModel names, HF's layout),
    loaded before the plan shards the model, and its `moments` (None: written without them)."""

    directory: Path  # the checkpoint's step directory
    weights: dict[str, torch.Tensor]
    moments: moments.Moments | None


def resharded_checkpoint(output_dir: str | Path, plan, rank: int) -> Resharded | None:
    """The newest complete checkpoint made whole when it was written under another plan
    (`needs_reshard`), else None. Every rank calls this."""
    root = checkpoint.checkpoint_root(output_dir)
    choice = [checkpoint.newest_complete(root)[0] if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    tag = choice[0]
    if tag is None:
        return None  # `checkpoint.load` says why
    run = checkpoint.read_json(root / tag / "trainer_state.json").get("run")
    saved = saved_layout(root / tag, run)
    if not needs_reshard(saved, plan):
        return None
    found = moments.read(root / tag)
    if rank == 0:
        carried = ("its weights and Adam's moments are consolidated and resharded"
                   if found is not None else "its weights are consolidated and resharded; the "
                   "optimizer starts afresh (the checkpoint holds no whole moments: written "
                   "with train.save_whole_moments false, under ZeRO-3, before its first step, or by "
                   "an older ds_omni)")
        print(f"ds-omni: --resume: {tag} was written under pp={saved['pp']} tp={saved['tp']} "
              f"ep={saved['ep']} on {saved['world_size']} ranks, this run has pp={plan.pp} "
              f"tp={plan.tp} ep={plan.ep} on {plan.world_size}: {carried}", flush=True)
    return Resharded(root / tag, consolidate_checkpoint(root, tag), found)


def restore_moments(engine, resharded: Resharded, rank: int) -> None:
    """Adam's moments and step of `resharded` into the engine's optimizer, cut as the plan
    cut the weights (`moments.restore`); said on rank 0 if they cannot be (it starts afresh)."""
    if resharded.moments is None:
        return
    problem = moments.restore(engine, resharded.moments, resharded.weights)
    if problem is not None and rank == 0:
        print(f"ds-omni: --resume: Adam's moments of {resharded.directory.name} are not "
              f"carried to this plan ({problem}); the optimizer starts afresh", flush=True)
