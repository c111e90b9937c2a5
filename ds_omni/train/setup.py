"""The composition root: a run is built here, once, in a fixed order, and each piece is handed
what it needs. Nothing else derives a fact of the plan again.

  1. `plan_run` (no process group, no model): the parallel plan with its derived facts
     (`ParallelPlan`: degrees, reorder group, per-sequence blocks, pool size), the LLM's config
     read once for the checks that need it, and the DeepSpeed config derived from the plan.
     `preflight` adds the checks of files on disk; `ds-omni plan` prints what `plan_run` built
     (`describe_plan`).
  2. `setup_training` (after `init_distributed`): this rank's process groups (`RankGroups`), the
     model, ONE cost model (the loader's balancing, the encoder pool's placement and the pipeline's
     stage split all price work with it), the long items, the loader, the parallelization of the
     built model, and the DeepSpeed engine.
"""

from __future__ import annotations

import logging
import os

import torch

from ds_omni.config import OmniConfig
from ds_omni.data.build import build_loader, cost_model_for, long_items_of
from ds_omni.data.check import startup_check
from ds_omni.data.cost import CostModel
from ds_omni.data.templates import carry_template, training_template
from ds_omni.model.attention import resolve_kernel
from ds_omni.model.build import (build_model, check_model_files, check_positions,
                                  check_sequence_parallel, llm_text_config)
from ds_omni.parallel import dist
from ds_omni.parallel.groups import RankGroups, rank_groups
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallel.stages import SPLITS, StagePlan, describe, stage_plan_for
from ds_omni.parallelize import parallelize
from ds_omni.parallelize.encoder_pool import EncoderPool
from ds_omni.parallelize.pipeline import (PipelineSpec, check_pipeline, layer_param_counts,
                                         optimizer_params)
from ds_omni.parallelize.tensor_parallel import check_tensor_parallel, check_tp_with_sp
from ds_omni.parallelize.tp_encoders import TPEncoders
from ds_omni.train import checkpoint
from ds_omni.train.ds_config import check_types, derive_ds_config, load_ds_json

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ 1. the plan, no process group
def plan_run(cfg: OmniConfig, ds_json: dict, world_size: int) -> tuple[ParallelPlan, dict]:
    """(the plan, the derived DeepSpeed config) for `world_size` ranks, with every check of the
    plan that needs no process group and no files but the model's configs."""
    plan = ParallelPlan.from_config(cfg.parallel, world_size, cfg.data.reorder)
    degrees = sorted({d for d in (plan.sp, plan.max_sequence_sp) if d > 1})
    needs_llm = degrees or plan.pp_enabled or plan.tp_enabled
    llm = llm_text_config(cfg.model) if needs_llm else None  # read once
    for degree in degrees:
        check_sequence_parallel(cfg.model, degree, llm)
    if plan.tp_enabled:
        check_tensor_parallel(llm[1], plan.tp, _llm_part(cfg))
    if plan.tp_enabled and plan.sp_enabled:  # Ulysses splits each TP rank's heads again
        check_tp_with_sp(llm[1], plan.tp, plan.sp, _llm_part(cfg))
    resolve_kernel(cfg.model.attn_implementation)  # varlen on CPU, flash-attn missing: say so now
    ds_config = derive_ds_config(cfg, ds_json, plan)
    if plan.pp_enabled:
        check_pipeline(cfg, ds_config, llm[1])
    return plan, ds_config


def _llm_part(cfg: OmniConfig) -> str:
    """How errors name the LLM: the pretrained directory's, or the config's part."""
    return f"the LLM of {cfg.model.pretrained!r}" if cfg.model.pretrained else "model.llm"


def preflight(cfg: OmniConfig, ds_config_path: str,
              resume: bool = False) -> tuple[ParallelPlan, dict]:
    """Every check that needs no process group, so a bad input fails on all ranks at once."""
    plan, ds_config = plan_run(cfg, load_ds_json(ds_config_path), dist.world_size_from_env())
    check_types(ds_config)  # optimizer and scheduler types DeepSpeed builds
    check_positions(cfg.model, cfg.data.max_seq_len)  # also: model.llm is a causal LM
    check_model_files(cfg.model)
    checkpoint.check_writable(cfg.train.output_dir)
    if resume:
        checkpoint.check_resumable(cfg.train.output_dir)
    else:
        checkpoint.check_fresh_start(cfg.train.output_dir, cfg.train.overwrite_output_dir)
    startup_check(cfg)  # files, schema columns, relative media roots of every source
    return plan, ds_config


