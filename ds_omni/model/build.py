"""ModelConfig -> a ready OmniModel with its tokenizer and item processors.

A model comes from an HF MLLM directory (`model.pretrained`, loaded through the family's real
`from_pretrained`) or is composed from parts (`model.llm` + `model.vision`/`model.audio`, see
`compose.py`); `load` is the same from Python, for an HF or an OmniModel directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ds_omni.batch import ItemProcessor
from ds_omni.config import ModelConfig
from ds_omni.config.composition import ModelFacts
from ds_omni.errors import ModelError
from ds_omni.model.attention import PackedAttention
from ds_omni.model.compose import check_causal_lm, compose, part_config
from ds_omni.model.convert import is_omni_dir, load_omni_dir
from ds_omni.model.family import Family
from ds_omni.model.hf_dir import (check_vocab_fits, check_weights_present, load_tokenizer,
                                  read_model_type)
from ds_omni.model.omni import OmniModel


@dataclass
class BuiltModel:
    model: OmniModel
    tokenizer: object
    family: Family
    hf_config: object
    item_processors: dict[str, ItemProcessor]
    model_dir: Path | None


def _load_pretrained(family: Family, model_dir: Path, trust_remote_code: bool):
    """The HF model of an HF directory, or of an OmniModel directory (see convert.save_omni)."""
    if is_omni_dir(model_dir):
        return load_omni_dir(model_dir)[0].hf_model
    if on_meta():  # sizes only (a plan, the simulator): from the config, no weights read
        from transformers import AutoConfig
        return family.build_hf(AutoConfig.from_pretrained(str(model_dir),
                                                          trust_remote_code=trust_remote_code))
    return family.load_hf(model_dir, trust_remote_code)


def on_meta() -> bool:
    """Built under `torch.device("meta")`: transformers' from_pretrained refuses to load there."""
    return torch.empty(0).device.type == "meta"


def build_model(cfg: ModelConfig) -> BuiltModel:
    """Load or compose the model described by `cfg`, freeze what it names, cast to its dtype."""
    from ds_omni.model.families import family_for  # imports every family adapter
    torch.manual_seed(cfg.seed)
    if cfg.pretrained:
        model_dir = Path(cfg.pretrained)
        family = family_for(read_model_type(model_dir))
        check_weights_present(model_dir)
        tokenizer = load_tokenizer(cfg.tokenizer or str(model_dir), cfg.trust_remote_code)
        hf_model = _load_pretrained(family, model_dir, cfg.trust_remote_code)
        check_vocab_fits(tokenizer, hf_model.get_input_embeddings().num_embeddings,
                         f"the model in {str(model_dir)!r}")
    else:
        model_dir = None
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.llm.pretrained or "", cfg.trust_remote_code)
        family, hf_model = compose(cfg, tokenizer)
    model = family.to_omni(hf_model, tokenizer)
    if cfg.lora is not None:  # the adapters' init draws from the seeded global generator
        from ds_omni.model.lora import apply_lora
        model = apply_lora(model, cfg.lora, tokenizer)
    # the LLM's attention kernel, a model option (its SP group is the plan's: ds_omni.parallelize)
    model.backbone.attention = PackedAttention(cfg.attn_implementation)
    asked = cfg.activation_checkpointing
    model.set_checkpointing(cfg.checkpointed_parts(),
                            named=set() if isinstance(asked, bool) else set(asked) - {"encoders"})
    model.freeze(cfg.freeze)
    model.to(getattr(torch, cfg.dtype))
    with torch.device("cpu"):  # the processors' probes make real tensors, also on meta
        processors = family.item_processors(hf_model.config, model_dir, tokenizer=tokenizer)
    return BuiltModel(model=model, tokenizer=tokenizer, family=family, hf_config=hf_model.config,
                      item_processors=processors, model_dir=model_dir)


def load(model_dir: str | Path, **model_cfg):
    """An HF MLLM directory or an OmniModel directory -> `BuiltModel` (model, tokenizer, ...)."""
    return build_model(ModelConfig(pretrained=str(model_dir), **model_cfg))


