"""Parallelism applied to a built model, from outside: `parallelize(model, ...)`.

The model is built whole and plain (`ds_omni.model.build`); this step applies the plan to it
(torchtitan's `parallelize_fn`) and returns the module DeepSpeed is given:
  embedding.py        the SP / per-sequence SP / encoder-pool routing of a micro-batch's embeddings
  encoder_pool.py     each round's encoder items placed over every data-parallel rank
  pipeline.py         the LLM over pipeline stages on DeepSpeed's PipelineModule (parallel.pp > 1)
  joint.py            "uniform" encoder placement: every stage encodes a share of the step's items
  tensor_parallel.py  the backbone's decoder layers over the TP group (DeepSpeed's AutoTP)
  tp_encoders.py      the encoders under TP: each TP rank encodes a share, rows all-gathered
  expert_parallel.py  an MoE LLM's experts over ep ranks (DeepSpeed's AutoEP)
The pure planners these call (reshard, long_short, hdp, stages) and the groups are in
`ds_omni.parallel`. More: docs/architecture.md.
"""

from __future__ import annotations

from torch import nn

from ds_omni.model.attention import PackedAttention
from ds_omni.model.omni import OmniModel
from ds_omni.parallelize.embedding import EmbeddingRouter
from ds_omni.parallelize.encoder_pool import EncoderPool
from ds_omni.parallelize.expert_parallel import count_hf_experts
from ds_omni.parallelize.pipeline import PipelineSpec, build_pipeline_module
from ds_omni.parallelize.tensor_parallel import shard_backbone
from ds_omni.parallelize.tp_encoders import TPEncoders

__all__ = ["EmbeddingRouter", "PipelineSpec", "parallelize", "router_of"]


def parallelize(model: OmniModel, *, kernel: str | None = None, sp_group=None,
                blocks: dict | None = None, pool: EncoderPool | None = None,
                encoder_dummies: bool = True, pipeline: PipelineSpec | None = None,
                tp_group=None, llm_config=None,
                tp_encoders: TPEncoders | None = None) -> nn.Module:
    """Apply the plan to a built model; returns what DeepSpeed is given: the model itself, or
    under `pipeline` (parallel.pp > 1) this rank's stage of it (`build_pipeline_module`).

    `kernel`: the LLM's packed-attention kernel (None: the one the model was built with);
    `sp_group`: the LLM's Ulysses group (None: no static SP; the encoders keep theirs);
    `blocks`: per-sequence SP, (first rank, size) -> the group of every block this rank can be
    in; `pool`: the encoder pool (parallel.encoder_pool="dp"); `encoder_dummies`: whether every
    micro-batch runs every encoder, on a dummy where it has no item
    (`ds_omni.train.setup.encoder_dummies_needed`). The model gets an `EmbeddingRouter` holding
    them, and its backbone the attention with `sp_group`, counted in the router's `sp_counts`.
    `tp_group` (parallel.tp > 1): the backbone's decoder layers are split over it by DeepSpeed's
    AutoTP (`tensor_parallel.shard_backbone`, after `llm_config`'s tp plan); the encoders are
    not. What it did is the model's `tp_counts`. `tp_encoders`: the TP ranks of a row encode
    different items of it (`tp_encoders.py`): their encoder gradients are summed over the TP
    group by hooks put in here, before DeepSpeed sees the model, and every micro-batch runs
    every encoder (the hooks are collectives: every TP rank must reach every parameter).
    An MoE backbone's HF expert modules count their tokens (`count_hf_experts`, not on a
    pipeline stage: its stages hold different layers, and the counts are all-reduced).
    """
    kernel = kernel or model.backbone.attention.asked
    if tp_encoders is not None:
        encoder_dummies = True
        tp_encoders.sum_grads_over_tp(model.encoders)
    router = EmbeddingRouter(kernel=kernel, sp_group=sp_group, blocks=blocks, pool=pool,
                             encoder_dummies=encoder_dummies, tp_encoders=tp_encoders)
    model.backbone.attention = PackedAttention(kernel, sp_group, router.sp_counts)
    model.router = router
    if tp_group is not None:
        model.tp_counts = shard_backbone(model.backbone, tp_group, llm_config)
    if pipeline is None:
        count_hf_experts(model.backbone)  # the expert load of HF's MoE blocks (AutoEP counts its own)
        return model
    return build_pipeline_module(model, pipeline.plan, pipeline.stage_plan, pipeline.placement,
                                 pipeline.processors, pipeline.item_cost,
                                 encoder_dummies=encoder_dummies)


def router_of(module: nn.Module) -> EmbeddingRouter | None:
    """The router `parallelize` attached to `module` (None on a pipeline stage, whose module is
    not the model, and on a model the plan was not applied to)."""
    return getattr(module, "router", None)
