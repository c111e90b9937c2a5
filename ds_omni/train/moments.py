"""Adam's moments in a form no plan owns, so a resume on another pp / tp / ep continues exactly.

Every save writes, from the first rank of each pipeline stage, `optimizer_moments_stageSS.
safetensors`: each parameter the stage steps, its whole `exp_avg` and `exp_avg_sq` (ZeRO's
partitions joined by DeepSpeed's `safe_get_full_optimizer_state`, AutoTP's shards gathered as
for the oracle's reads, AutoEP's experts in HF's layout) under its OmniModel name, and Adam's
step count. A resume on another plan (`ds_omni.train.reshard`) cuts them as the new plan cut
the weights (AutoTP's split sizes, AutoEP's experts of the rank), checks that cut on the weights
themselves, and sets them. Why written at save time rather than read from DeepSpeed's files:
without ZeRO the torch optimizer keys its state by parameter index, which only the writing
plan's engine can name, and ZeRO's flat partitions (alignment padding, AutoEP's expert-data-
parallel groups, a pipeline's model-parallel ranks) are DeepSpeed's internal layout. Cost: two
fp32 copies of the model per checkpoint. Not covered: ZeRO-3, fp16 without ZeRO (`_kind`).
More: docs/fault_tolerance.md, "Resuming on another plan".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ds_omni.model.layer_files import omni_key
from ds_omni.parallelize.expert_parallel import autoep_layers, autoep_piece, hf_expert_state
from ds_omni.parallelize.pipeline import optimizer_params
from ds_omni.parallelize.tensor_parallel import gather_tp, tp_cuts, tp_piece

MOMENTS = ("exp_avg", "exp_avg_sq")
FILE = "optimizer_moments_stage{:02d}.safetensors"
FILES = "optimizer_moments_stage*.safetensors"
JOINT = "joint_encoders."  # a pipeline stage's encoders other than stage 0's (`pipeline`)


@dataclass
class Moments:
    """A checkpoint's whole moments: {"exp_avg" / "exp_avg_sq": {OmniModel name (HF's layout):
    tensor}}, and Adam's step count."""

    tensors: dict[str, dict[str, torch.Tensor]]
    step: float


def save(engine, directory: Path, rank: int) -> None:
    """Write this stage's whole moments into `directory`; every rank calls it (it gathers).
    Nothing before the first optimizer step, or for an optimizer `_kind` does not know."""
    step, params = adam_step(engine), stepped(engine.module)
    if not _everywhere(step is not None and _kind(engine, params) is not None):
        return
    _link(engine.optimizer)  # (a load re-makes ZeRO's fragments unlinked until the next step)
    tensors = {}
    for key in MOMENTS:
        whole = _whole(engine.module, _local(engine, params, key))
        tensors.update({f"{key}/{name}": t.detach().cpu().contiguous()
                        for name, t in whole.items()})
    stage = _first_of_stage(engine, rank)
    if stage is not None:
        from safetensors.torch import save_file
        save_file(tensors, str(directory / FILE.format(stage)),
                  metadata={"adam_step": repr(step), "version": "1"})


def read(directory: Path) -> Moments | None:
    """The moments a checkpoint directory holds (None: written without them)."""
    from safetensors import safe_open
    files = sorted(Path(directory).glob(FILES))
    if not files:
        return None
    tensors, step = {key: {} for key in MOMENTS}, 0.0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            step = float(f.metadata()["adam_step"])
            for key in f.keys():
                moment, name = key.split("/", 1)
                tensors[moment][name] = f.get_tensor(key)
    return Moments(tensors, step)


def restore(engine, found: Moments, weights: dict[str, torch.Tensor]) -> str | None:
    """Set `found` (whole moments, `read`) in this rank's optimizer, each cut as the plan cut the
    weights: the cut of `weights` (whole, as loaded before the plan sharded the model) must give
    every parameter's own value back. Returns why not (the same on every rank: the optimizer
    then starts afresh), None once set; every rank calls it."""
    params = stepped(engine.module)
    problem, local = None, {}
    if _kind(engine, params) is None:
        problem = "ZeRO-3's optimizer, or fp16's without ZeRO, is not covered"
    else:
        try:
            cut = cutter(engine.module)
            check_cut(params, cut, weights)
            local = {key: {n: cut(n, found.tensors[key]) for n in params} for key in MOMENTS}
        except (KeyError, ValueError) as e:
            problem = f"{type(e).__name__}: {e}"
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    if any(problems):
        return next(p for p in problems if p)
    _set(engine, params, local, found.step)
    return None


def stepped(module) -> dict[str, torch.nn.Parameter]:
    """The parameters this rank's optimizer steps (`optimizer_params`: under "uniform" /
    "bubbles" placement not a stage's replicas of encoder parameters another stage owns), by
    the engine module's names."""
    mine = {id(p) for p in optimizer_params(module)}
    return {n: p for n, p in module.named_parameters() if id(p) in mine}


def omni_name(module, name: str) -> str | None:
    """The OmniModel name of the engine module's parameter `name` (a pipeline stage's by its
    layer index, `layer_files.omni_key`; its encoders registered beside stage 0's as theirs)."""
    prefixes = getattr(module, "omni_prefixes", None)
    if prefixes is None:
        return name
    if name.startswith(JOINT):
        return "encoders." + name[len(JOINT):]
    return omni_key(name, prefixes)


def adam_step(engine) -> float | None:
    """Adam's step count (the torch optimizer's state, ZeRO's inner one; None: no step yet, or
    an optimizer without Adam's moments)."""
    state = _base(engine).state
    return next((float(s["step"]) for s in state.values()
                 if "step" in s and all(k in s for k in MOMENTS)), None)