def llm_text_config(cfg: ModelConfig):
    """(family, the LLM's HF config), read from config files alone, before any model is built."""
    from transformers import AutoConfig
    from ds_omni.model.families import family_for  # also registers the composed model type
    if cfg.pretrained:
        model_dir = Path(cfg.pretrained)
        family = family_for(read_model_type(model_dir))
        hf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=cfg.trust_remote_code)
        return family, hf.get_text_config()
    # a vision-only composition with the mlp2x_gelu projector is built as LLaVA (compose.compose)
    llava = cfg.audio is None and cfg.projector == "mlp2x_gelu"
    family = family_for("llava" if llava else "ds_omni_composed")
    text = part_config(cfg.llm, "llm", cfg.trust_remote_code)
    check_causal_lm(text)
    return family, text


def check_model_files(cfg: ModelConfig) -> None:
    """What building the model would refuse, from its files alone (at start-up): a folder
    without safetensors weights, an encoder part of an unknown model type."""
    if cfg.pretrained:
        check_weights_present(Path(cfg.pretrained))
    for name in ("vision", "audio"):
        if getattr(cfg, name) is not None:
            part_config(getattr(cfg, name), name, cfg.trust_remote_code)


def check_positions(cfg: ModelConfig, max_seq_len: int, llm=None) -> None:
    """data.max_seq_len fits the LLM's positions (max_position_embeddings, times the factor of
    its rope scaling if any): longer samples would train at positions the model never had."""
    text = (llm if llm is not None else llm_text_config(cfg))[1]
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if not limit or max_seq_len <= limit:
        return
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type") or rope.get("type")
    if rope_type not in (None, "default", "mrope") and rope.get("factor"):
        covered = int(rope.get("original_max_position_embeddings") or limit) * rope["factor"]
        if max_seq_len <= max(limit, covered):
            return
    where = f"the LLM of {cfg.pretrained!r}" if cfg.pretrained else "model.llm"
    raise ModelError(f"data.max_seq_len={max_seq_len} is above the max_position_embeddings="
                     f"{limit} of {where} ({text.model_type}): longer samples would train at "
                     f"positions the model has none for. Lower data.max_seq_len to {limit} or "
                     "less, or use an LLM with more positions (or rope scaling in its config, "
                     "e.g. rope_scaling {\"rope_type\": \"linear\", \"factor\": 2.0})")


def check_sequence_parallel(cfg: ModelConfig, sp: int, llm=None) -> None:
    """The LLM can run Ulysses SP of degree `sp`: its family supports it and sp divides its heads.
    `llm`: (family, LLM config) as `llm_text_config` reads them, when the caller has them already.

    KV heads need not divide: the kernel repeats them (`repeat_kv_for_sp`), which only needs sp to
    divide the query heads.
    """
    family, text = llm if llm is not None else llm_text_config(cfg)
    if not family.sequence_parallel:
        raise ModelError(f"parallel.sp={sp}: the {family.name!r} family does not support sequence "
                         "parallelism yet; set parallel.sp to 1")
    from ds_omni.model.per_sample import per_sample_types, sp_problem
    problem = sp_problem(per_sample_types(text))
    if problem is not None:
        raise ModelError(f"parallel.sp={sp}: {problem}")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % sp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        where = f"the LLM of {cfg.pretrained!r}" if cfg.pretrained else "model.llm"
        raise ModelError(f"parallel.sp={sp} must divide the LLM's attention heads: {where} "
                         f"({text.model_type}) has {heads} query heads and {kv_heads} key/value "
                         f"heads; Ulysses splits the heads over the sp ranks, so sp can be one of "
                         f"{ok}")


def model_facts(cfg: ModelConfig, max_seq_len: int, llm=None) -> ModelFacts:
    """What the composition table's model checks read of the LLM (`ModelFacts`). `llm`: (family,
    LLM config) as `llm_text_config` reads them."""
    from ds_omni.model.per_sample import per_sample_types, sp_problem
    family, text = llm if llm is not None else llm_text_config(cfg)
    experts = next((getattr(text, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, a, None)), 0)
    return ModelFacts(where=f"the LLM of {cfg.pretrained!r}" if cfg.pretrained else "model.llm",
                      family=family.name, model_type=text.model_type,
                      splits=family.sequence_parallel,
                      per_sample=sp_problem(per_sample_types(text)), experts=experts,
                      attention_dropout=getattr(text, "attention_dropout", 0.0),
                      max_seq_len=max_seq_len)
