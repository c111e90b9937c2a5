"""Which transformers vision-language families ds_omni trains exactly: the coverage sweep.

For every model type in transformers' `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`: a type whose
classes or config rule the generic adapter out gets that reason; a type with a tiny recipe here is
built at random from its config class (hidden 32, one or two layers, tiny images; no hub), saved
with its processor, loaded through `build_model` (the real loading path), and checked:
- logits of one packed row (an image, a text-only sample, two images of different sizes) against
  the HF model run one sample at a time on its own processor's inputs: max |diff| <= 1e-5 (fp32);
- the export round trip: `export_hf` then plain `from_pretrained` gives bitwise-equal tensors.
A type without a recipe is reported unverified. `ds-omni families` prints this same table.
"""

from __future__ import annotations

import inspect
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

LOGITS_ATOL = 1e-5
TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}


@dataclass
class Result:
    supported: bool
    reason: str

    def as_dict(self) -> dict:
        return {"supported": self.supported, "reason": self.reason}


# ------------------------------------------------------------------------------ recipes
def demo_tokenizer(tokens: list[str], named: dict[str, str] | None = None):
    """The demo tokenizer plus the family's special tokens; `named` ones become attributes
    (`tok.image_token`, `tok.image_token_id`) that survive save_pretrained, as processors read
    them."""
    from transformers import AutoTokenizer
    from ds_omni.data.demo import ensure_builtin
    path = str(ensure_builtin("builtin:shapes", "tokenizer"))
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens=named or {})
    new = [t for t in tokens if t not in tok.get_vocab()]
    tok.add_special_tokens({"additional_special_tokens": new}, replace_extra_special_tokens=False)
    return tok


def _ids(tok, *tokens: str) -> list[int]:
    return tok.convert_tokens_to_ids(list(tokens))


def _processor_class(model_type: str):
    from ds_omni.model.families.generic import processor_class
    return processor_class(model_type)


def _config(model_type: str, **fields):
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **fields)


SIGLIP = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
CLIP = {**SIGLIP, "model_type": "clip_vision_model"}


def _text(tok, model_type: str = "qwen2", **extra) -> dict:
    return {"model_type": model_type, **TEXT, "vocab_size": len(tok),
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, **extra}


def lenient_processor(cls, **parts):
    """An HF processor without the parts images do not need (video processors need torchvision)."""
    lenient = type(cls.__name__, (cls,), {"check_argument_for_proper_class":
                                          lambda self, name, arg: type(arg)})
    full = {a: None for a in cls.get_attributes()}
    full.update(parts)
    return lenient(**full)