def describe_plan(cfg: OmniConfig, plan: ParallelPlan, ds_config: dict,
                  gpus_per_node: int | None = None) -> dict:
    """What `ds-omni plan` prints: the degrees, every rank's place and groups (with
    `gpus_per_node`, those that cross nodes), the DeepSpeed config and, under pp > 1, the
    pipeline's stages (from the model built on the meta device: its sizes only, no weights made
    or read)."""
    degrees = {"world_size": plan.world_size, "dp": plan.dp, "sp": plan.sp, "pp": plan.pp}
    out = {"plan": {**degrees, **({"tp": plan.tp} if plan.tp_enabled else {})},
           "layout": plan.layout(gpus_per_node), "deepspeed": ds_config}
    if plan.ep_enabled:  # each MoE layer's experts over these groups of ranks (AutoEP)
        out["plan"].update(ep=plan.ep, ep_groups=plan.ep_group_ranks())
    if plan.pp_enabled:
        with torch.device("meta"):
            built = build_model(cfg.model)
        out["pipeline"] = _pipeline_stages(cfg, plan, built, cost_model(cfg, built))
    return out


def _pipeline_stages(cfg: OmniConfig, plan: ParallelPlan, built, cost: CostModel) -> dict:
    slowest = {split: max(stage_plan(cfg, built, plan, cost, split).stage_time)
               for split in SPLITS}
    return {"encoder_placement": cfg.parallel.encoder_placement,
            "stage_split": cfg.parallel.stage_split,
            "workload": f"micro-batches of {cfg.train.micro_batch_size} samples x "
                        f"{stage_tokens(cfg)} tokens, one item per encoder each",
            "stages": describe(stage_plan(cfg, built, plan, cost)),
            "slowest_stage_by_split": {split: round(t / slowest[cfg.parallel.stage_split], 4)
                                       for split, t in slowest.items()}}


# ------------------------------------------------------------------ 2. this rank's run
def setup_training(cfg: OmniConfig, ds_config: dict, rank: int, plan: ParallelPlan):
    """(built model, loader, DeepSpeed engine) of this rank; call after `init_distributed`."""
    import deepspeed
    from deepspeed.utils import groups as ds_groups
    groups = rank_groups(plan, rank, prefetch=bool(cfg.data.prefetch_steps))
    if rank != 0:  # rank 0 makes builtin assets first; the others then only read them
        dist.barrier()
    built = _build_model(cfg)
    cost = cost_model(cfg, built)
    coords = plan.coords(rank)
    loader = build_loader(cfg, built, dp_rank=coords.dp_rank, dp_size=plan.dp,
                          num_micro=ds_config["gradient_accumulation_steps"], comm=groups.comm,
                          sp_rank=coords.sp_rank, sp_size=plan.sp, step_comm=groups.step_comm,
                          cost=cost, reorder_group=plan.reorder_group,
                          long_items=long_items_of(cfg, built.model, plan.long_item_group),
                          shard_comm=groups.shard_comm, plan=plan, rank=rank,
                          timeout_s=float(os.environ.get("DS_OMNI_DIST_TIMEOUT", 1800.0)))
    if rank == 0:
        dist.barrier()
    # one random stream per data-parallel rank: the tensor-parallel ranks of a row run its
    # whole layers alike, so their dropout masks must agree (the encoders, which encode
    # different items on each, draw from a stream of their own: `parallelize.tp_encoders`)
    torch.manual_seed(cfg.train.seed + rank // plan.tp)
    ds_groups.mpu = None  # DeepSpeed keeps the last engine's mpu in a module global: don't inherit it
    module = _parallelize(cfg, ds_config, plan, groups, built, cost, rank)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=optimizer_params(module),
                                      config=ds_config, mpu=groups.mpu)
    align_lr_schedule(engine)
    return built, loader, engine


def _build_model(cfg: OmniConfig):
    """The model in train mode, its tokenizer carrying the chat template trained with (into
    checkpoints and the HF export)."""
    built = build_model(cfg.model)
    built.model.train()  # from_pretrained hands models over in eval mode: dropout would stay off
    carry_template(built.tokenizer, training_template(cfg.data.template, built))
    return built


def cost_model(cfg: OmniConfig, built) -> CostModel:
    """The run's one cost model (frozen encoders priced as forward only; calibrated scales)."""
    return cost_model_for(built, cfg.model.frozen_parts(), cfg.data.reorder.cost_scales)


def _parallelize(cfg: OmniConfig, ds_config: dict, plan: ParallelPlan, groups: RankGroups,
                 built, cost: CostModel, rank: int):
    """The plan applied to the built model (`ds_omni.parallelize`: the LLM's attention goes
    Ulysses under SP, encoders keep theirs); returns the module DeepSpeed is given (the model, or
    this rank's pipeline stage, split where the cost model says)."""
    pool = (encoder_pool_for(built, plan, rank, groups.pool, cost)
            if cfg.parallel.encoder_pool == "dp" else None)
    pipeline = (PipelineSpec(plan, stage_plan(cfg, built, plan, cost),
                             cfg.parallel.encoder_placement, built.item_processors,
                             _item_cost(cost)) if plan.pp_enabled else None)
    return parallelize(built.model, kernel=cfg.model.attn_implementation, sp_group=groups.sp,
                       blocks=groups.blocks, pool=pool,
                       encoder_dummies=encoder_dummies_needed(ds_config, plan.pp_enabled),
                       pipeline=pipeline, tp_group=groups.tp,
                       llm_config=built.hf_config.get_text_config() if groups.tp else None,
                       tp_encoders=tp_encoders_for(cfg, built, plan, rank, groups, cost))


