"""The LLM backbone over pipeline stages, on DeepSpeed's pipeline engine (`PipelineModule`).

The pipeline's layers are the OmniModel's own modules, wrapped to pass tuples of tensors:
    EmbedStage    (index [1], position_ids, cu_seqlens) -> (hidden [1, T, D], position_ids,
                                                          cu_seqlens, index, *carried)
    DecoderStage  (hidden, position_ids, cu_seqlens, index, *carried) -> the same
    HeadStage     (the same) -> scaled sum of token losses
carried: deepstack levels (`pipeline_deepstack`), an MoE LLM's aux statistics (`pipeline_moe`).
Only `hidden`, the levels and aux probabilities get a gradient; lengths vary (`dynamic_shape`).
Encoder inputs stay out of the engine: `StepInputs` holds the step's micro-batches, by index. The
loss is made inside the last stage (`loss_fn` None): under bf16 DeepSpeed zeroes gradients made
after the module's output. `StepInputs.scale` undoes the engine's averaging.
More: docs/internals.md, "Pipeline"; docs/parallelism.md, "Pipeline parallelism".

Dims: T packed tokens of a micro-batch, D LLM hidden size, n samples in the row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ds_omni.batch import IGNORE_INDEX
from ds_omni.errors import LaunchError, ModelError
from ds_omni.model.layer_files import pipeline_prefixes
from ds_omni.model.omni import OmniModel, summed_token_loss
from ds_omni.parallelize.joint import EncoderShards, EncodeShare, JointEncoding, plan_joint
from ds_omni.parallelize.pipeline_deepstack import DeepstackCarry
from ds_omni.parallelize.pipeline_moe import AuxCarry
from ds_omni.parallelize.pipe_grid import mark_norm_owners, pipe_topology
from ds_omni.parallelize.tensor_parallel import tp_counts
from ds_omni.parallel.bubbles import rank_stage_time
from ds_omni.parallel.stages import StagePlan, check_stages, stage_plan_for


TIED = ("the LLM ties its LM head to its token embedding (tie_word_embeddings), which would put "
        "one weight on the first and the last pipeline stage; this version does not support that: "
        "set parallel.pp to 1 or use an LLM with tie_word_embeddings=false")


class StepInputs:
    """The micro-batches of the step being trained (on the device), which the first stage reads
    its encoder inputs and token ids from and the last its targets, under "uniform" placement the
    step's `JointEncoding` (the rows every stage encoded), and the loss's `scale` (module
    docstring); set before each `train_batch`. The last stage keeps each micro-batch's unscaled
    loss sum in `sums`, for the step's reported loss."""

    def __init__(self):
        self.batches: list = []
        self.joint: JointEncoding | None = None
        self.scale = 1.0
        self.sums: list[torch.Tensor] = []
        self.aux_carry = AuxCarry(None)  # an MoE LLM's aux statistics (`pipeline_layers` sets)
        self.deep_carry = DeepstackCarry((), 0)  # deepstack levels (`pipeline_layers` sets)


class EmbedStage(nn.Module):
    """Token embeddings with encoder outputs in place of their placeholders, and the deepstack
    levels (`OmniModel.embed_deepstack`).

    It registers the modules `embed` uses, so their parameters belong to the first stage.
    """

    def __init__(self, model: OmniModel, step_inputs: StepInputs):
        super().__init__()
        self.embed_tokens = model.backbone.embed_tokens
        self.encoders = model.encoders
        object.__setattr__(self, "omni", model)  # not a submodule: its layers live on other stages
        object.__setattr__(self, "step_inputs", step_inputs)
        self.aux, self.deep = step_inputs.aux_carry, step_inputs.deep_carry

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        index, position_ids, cu_seqlens = inputs
        micro = int(index[0])
        batch, joint = self.step_inputs.batches[micro], self.step_inputs.joint
        if joint is None:  # "stage0": encode here
            hidden, deep = self.omni.embed_deepstack(batch)  # [1, T, D], levels or None
        else:
            rows = {name: joint.rows_for(micro, name) for name in self.encoders}
            if batch.route.reshard is not None:  # an SP shard: the rows of its items, resharded
                hidden, deep = self.omni.router.embed_shard(self.omni, batch, encoded=rows)
            else:
                hidden, deep = self.omni.embed_rows(
                    batch, {k: v for k, v in rows.items() if v is not None})
        # what `Backbone.forward` does first (Granite's embedding multiplier)
        return (self.omni.backbone.scale_embeddings(hidden), position_ids, cu_seqlens, index,
                *self.deep.start(deep, hidden), *self.aux.start(cu_seqlens, hidden.device))