def _qwen_vl(model_type: str):
    """Qwen2.5-VL-like: ViT over patch grids + merger, M-RoPE LLM."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = demo_tokenizer(names)
    tok.image_token, tok.video_token = "<|image_pad|>", "<|video_pad|>"
    ids = dict(zip(names, tok.convert_tokens_to_ids(names)))
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
              "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 16, "fullatt_block_indexes": [1], "embed_dim": 32}
    text = {**TEXT, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [1, 1, 2]}}
    config = config_cls(vision_config=vision, text_config=text,
                        vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"],
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    proc_cls = getattr(transformers, transformers.models.auto.processing_auto.
                       PROCESSOR_MAPPING_NAMES[model_type])
    return config, lenient_processor(proc_cls, image_processor=images, tokenizer=tok)


def _llava():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    config = _config("llava", vision_config=CLIP, text_config=_text(tok, "llama"),
                     image_token_index=_ids(tok, "<image>")[0], vision_feature_layer=-2)
    images = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32})
    return config, _processor_class("llava")(image_processor=images, tokenizer=tok, patch_size=8,
                                             vision_feature_select_strategy="default",
                                             num_additional_image_tokens=1)


def _llava_onevision():
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)
    tok = demo_tokenizer(["<image>", "<video>"],
                         {"image_token": "<image>", "video_token": "<video>"})
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    config = _config("llava_onevision", vision_config=SIGLIP, text_config=_text(tok),
                     image_token_index=_ids(tok, "<image>")[0],
                     video_token_index=_ids(tok, "<video>")[0], image_grid_pinpoints=pinpoints)
    images = LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32},
                                             image_grid_pinpoints=pinpoints)
    return config, lenient_processor(_processor_class("llava_onevision"), image_processor=images,
                                     tokenizer=tok, num_image_tokens=16,
                                     vision_feature_select_strategy="full")


def _internvl():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    named = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    tok = demo_tokenizer(list(named.values()), named)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": [32, 32], "patch_size": [8, 8]}
    config = _config("internvl", vision_config=vision, text_config=_text(tok),
                     image_token_id=_ids(tok, "<IMG_CONTEXT>")[0], downsample_ratio=0.5)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                      min_patches=1, max_patches=4)
    return config, lenient_processor(_processor_class("internvl"), image_processor=images,
                                     tokenizer=tok, image_seq_length=4)


def _idefics3(model_type: str):
    import importlib
    tokens = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
              *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]
    tok = demo_tokenizer(tokens)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
    config = _config(model_type, vision_config=vision, text_config=_text(tok, "llama"),
                     image_token_id=_ids(tok, "<image>")[0], scale_factor=2)
    module = importlib.import_module(
        f"transformers.models.{model_type}.image_processing_pil_{model_type}")
    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[model_type]
    cls = getattr(module, f"{prefix}ImageProcessorPil")
    images = cls(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    return config, lenient_processor(_processor_class(model_type), image_processor=images,
                                     tokenizer=tok, image_seq_len=4)


def _vipllava():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    config = _config("vipllava", vision_config=CLIP, text_config=_text(tok, "llama"),
                     image_token_index=_ids(tok, "<image>")[0], vision_feature_layer=[-2, -1])
    images = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32})
    return config, _processor_class("vipllava")(image_processor=images, tokenizer=tok, patch_size=8,
                                                vision_feature_select_strategy="default",
                                                num_additional_image_tokens=1)


def _llava_next():
    from ds_omni.model.families.llava_next import anyres_processor
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    config = _config("llava_next", vision_config=CLIP, text_config=_text(tok, "llama"),
                     image_token_index=_ids(tok, "<image>")[0], vision_feature_layer=-2,
                     image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]])
    return config, anyres_processor(config, tok, None)


def _glm4v(model_type: str = "glm4v", text_type: str = "glm4v_text"):
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    names = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|video|>"]
    tok = demo_tokenizer(names, {"image_token": "<|image|>", "video_token": "<|video|>"})
    ids = dict(zip(names, _ids(tok, *names)))
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
              "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "image_size": 32}
    text = _text(tok, text_type, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
        "partial_rotary_factor": 1.0})
    config = _config(model_type, vision_config=vision, text_config=text,
                     image_start_token_id=ids["<|begin_of_image|>"],
                     image_end_token_id=ids["<|end_of_image|>"],
                     image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"])
    images = Glm4vImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48})
    return config, lenient_processor(_processor_class(model_type), image_processor=images,
                                     tokenizer=tok)


def _paddleocr_vl():
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import (
        PaddleOCRVLImageProcessorPil)
    names = ["<|IMAGE_START|>", "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>", "<|video_pad|>"]
    tok = demo_tokenizer(names, {"image_token": "<|IMAGE_PLACEHOLDER|>"})
    ids = dict(zip(names, _ids(tok, *names)))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 4,
              "spatial_merge_size": 2}
    text = _text(tok, "paddleocr_vl_text", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    config = _config("paddleocr_vl", vision_config=vision, text_config=text,
                     vision_start_token_id=ids["<|IMAGE_START|>"],
                     vision_end_token_id=ids["<|IMAGE_END|>"],
                     image_token_id=ids["<|IMAGE_PLACEHOLDER|>"],
                     video_token_id=ids["<|video_pad|>"])
    images = PaddleOCRVLImageProcessorPil(patch_size=4, temporal_patch_size=1, merge_size=2,
                                          min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(_processor_class("paddleocr_vl"), image_processor=images,
                                     tokenizer=tok)


def _qwen2_5_omni_thinker():
    """The thinker (the text-producing half) of Qwen2.5-Omni, on images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    named = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
             "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
             "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
    tok = demo_tokenizer(list(named.values()), named)
    ids = {k: _ids(tok, v)[0] for k, v in named.items()}
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
              "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 16, "fullatt_block_indexes": [1]}
    audio = {"num_mel_bins": 16, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 4,
             "encoder_ffn_dim": 64, "output_dim": 32, "n_window": 4, "max_source_positions": 64}
    text = _text(tok, "qwen2_5_omni_text", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    config = _config("qwen2_5_omni_thinker", vision_config=vision, audio_config=audio,
                     text_config=text, image_token_index=ids["image_token"],
                     video_token_index=ids["video_token"], audio_token_index=ids["audio_token"],
                     audio_start_token_id=ids["audio_bos_token"],
                     audio_end_token_id=ids["audio_eos_token"],
                     vision_start_token_id=ids["vision_bos_token"],
                     vision_end_token_id=ids["vision_eos_token"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(_processor_class("qwen2_5_omni_thinker"),
                                     image_processor=images, tokenizer=tok)


# -- deepstack families: vision features also added into the LLM's first layers (Qwen3-VL)
DEEPSTACK_VISION = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
                    "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2,
                    "temporal_patch_size": 2, "num_position_embeddings": 16,
                    "deepstack_visual_indexes": [0, 1]}
"""Two levels from a two-block tower, added after LLM layers 0 and 1 (the recipes' LLMs have
two layers, so the last level lands just before the final norm)."""
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
              "mrope_interleaved": True}


def _qwen3_vl(model_type: str, **text_extra):
    """Qwen3-VL (and its MoE LLM variant): a Qwen2-VL-like patch ViT with learned position
    embeddings and deepstack mergers, an interleaved M-RoPE Qwen3 LLM."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = demo_tokenizer(names, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    ids = dict(zip(names, _ids(tok, *names)))
    text = _text(tok, f"{model_type}_text", num_hidden_layers=2, rope_parameters=QWEN3_ROPE,
                 **text_extra)
    config = _config(model_type, vision_config=DEEPSTACK_VISION, text_config=text,
                     vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"],
                     image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(_processor_class(model_type), image_processor=images,
                                     tokenizer=tok)


# ---- recipes added by the second sweep (LLaVA-likes, OCR models, MoE LLMs, 4-axis rope)
def _pixtral(model_type: str, text_type: str, tokens: dict[str, str]):
    """Mistral3 (Mistral Small 3.x) and LightOnOCR: a Pixtral tower (2-D RoPE over any aspect
    ratio, one [IMG_BREAK] per row of patches), a patch merger, a Mistral or Qwen3 LLM."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    tok = demo_tokenizer(list(tokens.values()), tokens)
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8, "image_size": 64,
              "patch_size": 4}
    extra = {"sliding_window": None} if text_type == "mistral" else {}
    config = _config(model_type, vision_config=vision, text_config=_text(tok, text_type, **extra),
                     image_token_id=_ids(tok, tokens["image_token"])[0], spatial_merge_size=2)
    images = PixtralImageProcessorPil(size={"longest_edge": 48},
                                      patch_size={"height": 8, "width": 8})
    return config, lenient_processor(_processor_class(model_type), image_processor=images,
                                     tokenizer=tok, patch_size=4, spatial_merge_size=2)


