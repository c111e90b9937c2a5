"""Expert parallelism for an MoE LLM backbone (parallel.ep): DeepSpeed's AutoEP, HF's semantics.

AutoEP swaps each HF MoE block inside `deepspeed.initialize` for an `AutoEPMoELayer`: HF's router
gate, this rank's 1/ep of the experts as grouped tensors, HF's shared experts; tokens reach their
experts by uneven all-to-alls. Where AutoEP departs from HF, ds_omni: writes the router's settings
from the LLM's own config (`autoep_section`: top_k, `norm_topk_prob`, softmax, scale 1), names
the backbone's layers in `moe_layer_pattern` (so no encoder is touched), computes the auxiliary
loss itself (`ds_omni.model.moe_aux`), refuses router jitter and DeepSeek-style routers
(`OTHER_ROUTERS`), and gathers the experts back into HF's layout (`hf_expert_state`).
More: docs/parallelism.md, "Expert parallelism".
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from ds_omni.errors import ConfigError
from ds_omni.model.expert_checkpoint import hf_shared_expert_key

# Text configs that carry the same MoE block as a preset's family but another model_type.
# Qwen3-VL-MoE's text model has Qwen3-MoE's block (router `gate`, fused `experts`, softmax top-k).
EXTRA_MODEL_TYPES = {"qwen3_vl_moe_text": "qwen3_moe", "qwen3_vl_moe": "qwen3_moe"}
MOE_LAYERS = r"backbone\.layers\.\d+\.mlp"  # the backbone's MoE blocks, by OmniModel name
STAGE_MOE_LAYERS = r"\d+\.layer\.mlp"  # the same in a pipeline stage (`pipeline.DecoderStage`)
# AutoEP presets whose HF router is not softmax top-k at scale 1, what `autoep_section` writes:
# refused rather than routed otherwise than HF's model
OTHER_ROUTERS = {
    "deepseek_v2": "by softmax scores scaled by routed_scaling_factor, group-limited top-k where "
                   "its topk_method says so",
    "deepseek_v3": "by sigmoid scores with a correction bias (e_score_correction_bias), "
                   "group-limited top-k and routed_scaling_factor",
}


def autoep_preset(model_type: str) -> str:
    """The AutoEP preset for an LLM's model_type, or a ConfigError naming the presets."""
    from deepspeed.module_inject.auto_ep_presets.registry import (available_preset_names,
                                                                  preset_name_for_hf_model_type)
    name = preset_name_for_hf_model_type(model_type) or EXTRA_MODEL_TYPES.get(model_type)
    if name is None:
        raise ConfigError(
            f"parallel.ep > 1 needs an MoE LLM whose family DeepSpeed's AutoEP has a preset for; "
            f"the LLM's model_type {model_type!r} has none. AutoEP's presets: "
            f"{', '.join(available_preset_names())} (plus {', '.join(sorted(EXTRA_MODEL_TYPES))} "
            "through qwen3_moe's); set parallel.ep to 1 for this model")
    return name


def autoep_section(llm_config, ep: int, pipeline: bool = False) -> dict:
    """The DeepSpeed config's `expert_parallel` section for `ep`, with the router's settings
    read from the LLM's HF config (`llm_config`, the text config) so AutoEP keeps HF's router;
    `pipeline`: the MoE blocks named as a pipeline stage names them (parallel.pp > 1)."""
    preset = autoep_preset(llm_config.model_type)
    experts = getattr(llm_config, "num_experts", None) or getattr(llm_config, "num_local_experts")
    if experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the LLM's {experts} experts: each "
                          f"expert-parallel rank holds experts / ep of them; choose an ep that "
                          f"divides {experts}")
    if preset in OTHER_ROUTERS:
        raise ConfigError(f"parallel.ep={ep}: the LLM ({llm_config.model_type}) routes tokens "
                          f"{OTHER_ROUTERS[preset]}, while ds_omni configures AutoEP's router as "
                          "softmax top-k with a route scale of 1 (HF's router in qwen3_moe, "
                          "Qwen3-VL-MoE's text model, qwen3_5_moe and mixtral), so it would "
                          "train other numbers than HF's model; set parallel.ep to 1 for it")
    if getattr(llm_config, "router_jitter_noise", 0.0):
        raise ConfigError(f"the LLM config sets router_jitter_noise="
                          f"{llm_config.router_jitter_noise}, which DeepSpeed's AutoEP does not "
                          "implement (its router would differ from HF's); set it to 0 or "
                          "parallel.ep to 1")
    return {"enabled": True, "autoep_size": ep, "preset_model": preset,
            "moe_layer_pattern": STAGE_MOE_LAYERS if pipeline else MOE_LAYERS,
            "top_k": int(llm_config.num_experts_per_tok),
            "route_norm": route_norm(llm_config, preset),
            "score_func": "softmax", "route_scale": 1.0}


