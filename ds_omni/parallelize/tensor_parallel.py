"""The LLM backbone tensor-parallel (parallel.tp) through DeepSpeed's AutoTP training layers.

`AutoTP` reads the backbone's HF `base_model_tp_plan` (q/k/v, gate/up column-parallel; o_proj,
down_proj row-parallel; Qwen3-VL's text model borrows Qwen3's, `PLAN_OF`) and swaps those
Linears for its training layers. The embedding, norms, LM head and encoders stay whole on each
rank; the encoders' work is split instead (`tp_encoders`).
ds_omni makes the engine's AutoTP calls itself, on the backbone alone with the plan's TP group,
and hands the engine `TensorParallelMpu`: the engine path would shard the encoders too and
replace the mpu with its own mesh. Head and embedding whole are exact with no extra collective.
GQA with fewer KV heads than tp leaves some ranks without an attention shard (exact, but attention
does not scale past the KV head count; `tp_beyond_kv_heads` says so). Sliding windows need
nothing here. More: docs/internals.md, "Tensor parallelism"; docs/parallelism.md,
"Tensor parallelism".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ds_omni.errors import ModelError

log = logging.getLogger(__name__)


@dataclass
class TPCounts:
    """What `shard_backbone` did: AutoTP layers in the backbone, by kind (the tests' proof that
    the mechanism ran)."""

    column: int = 0
    """`LinearLayer`s (column-parallel: q, k, v, gate, up)."""
    row: int = 0
    """`LinearAllreduce`s (row-parallel: o_proj, down_proj)."""


# LLM families whose HF plan misses what their decoder layers (another family's) need: that
# family's plan. transformers 5.24's Qwen3-VL text plan names `embed_tokens` alone; Qwen3-VL-MoE's
# leaves out the q/k norms, which see this rank's heads only (their grads must be summed over TP)
PLAN_OF = {"qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"}


def tp_plan_of(text_config, experts_apart: bool = False) -> dict[str, str]:
    """The LLM's HF tensor-parallel plan (its config's `base_model_tp_plan`, or for a `PLAN_OF`
    family the plan of the family it names), or {}.
    `experts_apart` (parallel.ep > 1): without its routed experts' entries, which AutoEP splits
    instead (`expert_folding`); DeepSpeed's TPPlanConverter rejects their styles
    ('packed_colwise', 'moe_tp_experts'), so the MoE families' plans convert only without them."""
    borrowed = PLAN_OF.get(getattr(text_config, "model_type", None))
    if borrowed:
        from transformers import CONFIG_MAPPING
        text_config = CONFIG_MAPPING[borrowed]
    plan = dict(getattr(text_config, "base_model_tp_plan", None) or {})
    return {k: v for k, v in plan.items() if ".experts" not in k} if experts_apart else plan


def check_tensor_parallel(text_config, tp: int, where: str, experts_apart: bool = False) -> None:
    """parallel.tp can shard this LLM: its family has a tp plan DeepSpeed converts (without the
    routed experts' entries under `experts_apart`, parallel.ep > 1), and tp divides its
    attention heads and MLP width. `where` names the part (e.g. "model.llm").
    No process group, no model: called by `plan_run` before anything is launched."""
    model_type = getattr(text_config, "model_type", "?")
    plan = tp_plan_of(text_config, experts_apart)
    if not plan:
        raise ModelError(f"parallel.tp={tp}: {where} ({model_type}) has no HuggingFace "
                         "tensor-parallel plan (`base_model_tp_plan`), so DeepSpeed's AutoTP "
                         "cannot tell which projections to split; set parallel.tp to 1 "
                         "(parallel.pp or ZeRO-3 spread its parameters instead)")
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    try:
        specs = TPPlanConverter.convert(plan)
    except ValueError as e:
        raise ModelError(f"parallel.tp={tp}: DeepSpeed's AutoTP cannot shard {where} "
                         f"({model_type}): {e}; set parallel.tp to 1") from None
    kinds = {spec.partition_type.value for spec in specs}
    if not {"column", "row"} <= kinds:  # e.g. LFM2's plan names its embedding only
        raise ModelError(f"parallel.tp={tp}: the HuggingFace tensor-parallel plan of {where} "
                         f"({model_type}) splits no column- and row-parallel projection pair "
                         f"({sorted(plan)}), so DeepSpeed's AutoTP would leave its layers whole; "
                         "set parallel.tp to 1 (parallel.pp or ZeRO-3 spread its parameters "
                         "instead)")
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    width = getattr(text_config, "intermediate_size", None)
    ok = [d for d in range(1, heads + 1) if heads % d == 0 and (not width or width % d == 0)]
    if tp not in ok:
        raise ModelError(f"parallel.tp={tp} must divide the LLM's attention heads and MLP width: "
                         f"{where} ({model_type}) has {heads} query heads, {kv_heads} key/value "
                         f"heads and an MLP of {width}; tp can be one of {ok}")