def _llava_video(model_type: str):
    """LLaVA-NeXT-Video (any-resolution tiles) and Video-LLaVA (separate image and video towers),
    on images."""
    tok = demo_tokenizer(["<image>", "<video>"],
                         {"image_token": "<image>", "video_token": "<video>"})
    fields = {"image_token_index": _ids(tok, "<image>")[0],
              "video_token_index": _ids(tok, "<video>")[0]}
    if model_type == "llava_next_video":
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil as cls)
        fields["image_grid_pinpoints"] = [[32, 64], [64, 32], [64, 64]]
    else:
        from transformers.models.video_llava.image_processing_video_llava import (
            VideoLlavaImageProcessor as cls)
    config = _config(model_type, vision_config=CLIP, text_config=_text(tok, "llama"), **fields)
    images = cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                 **{k: v for k, v in fields.items() if k == "image_grid_pinpoints"})
    return config, lenient_processor(_processor_class(model_type), image_processor=images,
                                     tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
                                     vision_feature_select_strategy="default")


def _qianfan_ocr():
    """InternVL-like tiles with a Qwen3 LLM; the chat template's "<image>" is expanded."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    named = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>"}
    tok = demo_tokenizer([*named.values(), "<image>"], named)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": [32, 32], "patch_size": [8, 8]}
    config = _config("qianfan_ocr", vision_config=vision, text_config=_text(tok, "qwen3"),
                     image_token_id=_ids(tok, "<IMG_CONTEXT>")[0], downsample_ratio=0.5)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                      min_patches=1, max_patches=4)
    return config, lenient_processor(_processor_class("qianfan_ocr"), image_processor=images,
                                     tokenizer=tok, image_seq_length=4)


def _deepseek_vl(model_type: str):
    """DeepSeek-VL (SigLIP) and its hybrid (plus a SAM tower on a high-resolution copy)."""
    import importlib
    tok = demo_tokenizer(["<image_placeholder>"], {"image_token": "<image_placeholder>"})
    fields, sizes = {}, {}
    if model_type == "deepseek_vl_hybrid":
        fields["high_res_vision_config"] = {
            "hidden_size": 32, "output_channels": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 64, "patch_size": 8, "window_size": 4,
            "global_attn_indexes": [1], "mlp_dim": 64}
        sizes["high_res_size"] = {"height": 64, "width": 64}
    config = _config(model_type, vision_config=SIGLIP, text_config=_text(tok, "llama"),
                     image_token_id=_ids(tok, "<image_placeholder>")[0], **fields)
    module = importlib.import_module(
        f"transformers.models.{model_type}.image_processing_pil_{model_type}")
    prefix = {"deepseek_vl": "DeepseekVL", "deepseek_vl_hybrid": "DeepseekVLHybrid"}[model_type]
    images = getattr(module, f"{prefix}ImageProcessorPil")(size={"height": 32, "width": 32},
                                                            **sizes)
    return config, lenient_processor(_processor_class(model_type), image_processor=images,
                                     tokenizer=tok, num_image_tokens=16)


def _janus():
    """Janus's understanding path (SigLIP-like tower + aligner); its VQ generator is built tiny."""
    from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil
    named = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
             "eoi_token": "<end_of_image>"}
    tok = demo_tokenizer(list(named.values()), named)
    vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 8, "projection_dim": 32, "depth": 2,
              "num_image_tokens": 16}
    vq = {"embed_dim": 8, "num_embeddings": 16, "latent_channels": 32, "base_channels": 32,
          "channel_multiplier": [1, 1], "num_res_blocks": 1, "num_patches": 4,
          "projection_dim": 32, "image_token_embed_dim": 32, "num_hidden_layers": 1}
    config = _config("janus", vision_config=vision, vq_config=vq, text_config=_text(tok, "llama"),
                     image_token_id=_ids(tok, "<image_placeholder>")[0])
    images = JanusImageProcessorPil(size={"height": 32, "width": 32})
    return config, lenient_processor(_processor_class("janus"), image_processor=images,
                                     tokenizer=tok, num_image_tokens=16)


