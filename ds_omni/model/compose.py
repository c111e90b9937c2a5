"""Compose a new MLLM from HF parts: an encoder (CLIP / SigLIP vision) plus a causal LM.

Each part is built from an HF config (random init) or loaded from its own directory. A vision
encoder with the 2-layer GELU MLP projector is exactly the LLaVA architecture, so that
composition is built as an HF `LlavaForConditionalGeneration`: it trains as an OmniModel and exports
to a directory that `transformers` loads with `from_pretrained`.
"""

from __future__ import annotations

from ds_omni.config import ModelConfig, PartConfig
from ds_omni.errors import ModelError


def part_config(part: PartConfig, what: str, trust_remote_code: bool = False):
    """The HF config of a part, from its directory or its config dict."""
    from transformers import AutoConfig
    if part.pretrained:
        from ds_omni.model.build import read_model_type
        from pathlib import Path
        read_model_type(Path(part.pretrained))  # clear error if not a model directory
        return AutoConfig.from_pretrained(part.pretrained, trust_remote_code=trust_remote_code)
    fields = dict(part.config)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as e:
        raise ModelError(f"model.{what}.config: unknown model_type {model_type!r} ({e})") from None


def placeholder_id(tokenizer, token: str, what: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ModelError(f"the tokenizer has no {token!r} token for the {what} placeholder; add it "
                         f"as a special token or set model.{what}_token")
    return tid


def _llm_config(cfg: ModelConfig, tokenizer):
    text_config = part_config(cfg.llm, "llm", cfg.trust_remote_code)
    if cfg.llm.config is not None and "vocab_size" not in cfg.llm.config:
        text_config.vocab_size = len(tokenizer)
    if text_config.vocab_size < len(tokenizer):
        raise ModelError(f"the tokenizer has {len(tokenizer)} tokens but the LLM's vocab_size is "
                         f"{text_config.vocab_size}; use the LLM's own tokenizer or a larger vocab_size")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(tokenizer, name) is not None and not cfg.llm.pretrained:
            setattr(text_config, name, getattr(tokenizer, name))
    return text_config


def compose(cfg: ModelConfig, tokenizer):
    """(family, HF model) for the parts in `cfg`."""
    if cfg.audio is not None:
        raise ModelError("model.audio: composing an audio encoder is not supported yet; use a "
                         "Qwen2-Audio directory as model.pretrained")
    if cfg.vision is None:
        raise ModelError("model: a composition needs an encoder (model.vision)")
    if cfg.projector != "mlp2x_gelu":
        raise ModelError(f"model.projector {cfg.projector!r}: a vision composition uses the LLaVA "
                         "projector 'mlp2x_gelu'")
    from transformers import LlavaConfig
    from ds_omni.model.family import family_for
    from ds_omni.model.families.llava import tokens_per_image
    text_config = _llm_config(cfg, tokenizer)
    vision_config = part_config(cfg.vision, "vision", cfg.trust_remote_code)
    vision_config = getattr(vision_config, "vision_config", vision_config)  # a full CLIP/SigLIP dir
    config = LlavaConfig(vision_config=vision_config, text_config=text_config,
                         image_token_index=placeholder_id(tokenizer, cfg.image_token, "image"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         tie_word_embeddings=text_config.tie_word_embeddings)
    config.image_seq_length = tokens_per_image(config)
    family = family_for("llava")
    hf_model = family.build_hf(config)
    _load_parts(hf_model, cfg)
    return family, hf_model


def _load_parts(hf_model, cfg: ModelConfig) -> None:
    """Copy weights of parts given as directories into the composed model."""
    from transformers import AutoModel, AutoModelForCausalLM
    if cfg.llm.pretrained:
        llm = AutoModelForCausalLM.from_pretrained(cfg.llm.pretrained, use_safetensors=True,
                                                   trust_remote_code=cfg.trust_remote_code)
        hf_model.model.language_model.load_state_dict(llm.model.state_dict())
        hf_model.lm_head.load_state_dict(llm.lm_head.state_dict())
    if cfg.vision.pretrained:
        vision = AutoModel.from_pretrained(cfg.vision.pretrained, use_safetensors=True,
                                           trust_remote_code=cfg.trust_remote_code)
        # CLIP/SigLIP vision models and full CLIP/SigLIP models both hold a `.vision_model`
        hf_model.model.vision_tower.vision_model.load_state_dict(vision.vision_model.state_dict())