def tp_beyond_kv_heads(text_config, tp: int) -> str | None:
    """The warning for a tp above the LLM's key/value heads, or None. Said once by what plans
    a run (`ds_omni.train.setup.say_tp_warning`, the simulator's entry points), not by
    `check_tensor_parallel`, which the plan search runs for every candidate."""
    kv_heads = (getattr(text_config, "num_key_value_heads", None)
                or text_config.num_attention_heads)
    if kv_heads >= tp:
        return None
    return (f"parallel.tp={tp} exceeds the LLM's {kv_heads} key/value heads: DeepSpeed's AutoTP "
            f"gives the attention to the first {kv_heads} tensor-parallel ranks only (exact, but "
            "attention time does not scale past that)")


def shard_backbone(backbone: nn.Module, tp_group, text_config,
                   experts_apart: bool = False) -> TPCounts:
    """Split the backbone's decoder-layer projections over `tp_group` with DeepSpeed's AutoTP
    (training mode), in place; its other modules stay whole (under `experts_apart`, the routed
    experts too: AutoEP's, `expert_folding`). Every rank of the group calls it with the same
    (whole) weights."""
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.module_inject.layers import set_autotp_mode
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    set_autotp_mode(training=True)
    tp = torch.distributed.get_world_size(tp_group)
    specs = TPPlanConverter.convert(tp_plan_of(text_config, experts_apart))
    autotp = AutoTP(module=backbone, all_reduce_linears=(), prefix="", state_dict=None,
                    linear_layer_setting=(nn.Linear, nn.Embedding), orig_layer_impl=None,
                    partition_config=AutoTPConfig(tp_size=tp, layer_specs=specs),
                    model_config=text_config, training_mode=True)
    # In training mode `set_tensor_parallel_config` ignores its arguments and reads DeepSpeed's
    # module-global TP group (the engine path sets it); ds_omni keeps groups out of globals and
    # hands AutoTP the plan's group directly.
    autotp.mp_group, autotp.mp_size = tp_group, tp
    autotp.update_linear_policies()
    autotp._replace_module(backbone)
    # `replicated_with_grad_allreduce` parameters (Qwen3's and Qwen3.5's q/k norms, which see
    # this rank's heads only): their gradients summed over the TP group
    autotp.register_replicated_grad_hooks(backbone)
    counts = tp_counts(backbone)
    if not counts.column or not counts.row:
        raise ModelError(f"parallel.tp={tp}: DeepSpeed's AutoTP found no projections to split "
                         f"in the {getattr(text_config, 'model_type', '?')} backbone from its "
                         "tp plan; set parallel.tp to 1")
    return counts


def tp_counts(module: nn.Module) -> TPCounts:
    """AutoTP's layers in `module`, by kind."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    counts = TPCounts()
    for m in module.modules():
        if isinstance(m, LinearAllreduce):
            counts.row += 1
        elif isinstance(m, LinearLayer):
            counts.column += 1
    return counts


def gather_tp(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (a parameter name of `module` -> that parameter's local value, or its gradient)
    with every AutoTP shard made whole: gathered over its layer's TP group along the dim the
    layer split (uneven splits too); the rest as they are. Every rank of the group calls it."""
    out = dict(tensors)
    for name, layer in module.named_modules():
        dims = _split_dims(layer)
        for leaf, dim in dims.items():
            key = f"{name}.{leaf}" if name else leaf
            if key in out and dim is not None:
                # the layer's own gather (it knows the uneven split it made)
                out[key] = layer._all_gather_shards(out[key].contiguous(),
                                                    layer._partition_sizes, dim)
    return out