def _aria():
    """Aria: an Idefics3-style tower, cross-attention projector, MoE LLM. Its processor always
    resizes to 980 pixels (the processor's defaults override the image processor's), so the
    tiny tower takes 70-pixel patches."""
    from transformers.models.aria.image_processing_pil_aria import AriaImageProcessorPil
    tok = demo_tokenizer(["<|img|>"], {"image_token": "<|img|>"})
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 980, "patch_size": 70}
    text = _text(tok, "aria_text", moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1)
    config = _config("aria", vision_config=vision, text_config=text,
                     image_token_index=_ids(tok, "<|img|>")[0],
                     projector_patch_to_query_dict={196: 4})
    images = AriaImageProcessorPil(max_image_size=980, split_image=False)
    return config, lenient_processor(_processor_class("aria"), image_processor=images,
                                     tokenizer=tok, size_conversion={980: 4})


def _glm4v_moe():
    """GLM-4.5V: GLM-4V's tower and M-RoPE with a MoE LLM (its one layer routed)."""
    config, processor = _glm4v("glm4v_moe", "glm4v_moe_text")
    text = config.text_config
    for key, value in {"moe_intermediate_size": 16, "n_routed_experts": 4,
                       "num_experts_per_tok": 2, "first_k_dense_replace": 0}.items():
        setattr(text, key, value)
    return config, processor


def _qwen_vision_llm(model_type: str):
    """HyperCLOVA X vision v2 (Qwen2.5-VL tower) and VideoLLaMA3 (its own NaViT tower): Qwen-style
    image pads and grids, 1-D positions."""
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = demo_tokenizer(names, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    ids = dict(zip(names, _ids(tok, *names)))
    if model_type == "hyperclovax_vision_v2":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)
        vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
                  "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1]}
        text = _text(tok, "hyperclovax")
        images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                          min_pixels=8 * 8, max_pixels=48 * 48)
    else:
        from transformers.models.video_llama_3.image_processing_pil_video_llama_3 import (
            VideoLlama3ImageProcessorPil)
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "patch_size": 4}
        text = _text(tok)
        images = VideoLlama3ImageProcessorPil(patch_size=4, merge_size=1, min_pixels=8 * 8,
                                              max_pixels=32 * 32)
    config = _config(model_type, vision_config=vision, text_config=text,
                     image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    return config, lenient_processor(_processor_class(model_type), image_processor=images,
                                     tokenizer=tok)


def _qwen3_omni_moe_thinker():
    """The thinker of Qwen3-Omni (MoE LLM, deepstack vision tower, an audio tower), on images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
             "audio_token": "<|audio_pad|>", "vision_bos_token": "<|vision_start|>",
             "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
             "audio_eos_token": "<|audio_end|>"}
    tok = demo_tokenizer(list(named.values()), named)
    ids = {k: _ids(tok, v)[0] for k, v in named.items()}
    audio = {"num_mel_bins": 16, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 4,
             "encoder_ffn_dim": 64, "output_dim": 32, "n_window": 4, "max_source_positions": 64,
             "downsample_hidden_size": 8}
    text = _text(tok, "qwen3_omni_moe_text", num_hidden_layers=2, rope_parameters=QWEN3_ROPE,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    config = _config("qwen3_omni_moe_thinker", vision_config=DEEPSTACK_VISION,
                     audio_config=audio, text_config=text, image_token_id=ids["image_token"],
                     video_token_id=ids["video_token"], audio_token_id=ids["audio_token"],
                     audio_start_token_id=ids["audio_bos_token"],
                     vision_start_token_id=ids["vision_bos_token"],
                     vision_end_token_id=ids["vision_eos_token"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(_processor_class("qwen3_omni_moe_thinker"),
                                     image_processor=images, tokenizer=tok)


DEEPSTACK_RECIPES: dict[str, Callable] = {
    "qwen3_vl": lambda: _qwen3_vl("qwen3_vl"),
    "qwen3_vl_moe": lambda: _qwen3_vl("qwen3_vl_moe", num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16),
    "qwen3_omni_moe_thinker": _qwen3_omni_moe_thinker,
}


def _hunyuan_vl():
    """HunYuan-VL: a NaViT-style tower, images wrapped in <img_start>/<img_end>, 4-axis rope."""
    from transformers.models.hunyuan_vl.image_processing_pil_hunyuan_vl import (
        HunYuanVLImageProcessorPil)
    named = {"image_token": "<img>", "image_start_token": "<img_start>",
             "image_end_token": "<img_end>", "pad_token": "<pad>"}
    tok = demo_tokenizer([*named.values(), "<img_nl>"], named)
    ids = {k: _ids(tok, v)[0] for k, v in named.items()}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "out_hidden_size": 32, "patch_size": 4,
              "spatial_merge_size": 2, "text_hidden_size": 32, "max_image_size": 64,
              "min_image_size": 8}
    text = _text(tok, "hunyuan_vl_text", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 1, 1]})
    config = _config("hunyuan_vl", vision_config=vision, text_config=text,
                     image_token_id=ids["image_token"], im_start_id=ids["image_start_token"],
                     im_end_id=ids["image_end_token"], im_newline_id=_ids(tok, "<img_nl>")[0])
    images = HunYuanVLImageProcessorPil(patch_size=4, merge_size=2, min_pixels=8 * 8,
                                        max_pixels=48 * 48)
    return config, lenient_processor(_processor_class("hunyuan_vl"), image_processor=images,
                                     tokenizer=tok)


def _cosmos3_edge():
    """Cosmos3-Edge: a SigLIP2-style tower with a merger, Qwen-style pads, M-RoPE LLM."""
    from transformers.models.cosmos3_edge.image_processing_pil_cosmos3_edge import (
        Cosmos3EdgeImageProcessorPil)
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = demo_tokenizer(names, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    ids = dict(zip(names, _ids(tok, *names)))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "patch_size": 4, "num_patches": 64,
              "spatial_merge_size": 2}
    text = _text(tok, "cosmos3_edge_text", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    config = _config("cosmos3_edge", vision_config=vision, text_config=text,
                     projector_hidden_size=64, image_token_id=ids["<|image_pad|>"],
                     video_token_id=ids["<|video_pad|>"],
                     vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"])
    images = Cosmos3EdgeImageProcessorPil(patch_size=4, merge_size=2,
                                          size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48})
    return config, lenient_processor(_processor_class("cosmos3_edge"), image_processor=images,
                                     tokenizer=tok)


def _got_ocr2():
    """GOT-OCR 2.0: a SAM-style windowed tower whose 64x64 grid two stride-2 convolutions bring to
    the processor's fixed 256 tokens (one-pixel patches keep the tiny tower cheap)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    tok = demo_tokenizer(["<img>", "</img>", "<imgpad>"])
    vision = {"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 64, "patch_size": 1, "window_size": 8,
              "global_attn_indexes": [], "mlp_dim": 64}
    config = _config("got_ocr2", vision_config=vision, text_config=_text(tok),
                     image_token_index=_ids(tok, "<imgpad>")[0])
    images = GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}, crop_to_patches=False)
    return config, lenient_processor(_processor_class("got_ocr2"), image_processor=images,
                                     tokenizer=tok)


