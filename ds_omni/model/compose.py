"""Compose a new MLLM from HF parts: a vision encoder (CLIP, SigLIP) and/or an audio encoder
(Whisper) plus any causal LM (Llama, Qwen2, ...), joined by projectors.

Each part is built from an HF config (random init) or loaded from its own directory. A vision
encoder with the 2-layer GELU MLP projector is exactly the LLaVA architecture, so that composition
is built as an HF `LlavaForConditionalGeneration` (stock transformers loads its export); any other
composition is ds_omni's `OmniComposedForConditionalGeneration` (families/composed.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ds_omni.config import ModelConfig, PartConfig
from ds_omni.errors import ModelError
from ds_omni.model.hf_dir import check_vocab_fits, read_model_type


def part_config(part: PartConfig, what: str, trust_remote_code: bool = False):
    """The HF config of a part, from its directory or its config dict."""
    from transformers import AutoConfig
    if part.pretrained:
        read_model_type(Path(part.pretrained))  # clear error if not a model directory
        return AutoConfig.from_pretrained(part.pretrained, trust_remote_code=trust_remote_code)
    fields = dict(part.config)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as e:
        raise ModelError(f"model.{what}.config: unknown model_type {model_type!r} ({e})") from None


def check_causal_lm(text_config) -> None:
    """model.llm is a decoder-only causal LM: an encoder (BERT, RoBERTa: masked LMs that HF can
    also run as decoders) or an encoder-decoder model is refused by name."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    kind = text_config.model_type
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return
    what = ("an encoder (a masked LM)" if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            else "not a causal LM")
    raise ModelError(f"model.llm has model_type {kind!r}, {what}: the LLM of a composed model is "
                     "a decoder-only causal LM (e.g. 'llama', 'qwen2', 'mistral', 'gemma'); set "
                     "model.llm to one")


def placeholder_id(tokenizer, token: str, what: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ModelError(f"the tokenizer has no {token!r} token for the {what} placeholder; add it "
                         f"as a special token or set model.{what}_token")
    return tid


def _llm_config(cfg: ModelConfig, tokenizer):
    text_config = part_config(cfg.llm, "llm", cfg.trust_remote_code)
    check_causal_lm(text_config)
    if cfg.llm.config is not None and "vocab_size" not in cfg.llm.config:
        text_config.vocab_size = len(tokenizer)
    check_vocab_fits(tokenizer, text_config.vocab_size, "model.llm")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(tokenizer, name) is not None and not cfg.llm.pretrained:
            setattr(text_config, name, getattr(tokenizer, name))
    return text_config


def compose(cfg: ModelConfig, tokenizer):
    """(family, HF model) for the parts in `cfg`."""
    from ds_omni.model.families import family_for
    if cfg.vision is None and cfg.audio is None:
        raise ModelError("model: a composition needs an encoder (model.vision and/or model.audio)")
    text_config = _llm_config(cfg, tokenizer)
    vision_config = audio_config = None
    if cfg.vision is not None:
        vision_config = part_config(cfg.vision, "vision", cfg.trust_remote_code)
        vision_config = getattr(vision_config, "vision_config", vision_config)  # a full CLIP/SigLIP
    if cfg.audio is not None:
        audio_config = part_config(cfg.audio, "audio", cfg.trust_remote_code)
        if audio_config.model_type != "whisper":
            raise ModelError(f"model.audio: a composed audio encoder is a Whisper encoder; got "
                             f"model_type {audio_config.model_type!r}")
    if audio_config is None and cfg.projector == "mlp2x_gelu":
        config = _llava_config(cfg, tokenizer, text_config, vision_config)
    else:
        config = _composed_config(cfg, tokenizer, text_config, vision_config, audio_config)
    family = family_for(config.model_type)
    hf_model = family.build_hf(config)
    if torch.empty(0).device.type != "meta":  # on meta (sizes only) no weights are read
        _load_parts(hf_model, cfg)
    return family, hf_model


def _llava_config(cfg, tokenizer, text_config, vision_config):
    """Vision + the 2-layer MLP projector is LLaVA: stock transformers loads the export."""
    from transformers import LlavaConfig
    from ds_omni.model.families.llava import has_cls, tokens_per_image
    config = LlavaConfig(vision_config=vision_config, text_config=text_config,
                         image_token_index=placeholder_id(tokenizer, cfg.image_token, "image"),
                         vision_feature_select_strategy="default" if has_cls(vision_config) else "full",
                         vision_feature_layer=-1, tie_word_embeddings=text_config.tie_word_embeddings)
    config.image_seq_length = tokens_per_image(config)
    return config


def _composed_config(cfg, tokenizer, text_config, vision_config, audio_config):
    from ds_omni.model.families.composed import OmniComposedConfig
    return OmniComposedConfig(
        text_config=text_config, vision_config=vision_config, audio_config=audio_config,
        image_token_id=placeholder_id(tokenizer, cfg.image_token, "image") if vision_config else None,
        audio_token_id=placeholder_id(tokenizer, cfg.audio_token, "audio") if audio_config else None,
        projector=cfg.projector, tie_word_embeddings=text_config.tie_word_embeddings)


def _load_parts(hf_model, cfg: ModelConfig) -> None:
    """Copy weights of parts given as directories into the composed model."""
    from transformers import AutoModel, AutoModelForCausalLM
    kw = {"use_safetensors": True, "trust_remote_code": cfg.trust_remote_code}
    if cfg.llm.pretrained:
        llm = AutoModelForCausalLM.from_pretrained(cfg.llm.pretrained, **kw)
        target = getattr(hf_model, "language_model", None)
        if isinstance(target, type(llm)):  # composed: the whole causal LM
            target.load_state_dict(llm.state_dict())
        else:  # LLaVA: decoder and head live apart
            hf_model.model.language_model.load_state_dict(llm.model.state_dict())
            hf_model.lm_head.load_state_dict(llm.lm_head.state_dict())
    if cfg.vision is not None and cfg.vision.pretrained:
        vision = AutoModel.from_pretrained(cfg.vision.pretrained, **kw)
        tower = getattr(hf_model, "vision_tower", None) or hf_model.model.vision_tower
        vision = getattr(vision, "vision_model", vision)  # a full CLIP/SigLIP -> its vision model
        tower.load_state_dict(vision.state_dict())
    if cfg.audio is not None and cfg.audio.pretrained:
        whisper = AutoModel.from_pretrained(cfg.audio.pretrained, **kw)  # a WhisperModel
        hf_model.audio_tower.load_state_dict(whisper.get_encoder().state_dict())
