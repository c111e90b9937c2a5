"""Parallelism applied to a built model, from outside (`parallelize`).

The model is built whole (`ds_omni.model.build`); `parallelize` builds what the plan needs
(torchtitan's `parallelize_fn`), returns what DeepSpeed is given; `apply_plan` applies pieces:
  embedding.py        the SP / per-sequence SP / pool routing of embeddings (`EmbeddingRouter`;
                      its `prepare_step` is the step's one hook into the plan's features)
  encoder_pool.py     each round's encoder items placed over every data-parallel rank
  pipeline.py         the LLM over pipeline stages on DeepSpeed's PipelineModule (parallel.pp > 1)
  pipe_grid.py        the pipeline engine's topology with tp and sp inside the stages
  joint.py            "uniform" placement: each stage encodes a share (bubble_schedule.py: "bubbles")
  tensor_parallel.py  the backbone's decoder layers over the TP group (DeepSpeed's AutoTP)
  tp_encoders.py      the encoders under TP: each TP rank encodes a share, rows all-gathered
  expert_parallel.py  an MoE LLM's experts over ep ranks (DeepSpeed's AutoEP); beside tp:
                      expert_folding.py; under pp, the aux loss: pipeline_moe.py
Pure planners and groups: `ds_omni.parallel`. More: docs/architecture.md.
"""

from __future__ import annotations

from torch import nn

from ds_omni.config import OmniConfig
from ds_omni.data.cost import CostModel
from ds_omni.model.attention import PackedAttention
from ds_omni.model.omni import OmniModel
from ds_omni.parallel.groups import RankGroups
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallel.ring import RingGroup
from ds_omni.parallelize.embedding import EmbeddingRouter, EvenEncoderCalls, encoder_dummies_needed
from ds_omni.parallelize.encoder_pool import EncoderPool, encoder_pool_for
from ds_omni.parallelize.expert_folding import ExpertFold, expert_fold_for, fold_experts
from ds_omni.parallelize.expert_parallel import count_hf_experts
from ds_omni.parallelize.pipeline import PipelineSpec, build_pipeline_module, pipeline_spec_for
from ds_omni.parallelize.tensor_parallel import shard_backbone
from ds_omni.parallelize.tp_encoders import TPEncoders, tp_encoders_for

__all__ = ["EmbeddingRouter", "PipelineSpec", "apply_plan", "encoder_pool_of", "parallelize",
           "router_of"]


def parallelize(built, plan: ParallelPlan, groups: RankGroups, cfg: OmniConfig, cost: CostModel,
                ds_config: dict) -> nn.Module:
    """The plan applied to `built` (a `BuiltModel`) on this rank (`groups.rank`); returns the
    module DeepSpeed is given: the model, or under parallel.pp > 1 this rank's pipeline stage,
    split where `cost` (the loader's cost model) says. Builds what the plan needs: the encoder
    pool (parallel.encoder_pool="dp"), the encoders' split over TP, the stages, and whether every
    micro-batch runs every encoder on a dummy (`encoder_dummies_needed`, from `ds_config`)."""
    item_cost = _item_cost(cost)
    model, rank = built.model, groups.rank
    llm_config = built.hf_config.get_text_config() if groups.tp else None
    pool = (encoder_pool_for(built, plan, rank, groups.pool, item_cost)
            if plan.encoder_pool else None)
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    even = (EvenEncoderCalls(list(model.encoders), groups.dp)
            if zero3 and (plan.sp_enabled or plan.max_sequence_sp > 1) else None)
    return apply_plan(model, kernel=cfg.model.attn_implementation, sp_group=groups.sp,
                      blocks=groups.blocks, pool=pool,
                      encoder_dummies=encoder_dummies_needed(ds_config, plan.pp_enabled),
                      pipeline=pipeline_spec_for(cfg, built, plan, cost, item_cost),
                      tp_group=groups.tp, llm_config=llm_config,
                      experts=expert_fold_for(plan, groups.tp, llm_config),
                      tp_encoders=tp_encoders_for(cfg, built, plan, rank, groups.tp, item_cost),
                      even_calls=even, ring=_ring(groups),
                      ulysses_group=groups.axes.get("ulysses", (None,))[0],
                      block_rings=groups.block_rings)


def _ring(groups: RankGroups) -> RingGroup | None:
    """parallel.cp: this rank's ring (`ParallelPlan.cp_group_ranks`); None without cp."""
    return RingGroup.of(*groups.axes["cp"], groups.rank) if "cp" in groups.axes else None


def _item_cost(cost: CostModel):
    """(encoder name, EncodedItem) -> the item's modelled encoder cost."""
    return lambda name, item: float(cost.encoder_cost(name, item.cost_seqs()).sum())


def apply_plan(model: OmniModel, *, kernel: str | None = None, sp_group=None,
               blocks: dict | None = None, pool: EncoderPool | None = None,
               encoder_dummies: bool = True, pipeline: PipelineSpec | None = None,
               tp_group=None, llm_config=None, tp_encoders: TPEncoders | None = None,
               even_calls: EvenEncoderCalls | None = None,
               experts: ExpertFold | None = None, ring=None,
               ulysses_group=None, block_rings: dict | None = None) -> nn.Module:
    """Apply the plan's pieces to a built model; returns the model, or under `pipeline` this
    rank's stage. Each argument is one feature's piece, None where it is off; `parallelize`
    builds them from the plan (each by its module's `*_for` builder, which says what it is)."""
    kernel = kernel or model.backbone.attention.asked
    if tp_encoders is not None:
        encoder_dummies = True
        tp_encoders.sum_grads_over_tp(model.encoders)
    router = EmbeddingRouter(kernel=kernel, sp_group=sp_group, blocks=blocks, pool=pool,
                             encoder_dummies=encoder_dummies, tp_encoders=tp_encoders,
                             block_rings=block_rings)
    for feature in (even_calls, pool, tp_encoders):
        if feature is not None:
            router.on_step(feature)
    model.backbone.attention = PackedAttention(
        kernel, ulysses_group if ring is not None else sp_group, router.sp_counts, ring=ring)
    if ring is not None:
        router.row_attention = model.backbone.attention
    model.router = router
    if tp_group is not None:
        model.tp_counts = shard_backbone(model.backbone, tp_group, llm_config,
                                         experts_apart=experts is not None)
    if experts is not None:
        fold_experts(model, experts, tp_group)
    if pipeline is None:
        count_hf_experts(model.backbone)  # the expert load of HF's MoE blocks (AutoEP counts its own)
        return model
    return build_pipeline_module(model, pipeline.plan, pipeline.stage_plan, pipeline.placement,
                                 pipeline.processors, pipeline.item_cost,
                                 encoder_dummies=encoder_dummies, pool=pool)


def router_of(module: nn.Module) -> EmbeddingRouter | None:
    """The router `parallelize` attached to `module` (None on a pipeline stage, whose module is
    not the model, and on a model the plan was not applied to)."""
    return getattr(module, "router", None)


def encoder_pool_of(module: nn.Module) -> EncoderPool | None:
    """The encoder pool this rank's `module` runs (the model's router's, or a pipeline stage's
    `pool`), None without one."""
    router = router_of(module)
    return router.encoder_pool if router is not None else getattr(module, "pool", None)