NOT_EXACT = {
    "ovis2": "besides image tokens, its visual indicator tokens (<IMG_START>, <IMG_GRID>, ...) "
             "are replaced by embeddings of the visual table; the generic adapter replaces image "
             "tokens only",
    "ernie4_5_vl_moe": "its MoE layers send image tokens to vision experts by "
                       "moe_mm_token_type_ids; the generic backbone runs the decoder layers "
                       "without it (every token would take the text experts)",
    "blip": "BlipForConditionalGeneration has no inner ...Model: its text decoder is a BERT-style "
            "decoder with cross-attention to the image, not a decoder-only LLM fed embeddings",
    "blip-2": "Blip2ForConditionalGeneration has no inner ...Model: its LLM is a whole "
              "...ForCausalLM (OPT or T5) with its own head, which the generic backbone cannot "
              "split",
    "florence2": "its language model is an encoder-decoder (BART); ds_omni's backbone is "
                 "decoder-only",
    "fuyu": "its Persimmon LLM has no `norm` (it is `final_layernorm`); the generic backbone "
            "needs embed_tokens, layers, norm and rotary_emb",
    "chameleon": "its forward sets the logits of the VQ image tokens to the dtype's minimum (no "
                 "image generation in text mode); ds_omni's head returns them as computed, so the "
                 "loss's softmax differs",
    "pp_chart2table": "HF's processor has no image token to expand (the chat template writes the "
                      "image's tokens itself), so nothing says how one image becomes tokens",
}
"""Families tried (a recipe, or their classes built on the meta device) that the generic adapter
is not exact for, with why."""


