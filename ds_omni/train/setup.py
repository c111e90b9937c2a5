"""The composition root: a run is built here, once, in a fixed order, and each piece is handed
what it needs. Nothing else derives a fact of the plan again.

  1. `plan_run` (no process group, no model): the parallel plan with its derived facts
     (`ParallelPlan`: degrees, reorder group, per-sequence blocks, pool size), the LLM's config
     read once for the checks that need it, and the DeepSpeed config derived from the plan.
     `preflight` adds the checks of files on disk; `ds-omni plan` prints what `plan_run` built
     (`describe_plan`).
  2. `setup_training` (after `init_distributed`): this rank's process groups (`RankGroups`), the
     model, ONE cost model (the loader's balancing, the encoder pool's placement and the pipeline's
     stage split all price work with it), the long items, the loader, the plan applied to the
     built model (one call: `ds_omni.parallelize.parallelize`), and the DeepSpeed engine.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from ds_omni.config import OmniConfig
from ds_omni.config.composition import ModelFacts, check_composition, check_model_fits, ring_problem
from ds_omni.data.build import build_loader, cost_model_for
from ds_omni.data.check import startup_check
from ds_omni.data.cost import CostModel
from ds_omni.data.templates import carry_template, training_template
from ds_omni.errors import ModelError
from ds_omni.model.attention import resolve_kernel
from ds_omni.model.build import (build_model, check_model_files, check_positions,
                                  check_sequence_parallel, llm_text_config, model_facts)
from ds_omni.model.convert import load_omni_state
from ds_omni.parallel import dist
from ds_omni.parallel.groups import RankGroups, rank_groups
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallel.bubbles import typical_schedule
from ds_omni.parallel.stages import SPLITS, describe
from ds_omni.parallelize import parallelize
from ds_omni.parallelize.pipeline import (check_pipeline, optimizer_params, resolved_placement,
                                         stage_plan, stage_tokens, typical_step)
from ds_omni.parallelize.tensor_parallel import (check_tensor_parallel, check_tp_with_sp,
                                                  tp_beyond_kv_heads)
from ds_omni.train import checkpoint
from ds_omni.train.ds_config import check_types, derive_ds_config, load_ds_json, zero_stage

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ 1. the plan, no process group
def plan_run(cfg: OmniConfig, ds_json: dict, world_size: int) -> tuple[ParallelPlan, dict]:
    """(the plan, the derived DeepSpeed config) for `world_size` ranks, with every check of the
    plan that needs no process group and no files but the model's configs; what composes first
    (the table of `ds_omni.config.composition`, under the DeepSpeed JSON's ZeRO stage)."""
    check_composition(cfg.parallel, zero_stage(ds_json), cfg.train.export_hf)
    plan = ParallelPlan.from_config(cfg.parallel, world_size, cfg.data.reorder)
    model_parallel = plan.sp_degrees or plan.world_size > plan.dp  # an axis splits the LLM
    llm = llm_text_config(cfg.model) if model_parallel else None  # read once
    plan = with_llm_heads(cfg, plan, llm)
    for degree in plan.sp_degrees:
        check_sequence_parallel(cfg.model, degree, llm)
    if llm is not None:  # each feature's own model check (`Feature.fits`)
        facts = model_facts(cfg.model, cfg.data.max_seq_len, llm)
        check_model_fits(cfg.parallel, facts)
        check_block_rings(plan, facts)
    if plan.tp_enabled:
        check_tensor_parallel(llm[1], plan.tp, _llm_part(cfg), experts_apart=plan.ep_enabled)
    if plan.tp_enabled and plan.sp_degrees:  # Ulysses splits each TP rank's heads again
        # beside tp a whole block must fit the heads: a block's ring beside tp is unchecked
        check_tp_with_sp(llm[1], plan.tp, max(plan.ulysses, plan.max_sequence_sp), _llm_part(cfg),
                         "parallel.sp" if plan.sp_enabled else "parallel.max_sequence_sp")
    resolve_kernel(cfg.model.attn_implementation)  # varlen on CPU, flash-attn missing: say so now
    ds_config = derive_ds_config(cfg, ds_json, plan)
    if plan.pp_enabled:
        check_pipeline(cfg, ds_config, llm[1])
    return plan, ds_config


def with_llm_heads(cfg: OmniConfig, plan: ParallelPlan, llm=None) -> ParallelPlan:
    """Under parallel.max_sequence_sp: `plan` told the LLM's query heads, which split its blocks
    into Ulysses and ring (`ParallelPlan.block_split`); `plan` itself otherwise."""
    if plan.max_sequence_sp == 1 or plan.heads is not None:
        return plan
    return plan.with_heads((llm or llm_text_config(cfg.model))[1].num_attention_heads)


def check_block_rings(plan: ParallelPlan, facts: ModelFacts) -> None:
    """Per-sequence blocks larger than the heads run a ring across their Ulysses groups: the
    LLM's attention must split that way (`composition.ring_problem`)."""
    cp = plan.block_split(plan.max_sequence_sp)[1]
    if cp > 1 and (problem := ring_problem(
            facts, f"parallel.max_sequence_sp={plan.max_sequence_sp} (blocks past the LLM's "
            f"{plan.heads} heads per TP rank run a ring of {cp})",
            f"set parallel.max_sequence_sp to at most {plan.heads}", "parallel.max_sequence_sp")):
        raise ModelError(problem)


def say_tp_warning(cfg: OmniConfig, plan: ParallelPlan) -> None:
    """Log, once for a planned run, what `tp_beyond_kv_heads` has to say (`plan_run` itself
    stays silent: the plan search runs it for many plans)."""
    if plan.tp_enabled and (note := tp_beyond_kv_heads(llm_text_config(cfg.model)[1], plan.tp)):
        log.warning(note)


def _llm_part(cfg: OmniConfig) -> str:
    """How errors name the LLM: the pretrained directory's, or the config's part."""
    return f"the LLM of {cfg.model.pretrained!r}" if cfg.model.pretrained else "model.llm"


def preflight(cfg: OmniConfig, ds_config_path: str,
              resume: bool = False) -> tuple[ParallelPlan, dict]:
    """Every check that needs no process group, so a bad input fails on all ranks at once."""
    plan, ds_config = plan_run(cfg, load_ds_json(ds_config_path), dist.world_size_from_env())
    say_tp_warning(cfg, plan)
    check_types(ds_config)  # optimizer and scheduler types DeepSpeed builds
    check_positions(cfg.model, cfg.data.max_seq_len)  # also: model.llm is a causal LM
    check_model_files(cfg.model)
    checkpoint.check_writable(cfg.train.output_dir)
    if resume:
        checkpoint.check_resumable(cfg.train.output_dir)
    else:
        checkpoint.check_fresh_start(cfg.train.output_dir, cfg.train.overwrite_output_dir)
    # files, layouts and schema columns, relative media roots of every source (rank 0 says)
    startup_check(cfg, announce=os.environ.get("RANK", "0") == "0")
    return plan, ds_config


def describe_plan(cfg: OmniConfig, plan: ParallelPlan, ds_config: dict,
                  gpus_per_node: int | None = None) -> dict:
    """What `ds-omni plan` prints: the degrees, every rank's place and groups (with
    `gpus_per_node`, those that cross nodes), the DeepSpeed config and, under pp > 1, the
    pipeline's stages (from the model built on the meta device: its sizes only, no weights made
    or read)."""
    say_tp_warning(cfg, plan)
    degrees = {"world_size": plan.world_size, "dp": plan.dp, "sp": plan.sp, "pp": plan.pp}
    out = {"plan": {**degrees, **({"tp": plan.tp} if plan.tp_enabled else {})},
           "layout": plan.layout(gpus_per_node), "deepspeed": ds_config}
    if plan.ep_enabled:  # each MoE layer's experts over these groups of ranks (AutoEP)
        out["plan"].update(ep=plan.ep, ep_groups=plan.ep_group_ranks())
    if plan.pp_enabled:
        with torch.device("meta"):
            built = build_model(cfg.model)
        out["pipeline"] = _pipeline_stages(cfg, plan, built, cost_model(cfg, built), ds_config)
    return out


def _pipeline_stages(cfg: OmniConfig, plan: ParallelPlan, built, cost: CostModel,
                     ds_config: dict | None = None) -> dict:
    placement = resolved_placement(cfg, plan, cost, stage_plan(cfg, built, plan, cost))
    slowest = {split: max(stage_plan(cfg, built, plan, cost, split).stage_time)
               for split in SPLITS}
    out = {"encoder_placement": placement,
           "stage_split": cfg.parallel.stage_split,
           "workload": f"micro-batches of {cfg.train.micro_batch_size} samples x "
                       f"{stage_tokens(cfg)} tokens, one item per encoder each",
           "stages": describe(stage_plan(cfg, built, plan, cost)),
           "slowest_stage_by_split": {split: round(t / slowest[cfg.parallel.stage_split], 4)
                                      for split, t in slowest.items()}}
    if placement == "bubbles" or cfg.parallel.encoder_placement == "auto":
        # which schedule steps each stage encodes in, and what "auto" decided by
        out["bubble_schedule"] = typical_schedule(
            cost, *typical_step(cfg, plan, cost, stage_plan(cfg, built, plan, cost)))
    return out


# ------------------------------------------------------------------ 2. this rank's run
class Training(NamedTuple):
    """What `setup_training` built for this rank."""

    built: object  # the `BuiltModel`
    loader: object
    engine: object  # DeepSpeed's
    groups: RankGroups  # this rank's process groups (what `train_step` reduces over)


def setup_training(cfg: OmniConfig, ds_config: dict, rank: int, plan: ParallelPlan,
                   weights: dict | None = None) -> Training:
    """(built model, loader, DeepSpeed engine, process groups) of this rank; call after
    `init_distributed`. `weights` (OmniModel names, whole): loaded before the plan shards the
    model (a resume on another plan, `ds_omni.train.reshard`)."""
    import deepspeed
    from deepspeed.utils import groups as ds_groups
    plan = with_llm_heads(cfg, plan)  # a plan made without `plan_run` (tests)
    groups = rank_groups(plan, rank, prefetch=bool(cfg.data.prefetch_steps))
    if rank != 0:  # rank 0 makes builtin assets first; the others then only read them
        dist.barrier()
    built = _build_model(cfg)
    if weights is not None:
        load_omni_state(built.model, weights)
    cost = cost_model(cfg, built)
    loader = build_loader(cfg, built, plan, groups,
                          num_micro=ds_config["gradient_accumulation_steps"], cost=cost)
    if rank == 0:
        dist.barrier()
    # one random stream per data-parallel rank: the tensor-parallel ranks of a row run its
    # whole layers alike, so their dropout masks must agree (the encoders, which encode
    # different items on each, draw from a stream of their own: `parallelize.tp_encoders`)
    torch.manual_seed(cfg.train.seed + plan.replica_rank(rank))
    ds_groups.mpu = None  # DeepSpeed keeps the last engine's mpu in a module global: don't inherit it
    module = parallelize(built, plan, groups, cfg, cost, ds_config)
    # the pipeline engine makes its own groups from the stage module's topology (`pipe_grid`)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=optimizer_params(module),
                                      config=ds_config,
                                      mpu=None if plan.pp_enabled else groups.mpu)
    align_lr_schedule(engine)
    return Training(built, loader, engine, groups)


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

