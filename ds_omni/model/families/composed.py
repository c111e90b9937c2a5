"""Composed MLLMs: any HF vision encoder (CLIP, SigLIP) and/or Whisper audio encoder + any causal LM.

A vision-only composition with the 2-layer MLP projector is exactly LLaVA and is built as one
(`ds_omni.model.compose`), so stock `transformers` loads its export. Everything else (audio, image +
audio + text, a linear projector) is this family: an HF model class of ds_omni's own,
`OmniComposedForConditionalGeneration`, registered with transformers' Auto classes when
`ds_omni.model` is imported, so `save_pretrained` / `from_pretrained` (safetensors) and `generate`
work on it like on any HF model; each part keeps its own HF config inside.

Per item: an image yields (image_size / patch_size)^2 embeddings (CLS dropped for CLIP); a clip of
F valid mel frames yields (F - 1) // 2 + 1 (Whisper's stride-2 conv; the encoder runs on its whole
window, as Whisper does, and only the clip's positions are kept).

Dims: N items, F mel frames of the window, S = F / 2 encoder positions, C encoder width, D LLM width.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText,
                          GenerationMixin, PreTrainedModel)
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec

from ds_omni.errors import ModelError
from ds_omni.model.families import qwen2_audio
from ds_omni.model.families.llava import (ClipImageProcessor, LlavaVisionEncoder, clip_image_processor,
                                          has_cls, tower_seq_len)
from ds_omni.model.families.registry import register
from ds_omni.model.family import Family
from ds_omni.model.omni import ModalityEncoder, OmniModel, backbone_of
from ds_omni.parallel import long_short
from ds_omni.parallel.long_short import EncoderShard

MODEL_TYPE = "ds_omni_composed"
IMAGE_PROCESSOR_DIR, FEATURE_EXTRACTOR_DIR = "image_processor", "feature_extractor"


@strict
class OmniComposedConfig(PreTrainedConfig):
    """Parts' configs plus how they are joined."""

    model_type = MODEL_TYPE
    sub_configs_defaults = {
        "text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama"),
        "vision_config": SubConfigSpec(config_class=AutoConfig, model_type="clip_vision_model",
                                       optional=True),
        "audio_config": SubConfigSpec(config_class=AutoConfig, model_type="whisper", optional=True),
    }

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    audio_config: dict | PreTrainedConfig | None = None
    image_token_id: int | None = None
    audio_token_id: int | None = None
    projector: str = "mlp2x_gelu"
    vision_feature_layer: int = -1
    tie_word_embeddings: bool = False


class Projector(nn.Module):
    """Encoder width -> LLM width: "mlp2x_gelu" (Linear, GELU, Linear) or "linear"."""

    def __init__(self, kind: str, in_dim: int, out_dim: int):
        super().__init__()
        if kind not in ("mlp2x_gelu", "linear"):
            raise ModelError(f"projector {kind!r} is not known; use 'mlp2x_gelu' or 'linear'")
        self.linear_1 = nn.Linear(in_dim, out_dim)
        if kind == "mlp2x_gelu":
            self.act = ACT2FN["gelu"]
            self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, x):
        x = self.linear_1(x)
        return self.linear_2(self.act(x)) if hasattr(self, "linear_2") else x


def whisper_positions(frames: torch.Tensor) -> torch.Tensor:
    """Encoder positions a clip of `frames` valid mel frames covers (stride-2 conv)."""
    return (frames - 1) // 2 + 1


def audio_features(tower, projector, input_features, feature_attention_mask,
                   shard: EncoderShard | None = None) -> torch.Tensor:
    """[N, M, F] mel windows -> [E, D]: each clip's own positions, projected, clips in order.

    With `shard` (one long clip): this rank's rows, from its piece of the window's positions."""
    first = 0
    with contextlib.ExitStack() as pieces:
        if shard is not None:
            pieces.enter_context(long_short.sharded(tower.config, shard))
            pieces.enter_context(long_short.cut_input(tower.layers[0], shard, dim=1))
            first = shard.lo
        hidden = tower(input_features).last_hidden_state  # [N, S, C]
    lengths = whisper_positions(feature_attention_mask.sum(-1))  # [N]
    rows = first + torch.arange(hidden.shape[1], device=hidden.device)
    keep = rows[None] < lengths[:, None]  # [N, S]
    return projector(hidden[keep])