RECIPES: dict[str, Callable] = {
    "qwen2_5_omni_thinker": _qwen2_5_omni_thinker,
    "vipllava": _vipllava,
    "llava_next": _llava_next,
    "glm4v": _glm4v,
    "glm46v": lambda: _glm4v("glm46v", "glm4v_text"),
    "glmga": lambda: _glm4v("glmga", "glm4v_text"),
    "paddleocr_vl": _paddleocr_vl,
    "qwen2_vl": lambda: _qwen_vl("qwen2_vl"),
    "qwen2_5_vl": lambda: _qwen_vl("qwen2_5_vl"),
    "llava": _llava,
    "llava_onevision": _llava_onevision,
    "internvl": _internvl,
    "idefics3": lambda: _idefics3("idefics3"),
    "smolvlm": lambda: _idefics3("smolvlm"),
    **DEEPSTACK_RECIPES,
    # the second sweep's recipes
    "mistral3": lambda: _pixtral("mistral3", "mistral", {
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]"}),
    "lighton_ocr": lambda: _pixtral("lighton_ocr", "qwen3", {
        "image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>",
        "image_end_token": "<|vision_end|>"}),
    "llava_next_video": lambda: _llava_video("llava_next_video"),
    "video_llava": lambda: _llava_video("video_llava"),
    "qianfan_ocr": _qianfan_ocr,
    "deepseek_vl": lambda: _deepseek_vl("deepseek_vl"),
    "deepseek_vl_hybrid": lambda: _deepseek_vl("deepseek_vl_hybrid"),
    "janus": _janus,
    "aria": _aria,
    "glm4v_moe": _glm4v_moe,
    "hyperclovax_vision_v2": lambda: _qwen_vision_llm("hyperclovax_vision_v2"),
    "video_llama_3": lambda: _qwen_vision_llm("video_llama_3"),
    "hunyuan_vl": _hunyuan_vl,
    "cosmos3_edge": _cosmos3_edge,
    "got_ocr2": _got_ocr2,
}


# -------------------------------------------------- recipes: sliding windows, bidirectional blocks
# Small windows (4 tokens) so that every sample of the sweep is longer than its window.
def _gemma3(model_type: str = "gemma3"):
    """Gemma 3: image tokens attend to each other both ways; sliding and full layers, each with its
    own rope table; query_pre_attn_scalar scaling; tied, scaled embeddings."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>"}
    tok = demo_tokenizer(list(named.values()), named)
    ids = {k: _ids(tok, v)[0] for k, v in named.items()}
    text = _text(tok, "gemma3_text", num_hidden_layers=2, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=12,
                 tie_word_embeddings=True)
    config = _config(model_type, vision_config=SIGLIP, text_config=text, mm_tokens_per_image=4,
                     boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                     image_token_index=ids["image_token"], tie_word_embeddings=True)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return config, _processor_class(model_type)(image_processor=images, tokenizer=tok,
                                                image_seq_length=4)


def _paligemma():
    """PaliGemma: the whole prompt (image and text before the first trained token) attends both
    ways; 1-indexed positions; Gemma's scaled embeddings."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = 16  # (32 / 8) ** 2 patches, as PaliGemma's saved processors say
    processor = _processor_class("paligemma")(image_processor=images, tokenizer=tok)
    # (the processor adds its location and segmentation tokens: the vocabulary counts them)
    config = _config("paligemma", vision_config={**SIGLIP, "projection_dim": 32},
                     text_config=_text(tok, "gemma"), projection_dim=32,
                     image_token_index=_ids(tok, "<image>")[0])
    return config, processor


def _idefics2():
    """Idefics2: a perceiver resampler per image; Mistral LLM with a sliding window."""
    from transformers.models.idefics2.image_processing_pil_idefics2 import (
        Idefics2ImageProcessorPil)
    named = {"image_token": "<image>", "image_boundary_token": "<fake_token_around_image>"}
    tok = demo_tokenizer([*named.values(), "<end_of_utterance>"], named)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
    perceiver = {"resampler_n_latents": 4, "resampler_depth": 1, "resampler_n_heads": 4,
                 "resampler_head_dim": 8, "num_key_value_heads": 2}
    config = _config("idefics2", vision_config=vision, perceiver_config=perceiver,
                     text_config=_text(tok, "mistral", sliding_window=4),
                     image_token_id=_ids(tok, "<image>")[0])
    images = Idefics2ImageProcessorPil(size={"longest_edge": 32, "shortest_edge": 32},
                                       do_image_splitting=False)
    return config, lenient_processor(_processor_class("idefics2"), image_processor=images,
                                     tokenizer=tok, image_seq_len=4)




def _aya_vision():
    """Aya Vision: SigLIP tiles, pixel-shuffle projector; Cohere2 LLM (a sliding layer)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    names = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
             "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL"]
    tok = demo_tokenizer(names, {"image_token": "<image>"})
    text = _text(tok, "cohere2", sliding_window=4, layer_types=["sliding_attention"])
    config = _config("aya_vision", vision_config=SIGLIP, text_config=text,
                     image_token_index=_ids(tok, "<|IMG_PATCH|>")[0], downsample_factor=2)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                      min_patches=1, max_patches=4)
    return config, lenient_processor(_processor_class("aya_vision"), image_processor=images,
                                     tokenizer=tok, patch_size=8, img_size=32,
                                     downsample_factor=2)


def _exaone4_5():
    """EXAONE 4.5: a Qwen2.5-VL-style windowed ViT; EXAONE 4 LLM (a sliding layer)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    tok = demo_tokenizer(["<vision>", "</vision>", *named.values()], named)
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
              "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 16, "fullatt_block_indexes": [1], "num_key_value_heads": 2}
    text = _text(tok, "exaone4", sliding_window=4, layer_types=["sliding_attention"])
    config = _config("exaone4_5", vision_config=vision, text_config=text,
                     image_token_id=_ids(tok, "<|image_pad|>")[0],
                     video_token_id=_ids(tok, "<|video_pad|>")[0])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(_processor_class("exaone4_5"), image_processor=images,
                                     tokenizer=tok)


RECIPES.update({
    "gemma3": _gemma3,
    "paligemma": _paligemma,
    "idefics2": _idefics2,
    "aya_vision": _aya_vision,
    "exaone4_5": _exaone4_5,
})


# ------------------------------------------------------------------------------ checks
def images() -> list:
    """Three demo pictures at different sizes (32x32, 56 high x 84 wide, 24 x 40)."""
    from PIL import Image
    from ds_omni.data.demo import shapes_rows
    rows = shapes_rows(3, seed=5)
    img = [Image.open(io.BytesIO(r["image"]["bytes"])).convert("RGB") for r in rows]
    return [img[0], img[1].resize((84, 56)), img[2].resize((40, 24))]


def save_processor_parts(processor, out: Path) -> None:
    """Tokenizer, image processor and the processor's own settings, as `save_pretrained` writes
    them for a processor with all its parts."""
    import json
    processor.tokenizer.save_pretrained(str(out))
    settings = {k: v for k, v in processor.to_dict().items()
                if k not in processor.get_attributes() and k != "chat_template"}
    settings["image_processor"] = json.loads(processor.image_processor.to_json_string())
    (out / "processor_config.json").write_text(json.dumps(settings, indent=1, default=str))


def check_family(model_type: str, recipe: Callable, work: Path) -> Result:
    """Build, convert and compare one family (module docstring); the result says what failed."""
    from ds_omni.config import ModelConfig
    from ds_omni.model.build import build_model
    torch.manual_seed(0)
    config, processor = recipe()
    family_dir = work / model_type
    from ds_omni.model.family import family_for
    hf_model = family_for(model_type).build_hf(config).eval()
    hf_model.save_pretrained(str(family_dir), safe_serialization=True)
    save_processor_parts(processor, family_dir)
    built = build_model(ModelConfig(pretrained=str(family_dir)))
    reference = hf_model  # what was saved, bit for bit (a reload would cost a third of the check)
    worst = logits_gap(built, reference, processor)
    if worst > LOGITS_ATOL:
        return Result(False, f"logits differ from HF by {worst:.2g} (> {LOGITS_ATOL})")
    from ds_omni.model.convert import export_hf
    export_hf(built.model, work / f"{model_type}_export", built.tokenizer, model_dir=family_dir)
    exported = type(hf_model).from_pretrained(str(work / f"{model_type}_export"))
    ref, exp = reference.state_dict(), exported.state_dict()
    bad = [k for k in ref if k not in exp or not torch.equal(ref[k], exp[k])]
    if bad or ref.keys() != exp.keys():
        return Result(False, f"export round trip changes {bad[:3] or 'the keys'}")
    return Result(True, f"exact (max |logits diff| {worst:.1g}; bitwise round trip)")


def logits_gap(built, reference, processor) -> float:
    """Max |ours - HF| over a packed row of 3 samples: one image, text only, two images."""
    from ds_omni.data.packing import pack
    from ds_omni.data.processing import SampleProcessor
    img = images()
    media = {"one": [img[0]], "text": [], "two": [img[1], img[2]]}
    texts = {"one": "<image> a red circle", "text": "a caption without an image",
             "two": "<image><image> which is larger?"}
    proc = SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors, markers={"vision": "<image>"},
                           max_seq_len=4096)
    samples = [proc(text=texts[k], media={"vision": media[k]} if media[k] else {}, sample_id=k,
                    source="sweep") for k in media]
    with torch.no_grad():
        mb = pack(samples, built.item_processors)
        ours = built.model.logits(mb)[0]
        cu = mb.cu_seqlens.tolist()
        worst = 0.0
        for s, a, b in zip(samples, cu[:-1], cu[1:]):
            ref = reference(**hf_inputs(processor, built, s, media[s.sample_id])).logits[0]
            worst = max(worst, (ref - ours[a:b]).abs().max().item())
    return worst