class DecoderStage(nn.Module):
    """One LLM decoder layer over the packed row it receives."""

    def __init__(self, model: OmniModel, index: int, aux: AuxCarry | None = None,
                 deep: DeepstackCarry | None = None):
        super().__init__()
        self.aux = aux or AuxCarry(None)  # an MoE LLM's aux statistics (`pipeline_moe`)
        self.deep = deep or DeepstackCarry((), 0)  # deepstack levels (`pipeline_deepstack`)
        self.index = index
        backbone = model.backbone
        self.layer = backbone.layers[index]
        self.rotary_emb = backbone.rotary_emb  # no parameters; registered: it moves with the stage
        object.__setattr__(self, "backbone", backbone)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, position_ids, cu_seqlens, index, *carry = inputs
        deep, carry = self.deep.split(self.index, carry)
        hidden = self.deep.add_before(hidden, self.index, deep)
        # the longest sample, from the boundaries (a host read on a GPU, once per layer and row)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        kwargs = self.backbone.layer_kwargs(hidden, position_ids, cu_seqlens.cpu(), max_seqlen)
        with self.aux.through(self.layer, carry, cu_seqlens) as carried:
            hidden = self.backbone.run_layer(self.layer, hidden, kwargs)
        return (hidden, position_ids, cu_seqlens, index, *self.deep.passed_on(self.index, deep),
                *carried)