def tp_layout(module: nn.Module) -> dict[str, dict]:
    """{parameter name: {"dim": split dim, "sizes": each TP rank's width}} of every split
    parameter of `module` (what the HF export needs to make a TP checkpoint whole,
    `ds_omni.model.tp_files`)."""
    out = {}
    for name, layer in module.named_modules():
        for leaf, dim in _split_dims(layer).items():
            if dim is not None and getattr(layer, leaf, None) is not None:
                out[f"{name}.{leaf}" if name else leaf] = {"dim": dim,
                                                           "sizes": list(layer._partition_sizes)}
    return out


def tp_cuts(module: nn.Module) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """{parameter name: (split dim, each TP rank's width, this rank's index)} of every split
    parameter of `module`: how AutoTP cut it from the whole, what `tp_piece` cuts again (the
    optimizer's moments on a resume on another plan, `ds_omni.train.moments`)."""
    out = {}
    for name, layer in module.named_modules():
        for leaf, dim in _split_dims(layer).items():
            if dim is not None and getattr(layer, leaf, None) is not None:
                out[f"{name}.{leaf}" if name else leaf] = (dim, tuple(layer._partition_sizes),
                                                           layer.tp_index)
    return out


def tp_piece(whole: torch.Tensor, cut: tuple[int, tuple[int, ...], int]) -> torch.Tensor:
    """This rank's shard of `whole` by `cut` (`tp_cuts`): AutoTP's own split (its layers'
    `uneven_partition`), the inverse of `gather_tp` and of the export's `merge_tp`."""
    dim, sizes, index = cut
    return whole.split(list(sizes), dim=dim)[index]


def _split_dims(layer: nn.Module) -> dict[str, int | None]:
    """{"weight": dim, "bias": dim or None (whole)} for an AutoTP layer; {} otherwise."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    if isinstance(layer, LinearAllreduce):  # rows of the input split; the bias is whole
        return {"weight": 1, "bias": None}
    if isinstance(layer, LinearLayer):  # output features split, the bias with them
        return {"weight": 0, "bias": 0}
    return {}


def check_tp_with_sp(text_config, tp: int, sp: int, where: str,
                     axis: str = "parallel.sp") -> None:
    """parallel.tp x parallel.sp can run this LLM: each TP rank holds heads / tp query heads and
    kv / tp key-value heads, which its Ulysses all-to-all splits again over the sp ranks. So
    tp x sp must divide the query heads, and tp the key-value heads (AutoTP would give ranks
    past the KV head count no heads at all, and an uneven split different head counts per TP
    rank, neither of which Ulysses can split); kv / tp below (or not a multiple of) sp is
    fine: the kernel repeats the local KV heads, as it does under sp alone (`repeat_kv_for_sp`).
    No process group: called by `plan_run` before anything is launched. `axis`: how the error
    names the Ulysses degree (parallel.max_sequence_sp: the largest per-sequence block)."""
    model_type = getattr(text_config, "model_type", "?")
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % (tp * sp) == 0 and kv_heads % tp == 0:
        if (kv_heads // tp) % sp:
            log.info("parallel.tp=%d x sp=%d: each TP rank's %d key/value heads are repeated "
                     "for its %d Ulysses ranks (%s has %d)", tp, sp, kv_heads // tp, sp, where,
                     kv_heads)
        return
    ok = [(t, s) for t in range(1, heads + 1) for s in range(1, heads + 1)
          if heads % (t * s) == 0 and kv_heads % t == 0 and t * s <= heads and t > 1 and s > 1]
    raise ModelError(
        f"parallel.tp={tp} x {axis}={sp}: {where} ({model_type}) has {heads} query heads "
        f"and {kv_heads} key/value heads; each TP rank holds heads / tp of them and Ulysses "
        "splits those again over sp, so tp x sp must divide the query heads and tp the "
        f"key/value heads. (tp, sp) can be one of {ok or 'none: use tp or sp alone'}")