def hf_inputs(processor, built, sample, imgs) -> dict:
    """What HF's processor gives the model for `sample`: its pixels (all the sample's images in
    one call), and its per-token type ids; the token ids are the sample's, whose image tokens
    must number what HF's processor expands them to."""
    from ds_omni.model.families.generic import image_token_id, processor_marker
    ids = sample.input_ids[None]
    # the processor's attention mask too: without one, some families (Qwen2.5-Omni's thinker)
    # silently fall back to 1-D positions
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if imgs:
        marker = processor_marker(processor, built.hf_config)
        hf = processor(text=[marker * len(imgs)], images=imgs, return_tensors="pt")
        token = image_token_id(built.hf_config)
        if int((hf["input_ids"] == token).sum()) != int((ids == token).sum()):
            raise AssertionError("HF's processor expands the images to another number of tokens")
        out.update({k: v for k, v in hf.items()
                    if k not in ("input_ids", "attention_mask", "token_type_ids",
                                 "mm_token_type_ids", "labels")})
    forward = inspect.signature(built.family.hf_model_class().forward).parameters
    make_types = getattr(processor, "create_mm_token_type_ids", None)
    if "token_type_ids" in forward and "mm_token_type_ids" not in forward:
        out["token_type_ids"] = hf_token_types(processor, ids, sample)
    elif make_types is not None and len(inspect.signature(make_types).parameters) == 1:
        out["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))
    return out


def hf_token_types(processor, ids: torch.Tensor, sample) -> torch.Tensor:
    """[1, L] `token_type_ids` as HF's processor makes them for a family whose attention mask
    reads them: PaliGemma's 1 on the suffix (its `suffix` argument: the text from the first trained
    token on), the others' (Gemma 3) 1 on image tokens."""
    if type(processor).__name__.startswith("PaliGemma"):
        trained = sample.loss_mask.nonzero()
        types = torch.zeros_like(ids)
        types[:, int(trained[0]) if len(trained) else ids.shape[1]:] = 1
        return types
    return torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))