def cutter(module):
    """(engine name, a whole state: OmniModel names, HF's layout) -> that parameter's piece on
    this rank, cut as the plan cut its weights: AutoEP's experts of the rank (AutoEP's names
    from HF's, `autoep_piece`), then AutoTP's shard (`tp_piece`)."""
    cuts = tp_cuts(module)
    experts = {}
    for layer_name, layer in autoep_layers(module).items():
        n = layer.num_local_experts
        for leaf, _ in layer.named_parameters():
            experts[f"{layer_name}.{leaf}"] = slice(layer.ep_rank * n, (layer.ep_rank + 1) * n)

    def cut(name: str, whole: dict[str, torch.Tensor]) -> torch.Tensor:
        piece = autoep_piece(omni_name(module, name), whole, experts.get(name))
        return tp_piece(piece, cuts[name]) if name in cuts else piece
    return cut


def check_cut(params: dict, cut, weights: dict[str, torch.Tensor]) -> None:
    """ValueError unless `cut` gives each parameter its own value from the whole `weights`."""
    for name, p in params.items():
        want = cut(name, weights)
        if tuple(want.shape) != tuple(p.shape) or not torch.equal(
                want.to(device=p.device, dtype=p.dtype), p.detach()):
            raise ValueError(f"{name}: cut from the checkpoint's whole weights it is "
                             f"{tuple(want.shape)}, not this plan's {tuple(p.shape)} value")


def _local(engine, params: dict, key: str) -> dict[str, torch.Tensor]:
    """Each stepped parameter's moment `key`, whole over ZeRO's partitions (collective over
    each parameter's data-parallel group under ZeRO 1/2), in the plan's own layout."""
    from deepspeed.utils import safe_get_full_optimizer_state
    state = _base(engine).state
    out = {}
    hp = _kind(engine, params) == "hp"
    for name, p in params.items():
        if hp:
            value = safe_get_full_optimizer_state(p, key)
        else:
            value = state[p][key] if key in state.get(p, {}) else torch.zeros_like(p)
        out[name] = value.detach().float().clone()
    return out


def _whole(module, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`local` (the engine module's names) made whole in OmniModel names and HF's layout:
    AutoTP's shards gathered over their TP group, AutoEP's experts over their EP group; every
    rank of those groups calls it."""
    if getattr(module, "tp_counts", None) is not None:
        local = gather_tp(module, local)
    layers = autoep_layers(module)
    if layers:
        layer = next(iter(layers.values()))
        group = layer.ep_group
        if group is None:
            from deepspeed.utils import groups
            group = groups._get_expert_parallel_group(layer.ep_group_name)

        def gather(t: torch.Tensor) -> list[torch.Tensor]:
            parts = [torch.empty_like(t) for _ in range(layer.ep_size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return parts
        local = hf_expert_state(local, layer.ep_size, gather)
    return {omni_name(module, n): t for n, t in local.items()}


def _set(engine, params: dict, local: dict[str, dict[str, torch.Tensor]], step: float) -> None:
    """The moments `local` (this rank's pieces) and Adam's step into the optimizer, whose
    state (before its first step) is made here as torch's Adam would make it."""
    opt = engine.optimizer
    base = _base(engine)
    if _kind(engine, params) == "hp":
        from deepspeed.utils import safe_set_full_optimizer_state
        _fill_state(base, [t for g in base.param_groups for t in g["params"]], step)
        _link(opt)
        for name, p in params.items():
            for key in MOMENTS:
                safe_set_full_optimizer_state(p, local[key][name].to(p.device), key)
        return
    _fill_state(base, list(params.values()), step)
    for name, p in params.items():
        for key in MOMENTS:
            base.state[p][key].copy_(local[key][name])


def _fill_state(base, tensors: list[torch.Tensor], step: float) -> None:
    """Adam's state of each of `tensors` (made if missing: zero moments), at step `step`:
    a tensor step for torch's Adam, a number for DeepSpeed's (which also keep it per group)."""
    torch_adam = type(base).__module__.startswith("torch.optim")
    for t in tensors:
        state = base.state[t]
        for key in MOMENTS:
            state.setdefault(key, torch.zeros_like(t))
        state["step"] = torch.tensor(step, dtype=torch.float32) if torch_adam else int(step)
    if not torch_adam:
        for group in base.param_groups:
            group["step"] = int(step)


def _kind(engine, params: dict) -> str | None:
    """"hp": ZeRO 1/2 or the bf16 optimizer (fp32 partitions, DeepSpeed's per-parameter views);
    "torch": no ZeRO, fp32 (torch's optimizer steps the parameters themselves); None: another
    (ZeRO-3's, fp16's without ZeRO), whose moments this module does not read or set."""
    if engine.zero_optimization_stage() > 2:
        return None
    if any(hasattr(p, "_hp_mapping") for p in params.values()):
        return "hp"
    return "torch" if _base(engine) is engine.optimizer else None


def _base(engine):
    """The torch optimizer: ZeRO's (and the bf16 optimizer's) inner one, else the engine's."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _link(opt) -> None:
    """ZeRO 1/2's (and the bf16 optimizer's) per-parameter views of its flat optimizer state
    pointed at that state now (DeepSpeed links them lazily, after a step)."""
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _everywhere(flag: bool) -> bool:
    """`flag` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)


def _first_of_stage(engine, rank: int) -> int | None:
    """This rank's pipeline stage if it is the stage's first rank (it writes the stage's file)."""
    stage = getattr(engine, "stage_id", 0)
    stages = [stage]
    if dist.is_initialized() and dist.get_world_size() > 1:
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, stage)
    return stage if stages.index(stage) == rank else None