class OmniComposedForConditionalGeneration(PreTrainedModel, GenerationMixin):
    """Encoders + projectors + a causal LM; encoder outputs replace placeholder tokens."""

    config_class = OmniComposedConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True

    def __init__(self, config: OmniComposedConfig):
        super().__init__(config)
        llm_width = config.text_config.hidden_size
        self.language_model = AutoModelForCausalLM.from_config(config.text_config)
        if config.vision_config is not None:
            self.vision_tower = AutoModel.from_config(config.vision_config)
            self.vision_projector = Projector(config.projector, config.vision_config.hidden_size,
                                              llm_width)
        if config.audio_config is not None:
            from transformers.models.whisper.modeling_whisper import WhisperEncoder
            self.audio_tower = WhisperEncoder(config.audio_config)
            self.audio_projector = Projector(config.projector, config.audio_config.d_model, llm_width)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def _scatter(self, embeds, input_ids, token_id, feats):
        mask = (input_ids == token_id).unsqueeze(-1)
        if int(mask.sum()) != feats.shape[0]:
            raise ModelError(f"{feats.shape[0]} encoder embeddings but {int(mask.sum())} "
                             f"placeholder tokens (id {token_id}) in input_ids")
        return embeds.masked_scatter(mask, feats.to(embeds.dtype))

    def forward(self, input_ids=None, pixel_values=None, input_features=None,
                feature_attention_mask=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
            cfg = self.config
            # during generation only the first step carries the placeholders
            if pixel_values is not None and (input_ids == cfg.image_token_id).any():
                feats = vision_features(self.vision_tower, self.vision_projector, pixel_values,
                                        cfg.vision_feature_layer, has_cls(cfg.vision_config))
                inputs_embeds = self._scatter(inputs_embeds, input_ids, cfg.image_token_id, feats)
            if input_features is not None and (input_ids == cfg.audio_token_id).any():
                feats = audio_features(self.audio_tower, self.audio_projector, input_features,
                                       feature_attention_mask)
                inputs_embeds = self._scatter(inputs_embeds, input_ids, cfg.audio_token_id, feats)
        return self.language_model(inputs_embeds=inputs_embeds, **kwargs)


def vision_features(tower, projector, pixel_values, layer: int, drop_cls: bool) -> torch.Tensor:
    """[N, 3, H, W] -> [N * P, D]: one hidden layer's patch states, projected."""
    states = tower(pixel_values, output_hidden_states=True, return_dict=True).hidden_states[layer]
    return projector(states[:, 1:] if drop_cls else states).flatten(0, 1)


AutoConfig.register(MODEL_TYPE, OmniComposedConfig, exist_ok=True)
AutoModelForImageTextToText.register(OmniComposedConfig, OmniComposedForConditionalGeneration,
                                     exist_ok=True)


class ComposedAudioEncoder(ModalityEncoder):
    """Whisper encoder + projector: mel windows [N, M, F] + frame masks [N, F] -> [E, D]."""

    modality = "audio"

    def encode(self, inputs):
        return audio_features(self.tower, self.projector, inputs["input_features"],
                              inputs["feature_attention_mask"])

    # A long clip: one row per position; the last piece also takes the padded tail.
    def attention_heads(self):
        return self.tower.config.encoder_attention_heads

    def piece_tokens(self, inputs, rows):
        return (*rows[:-1], self.tower.config.max_source_positions)

    def encode_piece(self, inputs, shard):
        return audio_features(self.tower, self.projector, inputs["input_features"],
                              inputs["feature_attention_mask"], shard)

    def dummy_inputs(self, device, dtype):
        cfg = self.tower.config
        frames = 2 * cfg.max_source_positions
        return {"input_features": torch.zeros(1, cfg.num_mel_bins, frames, device=device, dtype=dtype),
                "feature_attention_mask": torch.ones(1, frames, device=device, dtype=torch.int32)}


class WhisperPositionsProcessor(qwen2_audio.WhisperClipProcessor):
    """A clip yields one embedding per Whisper encoder position it covers; no wrapper tokens."""

    def __init__(self, feature_extractor, placeholder_id: int):
        super().__init__(feature_extractor, placeholder_id, bos_id=None, eos_id=None)

    def count(self, frames: int) -> int:
        return int(whisper_positions(torch.tensor(frames)))

    def tokens(self, item):
        return [self.placeholder_id] * item.num_embeddings


def image_processor(vision_config, model_dir: Path | None):
    """The image processor saved with the model (in its own folder), else one for the tower."""
    sub = Path(model_dir) / IMAGE_PROCESSOR_DIR if model_dir is not None else None
    return clip_image_processor(vision_config, sub)


def audio_extractor(audio_config, model_dir: Path | None):
    sub = Path(model_dir) / FEATURE_EXTRACTOR_DIR if model_dir is not None else None
    return qwen2_audio.feature_extractor(audio_config, sub if sub is not None and sub.exists() else None)


class Composed(Family):
    name = "composed"
    model_types = (MODEL_TYPE,)

    def hf_model_class(self):
        return OmniComposedForConditionalGeneration

    def to_omni(self, hf_model, tokenizer=None) -> OmniModel:
        cfg, encoders = hf_model.config, {}
        if cfg.vision_config is not None:
            encoders["vision"] = LlavaVisionEncoder(
                tower=hf_model.vision_tower, projector=hf_model.vision_projector,
                placeholder_id=cfg.image_token_id, feature_layer=cfg.vision_feature_layer,
                select_strategy="default" if has_cls(cfg.vision_config) else "full",
                image_size=cfg.vision_config.image_size)
        if cfg.audio_config is not None:
            encoders["audio"] = ComposedAudioEncoder(
                tower=hf_model.audio_tower, projector=hf_model.audio_projector,
                placeholder_id=cfg.audio_token_id)
        lm = hf_model.language_model
        return OmniModel(encoders=encoders, backbone=backbone_of(lm.model, lm.lm_head, lm),
                         family=self, hf_model=hf_model)

    def item_processors(self, hf_config, model_dir=None, tokenizer=None):
        out = {}
        if hf_config.vision_config is not None:
            vc = hf_config.vision_config
            patches = (vc.image_size // vc.patch_size) ** 2
            out["vision"] = ClipImageProcessor(image_processor(vc, model_dir), patches,
                                               hf_config.image_token_id, tower_seq_len(vc))
        if hf_config.audio_config is not None:
            out["audio"] = WhisperPositionsProcessor(
                audio_extractor(hf_config.audio_config, model_dir), hf_config.audio_token_id)
        return out

    def save_processor(self, out_dir, hf_config, tokenizer, model_dir=None):
        out_dir = Path(out_dir)
        tokenizer.save_pretrained(str(out_dir))
        if hf_config.vision_config is not None:
            image_processor(hf_config.vision_config, model_dir).save_pretrained(
                str(out_dir / IMAGE_PROCESSOR_DIR))
        if hf_config.audio_config is not None:
            audio_extractor(hf_config.audio_config, model_dir).save_pretrained(
                str(out_dir / FEATURE_EXTRACTOR_DIR))


register(Composed())