class HeadStage(nn.Module):
    """The final norm, the LM head (on the target positions only, with the backbone's logit
    rule: `Backbone.head`) and the loss: the micro-batch's summed token loss times
    `StepInputs.scale`. Made here, inside the stage's layers, not in the engine's `loss_fn`:
    the module docstring says why."""

    def __init__(self, model: OmniModel, step_inputs: StepInputs):
        super().__init__()
        self.norm = model.backbone.norm
        self.lm_head = model.backbone.lm_head
        self.logit_rule = model.backbone.logit_rule
        object.__setattr__(self, "step_inputs", step_inputs)
        self.aux, self.deep = step_inputs.aux_carry, step_inputs.deep_carry
        self.index = len(model.backbone.layers)  # deepstack levels aimed here: before the norm

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logit_rule.head(self.lm_head, hidden)

    def loss_sum(self, normed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed token loss of normed hidden states [1, T, D] against targets [1, T]."""
        keep = (targets[0] != IGNORE_INDEX).nonzero().squeeze(1)  # [n]
        return summed_token_loss(self.logits, normed, targets, keep)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _, cu_seqlens, index, *carry = inputs
        deep, carry = self.deep.split(self.index, carry)
        hidden = self.deep.add_before(hidden, self.index, deep)
        batch = self.step_inputs.batches[int(index[0])]
        loss_sum = (self.loss_sum(self.norm(hidden), batch.targets)
                    + self.aux.loss(carry, cu_seqlens, (batch.host or batch).targets))
        self.step_inputs.sums.append(loss_sum.detach())
        return loss_sum * self.step_inputs.scale


def pipeline_layers(model: OmniModel, step_inputs: StepInputs) -> list[nn.Module]:
    """[embedding, decoder layers..., head (with the loss)]."""
    backbone = model.backbone
    extra = model.family.layer_inputs(torch.zeros(1, 1, dtype=torch.long))
    if extra:
        raise ModelError(f"{model.family.name}'s decoder layers also take {sorted(extra)} per "
                         "token (ERNIE-4.5-VL routes image tokens to its vision experts by them), "
                         "which the pipeline stages do not carry; set parallel.pp to 1 (ZeRO and "
                         "sequence parallelism carry them)")
    if backbone.lm_head.weight is backbone.embed_tokens.weight:
        raise ModelError(TIED)
    if model.family.bidirectional:
        raise ModelError(f"{model.family.name}'s LLM lets some tokens attend both ways "
                         f"({model.family.bidirectional}), a mask the pipeline stages do not "
                         "carry yet; set parallel.pp to 1 (ZeRO and sequence parallelism keep it)")
    step_inputs.aux_carry = AuxCarry(  # the plan's router is attached after the stages
        backbone.router_aux, lambda: getattr(getattr(model, "router", None), "sp_group", None))
    step_inputs.deep_carry = DeepstackCarry(model.deepstack_layers, len(backbone.layers))
    layers = [EmbedStage(model, step_inputs)]
    layers += [DecoderStage(model, i, step_inputs.aux_carry, step_inputs.deep_carry)
               for i in range(len(backbone.layers))]
    return layers + [HeadStage(model, step_inputs)]


def layer_param_counts(model: OmniModel) -> tuple[list[int], int]:
    """Trainable parameters of each pipeline layer [L + 2], the encoders left out of the
    embedding layer, and the encoders' own (what `parallel.stage_split="parameters"` balances)."""
    layers = pipeline_layers(model, StepInputs())
    encoder = {id(p) for p in model.encoders.parameters()}
    counts = [sum(p.numel() for p in layer.parameters() if p.requires_grad and id(p) not in encoder)
              for layer in layers]
    return counts, sum(p.numel() for p in model.encoders.parameters() if p.requires_grad)


class JointSetup:
    """What a step needs to run "uniform" placement on this rank (`ds_omni.parallelize.joint`)."""

    def __init__(self, model: OmniModel, processors: dict, item_cost, stage: int, stages: int,
                 group, encoder_dummies: bool = False):
        self.model, self.encoders = model, model.encoders
        self.encoder_dummies = encoder_dummies  # `EmbeddingRouter.encoder_dummies`
        self.processors, self.item_cost = processors, item_cost
        self.stage, self.stages, self.group = stage, stages, group
        # an item's rows [n, (1 + k) D]: the embedding and its k deepstack levels side by side
        self.hidden = (1 + model.deepstack) * model.backbone.embed_tokens.embedding_dim
        self.params = [p for p in model.encoders.parameters() if p.requires_grad]
        self.shards = EncoderShards(self.params, stage, stages, group)

    def start(self, micro_batches: list, device) -> JointEncoding:
        """Plan the step's items, encode this stage's share, send the rows to stage 0."""
        shares = [EncodeShare(mb) for mb in micro_batches]
        plan = plan_joint([share.items for share in shares], self.item_cost, self.stages)
        dtype = self.encoders_dtype()
        joint = JointEncoding(plan, self.stage, self.group, self.hidden, device, dtype)
        joint.encode(self.encoders, shares, self.processors, self.encoder_dummies)
        return joint

    def bind(self, engine) -> None:
        """What the placement needs of the engine before a step (nothing, under "uniform")."""

    def encoders_dtype(self) -> torch.dtype:
        return next(self.encoders.parameters()).dtype

    def sync_replicas(self) -> None:
        """Every stage's encoders from stage 0's (after loading a checkpoint: DeepSpeed saves a
        stage's layers, and the encoders are a layer of stage 0 only)."""
        src = dist.get_global_rank(self.group, 0)
        for p in self.encoders.parameters():
            dist.broadcast(p.data, src=src, group=self.group)

    def finish(self, joint: JointEncoding) -> None:
        """After stage 0's last backward: the encoders' backward and the sum of their gradients
        over the pipeline's ranks onto each parameter's owner (every rank of the pipeline calls
        this)."""
        joint.backward()
        fill_missing_grads(self.params)  # an encoder with no item here, or off the path
        self.shards.reduce_grads()

    def mark_replicas(self) -> None:
        """DeepSpeed's gradient norm counts a parameter on a stage other than the first only if
        it is `model_parallel`, and skips it anywhere if `ds_pipe_replicated` (ZeRO-1): an owned
        encoder parameter counts on its owner, a replica nowhere."""
        owned = {id(p) for p in self.shards.owned}
        for p in self.encoders.parameters():
            p.model_parallel = id(p) in owned
            p.ds_pipe_replicated = id(p) not in owned


def optimizer_params(module) -> list[nn.Parameter]:
    """The parameters this rank's optimizer holds: the trainable ones, but under "uniform"
    placement not the encoder parameters another stage owns (`EncoderShards`)."""
    joint = getattr(module, "joint", None)
    replicas = {id(p) for p in joint.shards.replicas} if joint is not None else set()
    return [p for p in module.parameters() if p.requires_grad and id(p) not in replicas]


def fill_missing_grads(params) -> None:
    """A zero gradient for each of `params` that has none: what a zero-weight dummy pass would
    have given it, so every rank reduces the same parameters (DeepSpeed's ZeRO-0/1 reduce, in
    parameter order, only those that have a gradient)."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


@contextlib.contextmanager
def late_grads_to_master(optimizer):
    """Gradients made inside the block, after the engine's last backward (the encoders' under
    "uniform" placement, `JointSetup.finish`), reach the fp32 gradients the optimizer steps with.

    Under bf16 at ZeRO-0 the pipeline engine steps with DeepSpeed's `BF16_Optimizer`, which adds
    each parameter's bf16 gradient into its fp32 one at the end of every backward pass and never
    again: gradients made later would be dropped (the encoders would not train). The bf16
    gradients, already added by then, are zeroed first, so that adding them all once more after
    the block adds only what the block made. Other optimizers read `.grad` at the reduction and
    need nothing here.
    """
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    if not isinstance(optimizer, BF16_Optimizer):
        yield
        return
    optimizer.clear_lp_grads()
    yield
    optimizer.update_hp_grads(clear_lp_grads=False)


@dataclass(frozen=True)
class PipelineSpec:
    """What `build_pipeline_module` needs of the plan under parallel.pp > 1 (`parallelize`)."""

    plan: object  # the `ParallelPlan`: pp x dp ranks
    stage_plan: StagePlan  # where the stages split the pipeline's layers
    placement: str = "stage0"  # parallel.encoder_placement
    processors: dict | None = None  # the item processors ("uniform": each stage encodes a share)
    item_cost: Callable | None = None  # (encoder, item) -> modelled cost ("uniform")


def build_pipeline_module(model: OmniModel, plan, stage_plan: StagePlan, placement: str = "stage0",
                          processors: dict | None = None, item_cost=None,
                          encoder_dummies: bool = False, pool=None):
    """The `PipelineModule` of this rank's stage, split at `stage_plan.parts`; its `step_inputs`
    is the `StepInputs` the step fills, its `joint` the `JointSetup` under "uniform" placement
    (else None), its `pool` the `EncoderPool` where this stage encodes (else None). It has no
    `loss_fn`: the last stage's layers make the loss (module docstring)."""
    from deepspeed.pipe import PipelineModule
    step_inputs = StepInputs()
    layers = pipeline_layers(model, step_inputs)
    if stage_plan.parts[-1] != len(layers):
        raise ModelError(f"the stage plan splits {stage_plan.parts[-1]} layers but the pipeline "
                         f"has {len(layers)}")

    class CostSplitModule(PipelineModule):
        """DeepSpeed's PipelineModule, split where ds_omni's cost model says."""

        def _partition_layers(self, method="uniform"):
            self.parts = list(stage_plan.parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        def whole_model_shapes(self) -> dict[str, list[int]]:
            """Every stage's parameter shapes by pipeline name (layer index first): the same
            on every rank, so a checkpoint's fingerprint describes the whole run."""
            return {f"{i}.{n}": list(p.shape) for i, layer in enumerate(self._layer_specs)
                    for n, p in layer.named_parameters()}

    # ranks as the ParallelPlan numbers them: pipe, data (dp x sp), model (tp) (`pipe_grid`)
    module = CostSplitModule(layers=layers, topology=pipe_topology(plan), loss_fn=None,
                             partition_method="ds_omni", dynamic_shape=True)
    module.step_inputs = step_inputs
    module.family = model.family  # what checkpoints record
    module.omni_prefixes = pipeline_prefixes(model)  # its names -> the OmniModel's (`omni_key`)
    # DeepSpeed's ZeRO-0 clipping (runtime.utils.clip_grad_norm_) counts a parameter of a stage
    # other than the first only if it is marked model-parallel: without this, the gradient norm
    # would hold stage 0's gradients alone
    for p in module.parameters():
        p.model_parallel = True
    from ds_omni.parallelize import bubble_schedule  # its instructions import DeepSpeed
    module.joint = None
    module.clock = bubble_schedule.StageClock()  # bubble_fraction, every placement
    # the pool places each stage's items over its dp x sp ranks where the stage encodes
    module.pool = pool if placement in ("uniform", "bubbles") or module.stage_id == 0 else None
    if placement in ("uniform", "bubbles"):
        stage = module.stage_id
        if stage != 0:  # every stage holds the encoders; each parameter's owner steps it
            module.add_module("joint_encoders", model.encoders)
            model.encoders.to(next(module.parameters()).device)
        module.joint = JointSetup(model, processors, item_cost, stage, plan.pp,
                                  module._grid.get_pipe_parallel_group(), encoder_dummies)
        module.joint.mark_replicas()
        if placement == "bubbles":  # the encoders' work inside the schedule's idle slots
            module.joint = bubble_schedule.BubbleSetup(
                module.joint, rank_stage_time(stage_plan.layer_time, plan.sp, plan.tp),
                module.clock)
    if plan.tp_enabled:  # the stage's decoder layers hold AutoTP's layers (`shard_backbone`)
        module.tp_counts = tp_counts(module)
        mark_norm_owners(module, module._grid.get_slice_parallel_rank())
    return module


def stage_plan(cfg, built, plan, cost, split: str | None = None) -> StagePlan:
    """Pipeline stage boundaries by `split` (default `parallel.stage_split`), and each stage's
    predicted time for a typical micro-batch (micro_batch_size samples of `stage_tokens` tokens,
    one item per encoder each), from the loader's cost model."""
    split = split or cfg.parallel.stage_split
    layer_params, encoder_params = (layer_param_counts(built.model) if split == "parameters"
                                    else (None, 0))
    placement = cfg.parallel.encoder_placement
    return stage_plan_for(cost, plan.pp, "uniform" if placement == "auto" else placement,
                          cfg.train.micro_batch_size, stage_tokens(cfg), split=split,
                          layer_params=layer_params, encoder_params=encoder_params)


def stage_tokens(cfg) -> int:
    """Tokens of the typical sample the stage boundaries are planned for."""
    return cfg.parallel.stage_tokens or cfg.data.max_seq_len


def pipeline_spec_for(cfg, built, plan, cost, item_cost: Callable) -> PipelineSpec | None:
    """What `build_pipeline_module` needs under parallel.pp > 1, split where the cost model
    says, the placement "auto" resolved (`resolved_placement`); None without a pipeline."""
    if not plan.pp_enabled:
        return None
    stages = stage_plan(cfg, built, plan, cost)
    return PipelineSpec(plan, stages, resolved_placement(cfg, plan, cost, stages),
                        built.item_processors, item_cost)


def resolved_placement(cfg, plan, cost, stages: StagePlan) -> str:
    """parallel.encoder_placement, "auto" resolved by the cost model's model of a typical step
    of the data's mix on one pipeline (`typical_step`; `ds_omni.parallel.bubbles.auto_placement`:
    "bubbles" where it predicts a gain beyond its margin, its calls and messages priced)."""
    placement = cfg.parallel.encoder_placement
    if placement != "auto":
        return placement
    from ds_omni.parallel.bubbles import auto_placement
    return auto_placement(cost, *typical_step(cfg, plan, cost, stages))


def typical_step(cfg, plan, cost, stages: StagePlan) -> tuple:
    """(a rank's stage times, micro-batches, samples a micro-batch, items a sample by encoder,
    call overhead) of one pipeline's typical step, what "auto" and `ds-omni plan` model: the
    data's mix (`data.typical`), a pipeline's share of it (an SP shard's, or under the pool a
    pool rank's: 1/sp of a row's items on average; every TP rank encodes them all), the stages
    split over sp x tp (`rank_stage_time`); the resharding or pool all-to-all runs in stage 0's
    forward under both placements, so it is left out. Overhead: this project's calibrated CPU
    one where no GPU is visible (none calibrated on GPUs: 0)."""
    from ds_omni.data.typical import encoder_items_per_sample
    from ds_omni.parallel.bubbles import CPU_OVERHEAD, CallOverhead
    micro = max(cfg.train.global_batch_size // (cfg.train.micro_batch_size * plan.dp), 1)
    items = encoder_items_per_sample(cfg.data, list(cost.dims.encoders))
    overhead = CallOverhead() if torch.cuda.is_available() else CPU_OVERHEAD
    return (rank_stage_time(stages.layer_time, plan.sp, plan.tp), micro,
            cfg.train.micro_batch_size, {k: v / plan.sp for k, v in items.items()}, overhead)


def engine_inputs(micro_batches: list) -> list[tuple]:
    """What the engine's data iterator yields per micro-batch: ((index, position_ids, cu_seqlens),
    no labels). The first stage reads the inputs; the last finds the targets by the index it
    receives (`HeadStage`), so there are no labels for the engine to load."""
    return [((torch.tensor([i]), mb.position_ids, mb.cu_seqlens), None)
            for i, mb in enumerate(micro_batches)]


def around_instructions(engine, wraps: dict) -> None:
    """Make the engine's pipeline instructions of the types in `wraps` (e.g. `OptimizerStep`:
    the end of `train_batch`, every backward done and gradients reduced) call
    `wrap(engine, run)`, where `run()` executes the original instruction."""
    # the class's map, or the one a placement installed with its own instructions
    cls_map = engine.__dict__.get("_ds_omni_instructions", type(engine)._INSTRUCTION_MAP)

    def wrapped(kind, wrap):
        original = cls_map[kind]
        return lambda self, *args, **kwargs: wrap(self, lambda: original(self, *args, **kwargs))

    # the engine looks instructions up on itself: this instance's map shadows the class's
    engine._INSTRUCTION_MAP = {**cls_map, **{k: wrapped(k, w) for k, w in wraps.items()}}


def is_pipeline(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return isinstance(engine, PipelineEngine)



def check_pipeline(cfg, ds_config: dict, llm_config) -> None:
    """What parallel.pp > 1 cannot run with besides the other features (those are
    `ds_omni.config.composition`'s table), said before any process group exists (`llm_config`:
    the LLM's HF config)."""
    pp = cfg.parallel.pp
    check_stages(llm_config.num_hidden_layers, pp)
    if getattr(llm_config, "tie_word_embeddings", False):
        raise LaunchError(TIED)
    if (cfg.parallel.encoder_placement in ("uniform", "bubbles")
            and ds_config.get("bf16", {}).get("immediate_grad_update", False)):
        raise LaunchError("bf16.immediate_grad_update with parallel.encoder_placement \"uniform\": "
                          "DeepSpeed then moves each gradient into fp32 as it is made, before the "
                          "encoders' gradients are summed over the pipeline's stages; remove "
                          "immediate_grad_update from the DeepSpeed config (or use \"stage0\")")
    unsupported = {"data.reorder.mode \"budget\" (its micro-batch count varies per rank; the "
                   "pipeline schedule runs a fixed number)": cfg.data.reorder.mode == "budget"}
    for what, used in unsupported.items():
        if used:
            raise LaunchError(f"parallel.pp={pp}: {what} is not available with the pipeline engine "
                              "in this version; turn it off or set parallel.pp to 1")
