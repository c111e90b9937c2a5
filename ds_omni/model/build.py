"""ModelConfig -> a ready OmniModel with its tokenizer and item processors.

A model comes from an HF MLLM directory (`model.pretrained`, loaded through the family's real
`from_pretrained`) or is composed from parts (`model.llm` + `model.vision`/`model.audio`, see
`compose.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_omni.config import ModelConfig
from ds_omni.data import demo
from ds_omni.errors import ModelError
from ds_omni.model.family import Family, ItemProcessor, family_for
from ds_omni.model.omni import OmniModel


@dataclass
class BuiltModel:
    model: OmniModel
    tokenizer: object
    family: Family
    hf_config: object
    item_processors: dict[str, ItemProcessor]
    model_dir: Path | None


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    if demo.is_builtin(path):
        path = str(demo.ensure_builtin(path, "tokenizer"))
    if not Path(path).is_dir():
        raise ModelError(f"tokenizer directory {path!r} does not exist; set model.tokenizer to a "
                         "directory written by save_pretrained, or \"builtin:shapes\"")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def read_model_type(model_dir: Path) -> str:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{str(model_dir)!r} is not an HF model directory: no config.json. Give a "
                         "directory written by save_pretrained (or by ds-omni convert)")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if not model_type:
        raise ModelError(f"{config_file} has no 'model_type'")
    return model_type


def check_weights_present(model_dir: Path) -> None:
    if not any(model_dir.glob("*.safetensors")):
        raise ModelError(f"no safetensors weights in {str(model_dir)!r} (found "
                         f"{sorted(p.name for p in model_dir.iterdir())}); ds_omni loads weights only "
                         "from safetensors. Re-save the model with save_pretrained(safe_serialization=True)")


def _load_pretrained(family: Family, model_dir: Path, trust_remote_code: bool):
    """The HF model of an HF directory, or of an OmniModel directory (see convert.save_omni)."""
    from ds_omni.model.convert import is_omni_dir, load_omni_dir
    if is_omni_dir(model_dir):
        return load_omni_dir(model_dir)[0].hf_model
    return family.load_hf(model_dir, trust_remote_code)


def build_model(cfg: ModelConfig) -> BuiltModel:
    """Load or compose the model described by `cfg`, freeze what it names, cast to its dtype."""
    torch.manual_seed(cfg.seed)
    if cfg.pretrained:
        model_dir = Path(cfg.pretrained)
        family = family_for(read_model_type(model_dir))
        check_weights_present(model_dir)
        tokenizer = load_tokenizer(cfg.tokenizer or str(model_dir), cfg.trust_remote_code)
        hf_model = _load_pretrained(family, model_dir, cfg.trust_remote_code)
    else:
        from ds_omni.model.compose import compose
        model_dir = None
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.llm.pretrained or "", cfg.trust_remote_code)
        family, hf_model = compose(cfg, tokenizer)
    model = family.to_omni(hf_model, tokenizer)
    model.set_attention(cfg.attn_implementation)
    model.backbone.checkpoint_layers = cfg.activation_checkpointing
    model.freeze(cfg.freeze)
    model.to(getattr(torch, cfg.dtype))
    processors = family.item_processors(hf_model.config, model_dir, tokenizer=tokenizer)
    return BuiltModel(model=model, tokenizer=tokenizer, family=family, hf_config=hf_model.config,
                      item_processors=processors, model_dir=model_dir)


def llm_text_config(cfg: ModelConfig):
    """(family, the LLM's HF config), read from config files alone, before any model is built."""
    from transformers import AutoConfig
    import ds_omni.model.families  # noqa: F401  (registers the composed model type)
    if cfg.pretrained:
        model_dir = Path(cfg.pretrained)
        family = family_for(read_model_type(model_dir))
        hf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=cfg.trust_remote_code)
        return family, hf.get_text_config()
    # a vision-only composition with the mlp2x_gelu projector is built as LLaVA (compose.compose)
    llava = cfg.audio is None and cfg.projector == "mlp2x_gelu"
    family = family_for("llava" if llava else "ds_omni_composed")
    part = cfg.llm
    if part.config is not None:
        fields = dict(part.config)
        return family, AutoConfig.for_model(fields.pop("model_type"), **fields)
    return family, AutoConfig.from_pretrained(part.pretrained, trust_remote_code=cfg.trust_remote_code)


def check_sequence_parallel(cfg: ModelConfig, sp: int) -> None:
    """The LLM can run Ulysses SP of degree `sp`: its family supports it and sp divides its heads.

    KV heads need not divide: the kernel repeats them (`repeat_kv_for_sp`), which only needs sp to
    divide the query heads.
    """
    family, text = llm_text_config(cfg)
    if not family.sequence_parallel:
        raise ModelError(f"parallel.sp={sp}: the {family.name!r} family does not support sequence "
                         "parallelism yet; set parallel.sp to 1")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % sp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        where = f"the LLM of {cfg.pretrained!r}" if cfg.pretrained else "model.llm"
        raise ModelError(f"parallel.sp={sp} must divide the LLM's attention heads: {where} "
                         f"({text.model_type}) has {heads} query heads and {kv_heads} key/value "
                         f"heads; Ulysses splits the heads over the sp ranks, so sp can be one of "
                         f"{ok}")