# ------------------------------------------------------------------------------ sweep
def sweep(model_types: list[str] | None = None) -> dict[str, Result]:
    """{model_type: Result} for every type of the mapping (or those given), in mapping order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    out, threads = {}, torch.get_num_threads()
    # one thread: the tiny models' matmuls gain nothing from more, and on a busy machine a second
    # OpenMP thread makes each of them wait (measured 30x slower at load 12 on 2 cores)
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for model_type in model_types or list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
                out[model_type] = classify(model_type, Path(tmp))
    finally:
        torch.set_num_threads(threads)
    return out


def static_problem(model_type: str) -> str | None:
    """Why the generic adapter refuses `model_type`, from its classes and its default config."""
    from ds_omni.model.families.generic import class_problem, config_problem
    problem = class_problem(model_type) or processor_problem(model_type)
    if problem is not None:
        return problem
    try:
        problem = config_problem(_config(model_type))
    except Exception as e:  # noqa: BLE001  (a config class that cannot build its own defaults)
        return f"its default config does not build ({type(e).__name__})"
    return problem or image_processor_problem(model_type)


def processor_problem(model_type: str) -> str | None:
    """Why HF's processor of `model_type` (which the generic adapter cuts images with) is not at
    hand, or None."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from ds_omni.model.families.generic import processor_type
    name = PROCESSOR_MAPPING_NAMES.get(processor_type(model_type))
    if name is None:
        return "transformers maps no processor to it, so nothing says how its images become tokens"
    try:
        _processor_class(model_type).get_attributes()  # a placeholder class raises here
    except ImportError as e:
        needs = [w.strip(".,`") for w in str(e).split() if w.lower() in (
            "torchvision", "timm", "num2words", "librosa")]
        return f"HF's {name} needs {needs[0] if needs else 'a package'} (not installed here)"
    return None


def image_processor_problem(model_type: str) -> str | None:
    """Why HF's image processor of `model_type` is not at hand without torchvision, or None."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.utils import is_torchvision_available
    from ds_omni.model.families.generic import processor_type
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(processor_type(model_type))
    if isinstance(names, dict) and names and "pil" not in names and (
            not is_torchvision_available()):
        return (f"HF's image processor for it ({next(iter(names.values()))}) is torchvision-only, "
                "and the PyPI torchvision wheel (a CUDA build) does not load next to a CPU torch")
    return None


def classify(model_type: str, work: Path) -> Result:
    """The table row of `model_type`: checked exact by its recipe, or why not."""
    recipe = RECIPES.get(model_type)
    if model_type in NOT_EXACT:
        return Result(False, NOT_EXACT[model_type])
    if recipe is None:
        problem = static_problem(model_type)
        if problem is not None:
            return Result(False, problem)
        return Result(False, "not verified: the sweep has no tiny recipe for it yet (the generic "
                             "adapter loads it; exactness unchecked)")
    try:
        return check_family(model_type, recipe, work)
    except Exception as e:  # noqa: BLE001  (every failure is a row of the table)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Result(False, f"{type(e).__name__}: {first[:300]}")


def table(results: dict[str, Result]) -> str:
    width = max(map(len, results), default=10)
    lines = [f"{'model_type':{width}}  supported  reason"]
    lines += [f"{t:{width}}  {'yes' if r.supported else 'no':9}  {r.reason}"
              for t, r in results.items()]
    done = sum(r.supported for r in results.values())
    lines.append(f"{done} of {len(results)} supported ({100 * done / max(len(results), 1):.0f} %)")
    return "\n".join(lines)
