"""The DeepSpeed config of a run: the user's JSON plus the fields that follow from the ds_omni config.

Batch sizes, gradient accumulation and the scheduler's length follow from `train` and the parallel
plan and are computed here, once. The user's file may leave them out or write "auto"; a different
value is an error that names both numbers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ds_omni.config import OmniConfig
from ds_omni.errors import ConfigError
from ds_omni.model.build import llm_text_config
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallelize.expert_parallel import autoep_section

SCHEDULER_FIELDS = {  # scheduler type -> its params that follow from `train`
    "WarmupLR": ("warmup_max_lr", "warmup_num_steps"),
    "WarmupDecayLR": ("warmup_max_lr", "warmup_num_steps", "total_num_steps"),
    "WarmupCosineLR": ("warmup_num_steps", "total_num_steps"),
}


def load_ds_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {str(path)!r} does not exist; pass --deepspeed with a "
                          "file such as ds_configs/zero2.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from None


def gradient_accumulation_steps(cfg: OmniConfig, plan: ParallelPlan) -> int:
    per_step = cfg.train.micro_batch_size * plan.dp
    if cfg.train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
            f"train.micro_batch_size x data-parallel size = {cfg.train.micro_batch_size} x {plan.dp} "
            f"= {per_step}; use a multiple of {per_step}")
    return cfg.train.global_batch_size // per_step


def derived_fields(cfg: OmniConfig, plan: ParallelPlan) -> dict:
    fields = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(cfg, plan),
        "train_batch_size": cfg.train.global_batch_size,
    }
    if plan.pp_enabled and plan.sp_enabled:  # the pipeline grid counts SP ranks as data ranks
        fields["train_batch_size"] *= plan.sp
    if plan.sp_enabled:
        fields["sequence_parallel_size"] = plan.sp
    return fields


def zero_stage(ds: dict) -> int:
    """The DeepSpeed config's ZeRO stage (0 where it names none, as DeepSpeed reads it)."""
    return ds.get("zero_optimization", {}).get("stage", 0)


def derive_ds_config(cfg: OmniConfig, user: dict, plan: ParallelPlan) -> dict:
    """The user's DeepSpeed config with the derived fields filled in; conflicts are errors."""
    out = copy.deepcopy(user)
    for key, value in derived_fields(cfg, plan).items():
        _merge(out, key, value, where=key)
    if plan.sp_enabled and out.get("zero_optimization", {}).get("stage") == 3:
        # one gradient reduction path under SP, so its scaling is known (engine.gradient_divisor)
        zero = out["zero_optimization"]
        if zero.get("reduce_scatter", True) is not True:
            raise ConfigError("zero_optimization.reduce_scatter=false is not supported with ZeRO-3 "
                              "and parallel.sp > 1 (DeepSpeed then scales gradients differently "
                              "by bucket size); remove it or set it to true")
        zero["reduce_scatter"] = True
    check_engine_autotp(out)
    if plan.pp_enabled and plan.tp_enabled:
        # the engine would send each TP rank 1/tp of the activations and all-gather them on the
        # next stage, but it caches their shape from the first micro-batch (0.19.8: `pipe_
        # partition_input_meta_cache`), which packed rows of varying length break
        section = out.setdefault("pipeline", {})
        for key in ("pipe_partitioned", "grad_partitioned"):
            _merge(section, key, False, where=f"pipeline.{key}")
    if plan.ep_enabled:  # AutoEP, with the router settings of the LLM's own config
        autoep = autoep_section(llm_text_config(cfg.model)[1], plan.ep,  # checked under tp too
                                pipeline=plan.pp_enabled)
        # under tp ds_omni folds the experts itself (`parallelize.expert_folding`): DeepSpeed's
        # engine refuses AutoEP beside a TP mpu
        section = out.setdefault("expert_parallel", {}) if not plan.tp_enabled else {}
        for key, value in autoep.items():
            _merge(section, key, value, where=f"expert_parallel.{key}")
    train = cfg.train
    optimizer = out.get("optimizer")
    if optimizer is not None:
        params = optimizer.setdefault("params", {})
        _merge(params, "lr", train.lr, where="optimizer.params.lr")
        _merge(params, "weight_decay", train.weight_decay, where="optimizer.params.weight_decay")
    scheduler = out.get("scheduler")
    if scheduler is not None:
        values = {"warmup_max_lr": train.lr, "warmup_num_steps": train.warmup_steps,
                  "total_num_steps": train.steps}
        params = scheduler.setdefault("params", {})
        if scheduler.get("type") == "WarmupCosineLR" and train.warmup_steps < 1:
            raise ConfigError("DeepSpeed's WarmupCosineLR needs at least one warm-up step; set "
                              "train.warmup_steps >= 1 (or use another scheduler)")
        for key in SCHEDULER_FIELDS.get(scheduler.get("type"), ()):
            _merge(params, key, values[key], where=f"scheduler.params.{key}")
    out.setdefault("steps_per_print", 10 ** 9)  # ds_omni reports progress itself
    return out


def check_types(ds: dict) -> None:
    """The optimizer and scheduler types are ones DeepSpeed builds (its own, case-insensitive
    for optimizers, or a torch.optim / torch.optim.lr_scheduler class): checked by training's
    preflight (it imports DeepSpeed, which `ds-omni plan` does not), where DeepSpeed would stop
    with a bare assertion after the model is built."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    lr = torch.optim.lr_scheduler
    for section, ours, module, base in (("optimizer", DEEPSPEED_OPTIMIZERS, torch.optim,
                                         torch.optim.Optimizer),
                                        ("scheduler", VALID_LR_SCHEDULES, lr, lr.LRScheduler)):
        if not isinstance(ds.get(section), dict):
            continue
        kind = ds[section].get("type")
        theirs = sorted(n for n, v in vars(module).items()
                        if isinstance(v, type) and issubclass(v, base) and v is not base
                        and not n.startswith("_"))
        if kind in theirs or (isinstance(kind, str) and
                              (kind.lower() if section == "optimizer" else kind) in ours):
            continue
        raise ConfigError(f"DeepSpeed config: {section}.type={kind!r} is not a type DeepSpeed "
                          f"knows; use one of DeepSpeed's {sorted(ours)} or a "
                          f"{module.__name__} class ({', '.join(theirs)})")


def check_engine_autotp(ds: dict) -> None:
    """parallel.tp shards the backbone with AutoTP outside DeepSpeed's engine
    (`ds_omni.parallelize.tensor_parallel`): the config must not ask the engine to shard the
    whole model again. Refused at any parallel.tp (1 too): it is the one way to ask for a
    tensor-parallel encoder, and encoders keep their own plan. (tp with ZeRO-3:
    `ds_omni.config.composition`.)"""
    autotp = ds.get("tensor_parallel", {}).get("autotp_size", 0)
    if autotp > 1:
        raise ConfigError(f"the DeepSpeed config sets tensor_parallel.autotp_size={autotp}, which "
                          "would shard the encoders too (they are never tensor-parallel: they "
                          "keep their own plan over all ranks); remove it and set parallel.tp in "
                          "the ds_omni config (ds_omni applies AutoTP to the LLM backbone alone)")


def _merge(target: dict, key: str, value, where: str) -> None:
    given = target.get(key, "auto")
    if given != "auto" and given != value:
        raise ConfigError(f"DeepSpeed config sets {where}={given!r} but the ds_omni config implies "
                          f"{value!r}; remove it from the DeepSpeed JSON or write \"auto\"")
    target[key] = value