def route_norm(llm_config, preset: str) -> bool:
    """Whether HF's router renormalises the top-k weights: `norm_topk_prob` where the config has
    it (Qwen3-MoE: default False, where AutoEP's qwen3_moe preset says True), else what the
    family's HF router always does, which is its preset's (Qwen3-VL-MoE and Mixtral normalise)."""
    from deepspeed.module_inject.auto_ep_presets.registry import get_preset
    if hasattr(llm_config, "norm_topk_prob"):
        return bool(llm_config.norm_topk_prob)
    return get_preset(preset).route_norm


def autoep_layers(module: nn.Module) -> dict[str, nn.Module]:
    """name -> AutoEP's MoE layer, for every block AutoEP replaced in `module`."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    return {n: m for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer)}


HF_COUNTER = "ds_omni_tokens_per_expert"  # the attribute `count_hf_experts` adds


def count_hf_experts(module: nn.Module) -> int:
    """Make each of HF's expert modules in `module` count the tokens HF's own router sends each
    expert, as AutoEP's layers count theirs, for `expert_load` (parallel.ep 1, where HF's MoE
    blocks stay). transformers' experts modules take the router's picks as an argument
    (`forward(hidden_states, top_k_index, top_k_weights)`), so the count is HF's selection
    whatever the router; like AutoEP's, it counts every forward (a checkpointed layer's
    recompute too). Returns how many modules count."""
    found = [m for m in module.modules() if _is_hf_experts(m)]
    for m in found:
        setattr(m, HF_COUNTER, torch.zeros(m.num_experts, dtype=torch.long))
        m.register_forward_pre_hook(_count_picks, with_kwargs=True)
    return len(found)


def _is_hf_experts(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "num_experts", None), int) and not hasattr(m, HF_COUNTER)
            and "top_k_index" in inspect.signature(m.forward).parameters)


def _count_picks(m: nn.Module, args: tuple, kwargs: dict) -> None:
    picks = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [tokens, top_k]
    with torch.no_grad():  # an index outside 0..E-1 (some blocks' "no expert") is not counted
        flat = picks.reshape(-1)
        flat = flat[(flat >= 0) & (flat < m.num_experts)]
        picked = torch.bincount(flat, minlength=m.num_experts)
        counter = getattr(m, HF_COUNTER)
        if counter.device != picked.device:  # once: the model moved to its device after the hook
            counter = counter.to(picked.device)
            setattr(m, HF_COUNTER, counter)
        counter += picked


def expert_load(module: nn.Module, group=None) -> dict[str, float]:
    """Tokens per expert since the last call, summed over `group` (every rank: the step's load),
    as metrics: per layer's max / mean (1: even), and the counts of the most loaded layer.
    Resets the counters: AutoEP's layers', or HF's expert modules' (`count_hf_experts`). Layers
    are matched by name over the ranks, so pipeline stages holding different layers add up; a
    layer folded over TP (`expert_folding`) counts on its TP rank 0 only (each TP rank routes
    the same tokens). Empty for a model without MoE blocks; every rank calls it."""
    import deepspeed.comm as dist
    if not _has_moe_blocks(module):
        return {}
    counters = _load_counters(module)
    mine = {name: _counted(name, module, c) for name, c in counters.items()}
    for c in counters.values():
        c.zero_()
    parts = [None] * dist.get_world_size(group=group) if dist.is_initialized() else [None]
    if dist.is_initialized():
        dist.all_gather_object(parts, mine, group=group)
    else:
        parts = [mine]
    names = sorted({n for part in parts for n in part})
    if not names:
        return {}
    counts = torch.tensor([[sum(p[n][e] for p in parts if n in p)
                            for e in range(len(next(p[n] for p in parts if n in p)))]
                           for n in names], dtype=torch.float64)  # [layers, E]
    ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)  # [layers]
    worst = int(ratio.argmax())
    out = {"moe_load_max_over_mean": float(ratio.max()),
           "moe_load_max_over_mean_mean": float(ratio.mean())}
    out.update({f"moe_tokens_expert{e}": float(c) for e, c in enumerate(counts[worst].tolist())})
    return out


def _has_moe_blocks(module: nn.Module) -> bool:
    """Whether the whole model has MoE blocks, on every rank alike: a pipeline stage looks at
    every stage's layers (`PipelineModule._layer_specs`, built whole on each rank)."""
    parts = getattr(module, "_layer_specs", None) or [module]
    return any(hasattr(m, "experts") for part in parts if isinstance(part, nn.Module)
               for m in part.modules())


def _load_counters(module: nn.Module) -> dict[str, torch.Tensor]:
    """name -> tokens-per-expert counter [E] of AutoEP's layers, or of HF's expert modules."""
    layers = autoep_layers(module)
    if layers:
        return {n: m.tokens_per_expert for n, m in layers.items()}
    return {n: getattr(m, HF_COUNTER) for n, m in module.named_modules() if hasattr(m, HF_COUNTER)}


def _counted(name: str, module: nn.Module, counter: torch.Tensor) -> list[int]:
    """The counter's values, zeros on a folded layer's TP ranks past the first."""
    layer = module.get_submodule(name)
    handles = getattr(layer, "folding_group_handles", None)
    if handles is not None and torch.distributed.get_rank(layer.tp_group) != 0:
        return [0] * counter.numel()
    return [int(c) for c in counter.tolist()]


def hf_expert_state(named: dict[str, torch.Tensor], ep_size: int,
                    gather=None) -> dict[str, torch.Tensor]:
    """AutoEP's parameters (`named`: name -> this rank's tensor, OmniModel-style names) in HF's
    layout and names, the others unchanged. `gather(t)` -> the ep ranks' shards of t, in EP rank
    order (an all-gather over the EP group; None with ep_size 1 or shards already whole).

    w1 / w3 [E/ep, I, H] (gate, up) -> experts.gate_up_proj [E, 2I, H]; w2 [E/ep, H, I] ->
    experts.down_proj [E, H, I]; router.gate.weight -> gate.weight (HF's router); a shared
    expert under HF's name (`hf_shared_expert_key`)."""
    full = (lambda t: torch.cat(gather(t), dim=0)) if gather is not None and ep_size > 1 \
        else (lambda t: t)
    out = {}
    for name, tensor in named.items():
        head, tail = _split_autoep(name)
        if tail is None:
            out[hf_shared_expert_key(name)] = tensor
        elif tail == "experts.w1":
            w3 = named[head + "experts.w3"]
            out[head + "experts.gate_up_proj"] = torch.cat([full(tensor), full(w3)], dim=1)
        elif tail == "experts.w2":
            out[head + "experts.down_proj"] = full(tensor)
        elif tail == "router.gate.weight":
            out[head + "gate.weight"] = tensor
    return out


def autoep_piece(name: str, hf_state: dict[str, torch.Tensor],
                 experts: slice | None = None) -> torch.Tensor:
    """`hf_expert_state` inverted for one parameter: this rank's tensor `name` (AutoEP's
    names, OmniModel-style; any other parameter too) from a whole state in HF's layout and
    names; `experts`: the global experts this rank holds (AutoEP's layer's `ep_rank` block).

    experts.gate_up_proj [E, 2I, H] -> w1 [E/ep, I, H] (gate), w3 (up); experts.down_proj
    -> w2 [E/ep, H, I]; gate.weight -> router.gate.weight; HF's shared expert by its name."""
    head, tail = _split_autoep(name)
    if tail is None:
        return hf_state[hf_shared_expert_key(name)]
    if tail == "router.gate.weight":
        return hf_state[head + "gate.weight"]
    if tail == "experts.w2":
        return hf_state[head + "experts.down_proj"][experts]  # [E/ep, H, I]
    gate, up = hf_state[head + "experts.gate_up_proj"][experts].chunk(2, dim=1)  # [E/ep, I, H]
    return gate if tail == "experts.w1" else up


def _split_autoep(name: str) -> tuple[str, str | None]:
    """("backbone.layers.3.mlp.", "experts.w1") for an AutoEP parameter, else (name, None)."""
    m = re.fullmatch(r"(.*\.mlp\.)(experts\.w[123]|router\.gate\.weight)", name)
    return (m.group(1), m.group(2)) if m else (name, None)