def tp_encoders_for(cfg: OmniConfig, built, plan: ParallelPlan, rank: int, groups,
                    cost: CostModel) -> TPEncoders | None:
    """The TP ranks of a row encoding different items of it, where they do
    (`ParallelConfig.tp_encodes_apart`; otherwise every TP rank encodes the same items and their
    gradients are not summed over TP)."""
    if not groups.tp or not cfg.parallel.tp_encodes_apart:
        return None
    return TPEncoders(groups.tp, plan.coords(rank).tp_rank, plan.tp, built.item_processors,
                      _item_cost(cost))


def _item_cost(cost: CostModel):
    """(encoder name, EncodedItem) -> the item's modelled encoder cost."""
    return lambda name, item: float(cost.encoder_cost(name, item.cost_seqs()).sum())


def encoder_pool_for(built, plan: ParallelPlan, rank: int, group,
                     cost: CostModel) -> EncoderPool | None:
    """`parallel.encoder_pool="dp"`: this rank's pool over `group` (`RankGroups.pool`), every
    rank of the (single) pipeline stage: the data-parallel ranks, under sp > 1 those times the SP
    ranks, whose groups are consecutive pool ranks (under max_sequence_sp > 1 a block's
    micro-batch names its group, `sp_block`); priced by the loader's cost model. None (said once)
    when there is one data-parallel rank: the row's SP group (if any) already spreads its items."""
    if plan.dp == 1:
        if rank == 0:
            log.warning("parallel.encoder_pool=\"dp\" with one data-parallel rank: there is no "
                        "other row to share encoder work with; the pool is off")
        return None
    encoders = built.model.encoders
    # its place in the pool: under tp the pool is the dp x sp ranks of one TP rank, tp apart
    return EncoderPool(group, rank // plan.tp, plan.pool_size, built.item_processors,
                       {name: enc.placeholder_ids for name, enc in encoders.items()},
                       _item_cost(cost), dist.comm_device(), sp=plan.sp)


def stage_plan(cfg: OmniConfig, built, plan: ParallelPlan, cost: CostModel,
               split: str | None = None) -> StagePlan:
    """Pipeline stage boundaries by `split` (default `parallel.stage_split`), and each stage's
    predicted time for a typical micro-batch (micro_batch_size samples of `stage_tokens` tokens,
    one item per encoder each), from the loader's cost model."""
    split = split or cfg.parallel.stage_split
    layer_params, encoder_params = (layer_param_counts(built.model) if split == "parameters"
                                    else (None, 0))
    return stage_plan_for(cost, plan.pp, cfg.parallel.encoder_placement,
                          cfg.train.micro_batch_size, stage_tokens(cfg), split=split,
                          layer_params=layer_params, encoder_params=encoder_params)


def stage_tokens(cfg: OmniConfig) -> int:
    """Tokens of the typical sample the stage boundaries are planned for."""
    return cfg.parallel.stage_tokens or cfg.data.max_seq_len


def encoder_dummies_needed(ds_config: dict, pipeline: bool) -> bool:
    """Whether every micro-batch must run every encoder, on a zero-weight dummy where it has no
    item (`EmbeddingRouter.encoder_dummies`), for DeepSpeed's collectives to line up over the
    ranks.

    ZeRO-3 gathers an encoder's parameters at each run, all ranks together; ZeRO-2 reduces at
    every backward, ZeRO-1 with `overlap_comm` (or a `grad_accum_dtype`) at the last, both in the
    order gradient hooks fire, so every rank's backward must reach the same parameters.
    Otherwise ZeRO-0/1 reduce once a step, in parameter order, each parameter that has a
    gradient (the pipeline engine always: ZeRO 0/1, after its last backward), so an encoder with
    no item only needs a gradient, and a zero one (`fill_missing_grads`) is exactly what its
    dummy would give. bf16 ZeRO-0 (DeepSpeed's BF16_Optimizer) keeps them: untested without.
    """
    if pipeline:
        return False
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or stage >= 2 or zero.get("overlap_comm", False):
        return True
    if stage == 1:
        return bool(ds_config.get("data_types", {}).get("grad_accum_dtype"))
    return bool(ds_config.get("bf16", {}).get("enabled", False))


def align_lr_schedule(engine) -> None:
    """Make optimizer step k run at the LR schedule's iteration k.

    DeepSpeed's schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR) put the LR of iteration -1
    (the warm-up's start, 0 in the shipped configs) into the optimizer when they are built, and
    the engine steps them after each optimizer step; so step k ran at iteration k - 1: steps 0
    and 1 both at the start (with lr 0, two steps that learn nothing from their samples) and the
    whole schedule one step late. One scheduler step before training puts it on time.
    """
    scheduler = engine.lr_scheduler
    if getattr(scheduler, "last_batch_iteration", None) == -1:
        scheduler.step()

