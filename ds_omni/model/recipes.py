"""Tiny recipes for the coverage sweep (`ds_omni.model.coverage`): per model type, a random HF
config (hidden 32, one to three LLM layers, tiny towers) and a processor built from parts, no hub.

A recipe returns (config, processor). The sweep saves both, loads them through the real loading
path and compares against HF; `NOT_EXACT` names the types tried and found not exact, with why.
"""

from __future__ import annotations

from typing import Callable

TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}


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


def processor_class_for(model_type: str):
    from ds_omni.model.families.generic import processor_class
    return processor_class(model_type)


def config_for(model_type: str, **fields):
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
    config = config_for("llava", vision_config=CLIP, text_config=_text(tok, "llama"),
                     image_token_index=_ids(tok, "<image>")[0], vision_feature_layer=-2)
    images = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32})
    return config, processor_class_for("llava")(image_processor=images, tokenizer=tok, patch_size=8,
                                             vision_feature_select_strategy="default",
                                             num_additional_image_tokens=1)


def _llava_onevision():
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)
    tok = demo_tokenizer(["<image>", "<video>"],
                         {"image_token": "<image>", "video_token": "<video>"})
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    config = config_for("llava_onevision", vision_config=SIGLIP, text_config=_text(tok),
                     image_token_index=_ids(tok, "<image>")[0],
                     video_token_index=_ids(tok, "<video>")[0], image_grid_pinpoints=pinpoints)
    images = LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32},
                                             image_grid_pinpoints=pinpoints)
    return config, lenient_processor(processor_class_for("llava_onevision"), image_processor=images,
                                     tokenizer=tok, num_image_tokens=16,
                                     vision_feature_select_strategy="full")


def _internvl():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    named = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    tok = demo_tokenizer(list(named.values()), named)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": [32, 32], "patch_size": [8, 8]}
    config = config_for("internvl", vision_config=vision, text_config=_text(tok),
                     image_token_id=_ids(tok, "<IMG_CONTEXT>")[0], downsample_ratio=0.5)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                      min_patches=1, max_patches=4)
    return config, lenient_processor(processor_class_for("internvl"), image_processor=images,
                                     tokenizer=tok, image_seq_length=4)


def _idefics3(model_type: str):
    import importlib
    tokens = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
              *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]
    tok = demo_tokenizer(tokens)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
    config = config_for(model_type, vision_config=vision, text_config=_text(tok, "llama"),
                     image_token_id=_ids(tok, "<image>")[0], scale_factor=2)
    module = importlib.import_module(
        f"transformers.models.{model_type}.image_processing_pil_{model_type}")
    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[model_type]
    cls = getattr(module, f"{prefix}ImageProcessorPil")
    images = cls(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
                                     tokenizer=tok, image_seq_len=4)


def _vipllava():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    config = config_for("vipllava", vision_config=CLIP, text_config=_text(tok, "llama"),
                     image_token_index=_ids(tok, "<image>")[0], vision_feature_layer=[-2, -1])
    images = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32})
    return config, processor_class_for("vipllava")(image_processor=images, tokenizer=tok, patch_size=8,
                                                vision_feature_select_strategy="default",
                                                num_additional_image_tokens=1)


def _llava_next():
    from ds_omni.model.families.llava_next import anyres_processor
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    config = config_for("llava_next", vision_config=CLIP, text_config=_text(tok, "llama"),
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
    config = config_for(model_type, vision_config=vision, text_config=text,
                     image_start_token_id=ids["<|begin_of_image|>"],
                     image_end_token_id=ids["<|end_of_image|>"],
                     image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"])
    images = Glm4vImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48})
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
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
    config = config_for("paddleocr_vl", vision_config=vision, text_config=text,
                     vision_start_token_id=ids["<|IMAGE_START|>"],
                     vision_end_token_id=ids["<|IMAGE_END|>"],
                     image_token_id=ids["<|IMAGE_PLACEHOLDER|>"],
                     video_token_id=ids["<|video_pad|>"])
    images = PaddleOCRVLImageProcessorPil(patch_size=4, temporal_patch_size=1, merge_size=2,
                                          min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for("paddleocr_vl"), image_processor=images,
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
    config = config_for("qwen2_5_omni_thinker", vision_config=vision, audio_config=audio,
                     text_config=text, image_token_index=ids["image_token"],
                     video_token_index=ids["video_token"], audio_token_index=ids["audio_token"],
                     audio_start_token_id=ids["audio_bos_token"],
                     audio_end_token_id=ids["audio_eos_token"],
                     vision_start_token_id=ids["vision_bos_token"],
                     vision_end_token_id=ids["vision_eos_token"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for("qwen2_5_omni_thinker"),
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
    config = config_for(model_type, vision_config=DEEPSTACK_VISION, text_config=text,
                     vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"],
                     image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
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
    config = config_for(model_type, vision_config=vision, text_config=_text(tok, text_type, **extra),
                     image_token_id=_ids(tok, tokens["image_token"])[0], spatial_merge_size=2)
    images = PixtralImageProcessorPil(size={"longest_edge": 48},
                                      patch_size={"height": 8, "width": 8})
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
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
    config = config_for(model_type, vision_config=CLIP, text_config=_text(tok, "llama"), **fields)
    images = cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                 **{k: v for k, v in fields.items() if k == "image_grid_pinpoints"})
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
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
    config = config_for("qianfan_ocr", vision_config=vision, text_config=_text(tok, "qwen3"),
                     image_token_id=_ids(tok, "<IMG_CONTEXT>")[0], downsample_ratio=0.5)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                      min_patches=1, max_patches=4)
    return config, lenient_processor(processor_class_for("qianfan_ocr"), image_processor=images,
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
    config = config_for(model_type, vision_config=SIGLIP, text_config=_text(tok, "llama"),
                     image_token_id=_ids(tok, "<image_placeholder>")[0], **fields)
    module = importlib.import_module(
        f"transformers.models.{model_type}.image_processing_pil_{model_type}")
    prefix = {"deepseek_vl": "DeepseekVL", "deepseek_vl_hybrid": "DeepseekVLHybrid"}[model_type]
    images = getattr(module, f"{prefix}ImageProcessorPil")(size={"height": 32, "width": 32},
                                                            **sizes)
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
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
    config = config_for("janus", vision_config=vision, vq_config=vq, text_config=_text(tok, "llama"),
                     image_token_id=_ids(tok, "<image_placeholder>")[0])
    images = JanusImageProcessorPil(size={"height": 32, "width": 32})
    return config, lenient_processor(processor_class_for("janus"), image_processor=images,
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
    config = config_for("aria", vision_config=vision, text_config=text,
                     image_token_index=_ids(tok, "<|img|>")[0],
                     projector_patch_to_query_dict={196: 4})
    images = AriaImageProcessorPil(max_image_size=980, split_image=False)
    return config, lenient_processor(processor_class_for("aria"), image_processor=images,
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
    config = config_for(model_type, vision_config=vision, text_config=text,
                     image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
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
    config = config_for("qwen3_omni_moe_thinker", vision_config=DEEPSTACK_VISION,
                     audio_config=audio, text_config=text, image_token_id=ids["image_token"],
                     video_token_id=ids["video_token"], audio_token_id=ids["audio_token"],
                     audio_start_token_id=ids["audio_bos_token"],
                     vision_start_token_id=ids["vision_bos_token"],
                     vision_end_token_id=ids["vision_eos_token"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for("qwen3_omni_moe_thinker"),
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
    config = config_for("hunyuan_vl", vision_config=vision, text_config=text,
                     image_token_id=ids["image_token"], im_start_id=ids["image_start_token"],
                     im_end_id=ids["image_end_token"], im_newline_id=_ids(tok, "<img_nl>")[0])
    images = HunYuanVLImageProcessorPil(patch_size=4, merge_size=2, min_pixels=8 * 8,
                                        max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for("hunyuan_vl"), image_processor=images,
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
    config = config_for("cosmos3_edge", vision_config=vision, text_config=text,
                     projector_hidden_size=64, image_token_id=ids["<|image_pad|>"],
                     video_token_id=ids["<|video_pad|>"],
                     vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"])
    images = Cosmos3EdgeImageProcessorPil(patch_size=4, merge_size=2,
                                          size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48})
    return config, lenient_processor(processor_class_for("cosmos3_edge"), image_processor=images,
                                     tokenizer=tok)


def _got_ocr2():
    """GOT-OCR 2.0: a SAM-style windowed tower whose 64x64 grid two stride-2 convolutions bring to
    the processor's fixed 256 tokens (one-pixel patches keep the tiny tower cheap)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    tok = demo_tokenizer(["<img>", "</img>", "<imgpad>"])
    vision = {"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 64, "patch_size": 1, "window_size": 8,
              "global_attn_indexes": [], "mlp_dim": 64}
    config = config_for("got_ocr2", vision_config=vision, text_config=_text(tok),
                     image_token_index=_ids(tok, "<imgpad>")[0])
    images = GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}, crop_to_patches=False)
    return config, lenient_processor(processor_class_for("got_ocr2"), image_processor=images,
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
    "fuyu": "HF's PIL image processor for it fails in its own patchify_image (a numpy transpose "
            "on a torch tensor, transformers 5.24) and its torchvision one does not load next to "
            "a CPU torch; its Persimmon LLM (final norm `final_layernorm`) fits the backbone",
    "shieldgemma2": "transformers cannot load a ShieldGemma 2 checkpoint into the class its "
                    "image-text-to-text mapping names (Gemma3ForConditionalGeneration): the "
                    "saved keys keep a `model.` prefix (its key mapping is for "
                    "ShieldGemma2ForImageClassification) and every weight loads as missing; "
                    "its model is Gemma 3's, which is exact",
    "emu3": "HF pads the images of one call to the largest and its VQ-VAE's convolutions see the "
            "padding, so an image's codes depend on the other images of the sample (its tiny "
            "recipe's logits differ by 0.6 from the second, smaller image on); ds_omni encodes "
            "each image alone",
    "pp_chart2table": "HF's processor has no image token to expand (the chat template writes the "
                      "image's tokens itself), so nothing says how one image becomes tokens",
}
"""Families tried (a recipe, or their classes built on the meta device) that the generic adapter
is not exact for, with why."""

NO_RECIPE = {
    "deepseek_ocr2": "not verified: its vision encoder's learned queries are fixed at 256 for the "
                     "1024-pixel global view and 144 per 768-pixel tile (query_1024_resolution, "
                     "query_768_resolution), so the smallest check runs its SAM tower over "
                     "1024-pixel images, too slow for the sweep (the generic adapter loads it)",
}
"""Types the sweep has no tiny recipe for, with why (the others say "no recipe yet")."""


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
    config = config_for(model_type, vision_config=SIGLIP, text_config=text, mm_tokens_per_image=4,
                     boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                     image_token_index=ids["image_token"], tie_word_embeddings=True)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return config, processor_class_for(model_type)(image_processor=images, tokenizer=tok,
                                                image_seq_length=4)


def _paligemma():
    """PaliGemma: the whole prompt (image and text before the first trained token) attends both
    ways; 1-indexed positions; Gemma's scaled embeddings."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = 16  # (32 / 8) ** 2 patches, as PaliGemma's saved processors say
    processor = processor_class_for("paligemma")(image_processor=images, tokenizer=tok)
    # (the processor adds its location and segmentation tokens: the vocabulary counts them)
    config = config_for("paligemma", vision_config={**SIGLIP, "projection_dim": 32},
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
    config = config_for("idefics2", vision_config=vision, perceiver_config=perceiver,
                     text_config=_text(tok, "mistral", sliding_window=4),
                     image_token_id=_ids(tok, "<image>")[0])
    images = Idefics2ImageProcessorPil(size={"longest_edge": 32, "shortest_edge": 32},
                                       do_image_splitting=False)
    return config, lenient_processor(processor_class_for("idefics2"), image_processor=images,
                                     tokenizer=tok, image_seq_len=4)




def _aya_vision():
    """Aya Vision: SigLIP tiles, pixel-shuffle projector; Cohere2 LLM (a sliding layer)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    names = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
             "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL"]
    tok = demo_tokenizer(names, {"image_token": "<image>"})
    text = _text(tok, "cohere2", sliding_window=4, layer_types=["sliding_attention"])
    config = config_for("aya_vision", vision_config=SIGLIP, text_config=text,
                     image_token_index=_ids(tok, "<|IMG_PATCH|>")[0], downsample_factor=2)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                      min_patches=1, max_patches=4)
    return config, lenient_processor(processor_class_for("aya_vision"), image_processor=images,
                                     tokenizer=tok, patch_size=8, img_size=32,
                                     downsample_factor=2)


def _exaone4_5():
    """EXAONE 4.5: a Qwen2.5-VL-style windowed ViT; EXAONE 4 LLM (a sliding layer)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    tok = demo_tokenizer(["<vision>", "</vision>", *named.values()], named)
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
              "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 16, "fullatt_block_indexes": [1], "num_key_value_heads": 2}
    text = _text(tok, "exaone4", sliding_window=4, layer_types=["sliding_attention"])
    config = config_for("exaone4_5", vision_config=vision, text_config=text,
                     image_token_id=_ids(tok, "<|image_pad|>")[0],
                     video_token_id=_ids(tok, "<|video_pad|>")[0])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for("exaone4_5"), image_processor=images,
                                     tokenizer=tok)


RECIPES.update({
    "gemma3": _gemma3,
    "paligemma": _paligemma,
    "idefics2": _idefics2,
    "aya_vision": _aya_vision,
    "exaone4_5": _exaone4_5,
})


# ---------------------------------- recipes: multipliers and soft-capping outside the modules
def _granite_docling():
    """Granite-Docling: Idefics3-like tiles, a Granite LLM (embedding_multiplier on the merged
    embeddings, logits divided by logits_scaling, residual / attention multipliers in modules)."""
    from transformers.models.granite_docling.image_processing_pil_granite_docling import (
        GraniteDoclingImageProcessorPil)
    tokens = ["<fake_token_around_image>", "<image>", "<global-img>",
              *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]
    tok = demo_tokenizer(tokens, {"image_token": "<image>"})
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "out_hidden_size": 32,
              "scale_factor": 2, "deepstack_visual_indexes": [0, 1]}
    text = _text(tok, "granite_docling_text", num_hidden_layers=2, embedding_multiplier=12.0,
                 logits_scaling=4.0, residual_multiplier=0.263, attention_multiplier=0.125,
                 pad_token_id=0)
    config = config_for("granite_docling", vision_config=vision, text_config=text,
                        image_token_id=_ids(tok, "<image>")[0], tie_word_embeddings=False,
                        pad_token_id=0)
    images = GraniteDoclingImageProcessorPil(size={"height": 32, "width": 32}, max_patches=4)
    return config, lenient_processor(processor_class_for("granite_docling"),
                                     image_processor=images, tokenizer=tok, image_seq_len=4)


SCALED_RECIPES: dict[str, Callable] = {
    "granite_docling": _granite_docling,
}
RECIPES.update(SCALED_RECIPES)



# ------------------------------------------- recipes: tokens the head must not emit (Chameleon)
def _vq_name(code: int) -> str:
    """Chameleon's vocabulary name of VQ code `code`: its digits as letters A-J, then "Z"."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def _chameleon():
    """Chameleon: a VQ-VAE turns an image into codes, whose token embeddings replace <image>; in
    text mode its forward sets the VQ tokens' logits to the dtype's minimum."""
    from transformers.models.chameleon.image_processing_pil_chameleon import (
        ChameleonImageProcessorPil)
    codes = 16
    named = {"image_token": "<image>", "boi_token": "<racm3:break>", "eoi_token": "<eoss>"}
    tok = demo_tokenizer([*named.values(), *map(_vq_name, range(codes))], named)
    vq = {"embed_dim": 8, "num_embeddings": codes, "latent_channels": 8, "resolution": 32,
          "base_channels": 32, "channel_multiplier": [1, 1, 1, 1], "num_res_blocks": 1,
          "attn_resolutions": []}
    text = {k: v for k, v in _text(tok, "chameleon").items() if k not in ("model_type", "head_dim")}
    config = config_for("chameleon", **text, vq_config=vq, vocabulary_map=tok.get_vocab())
    images = ChameleonImageProcessorPil(size={"shortest_edge": 32},
                                        crop_size={"height": 32, "width": 32})
    return config, processor_class_for("chameleon")(image_processor=images, tokenizer=tok,
                                                    image_seq_length=16)


SCALED_RECIPES["chameleon"] = _chameleon
RECIPES["chameleon"] = _chameleon


def _gemma4():
    """Gemma 4 (its smaller models' shape: causal image tokens): a 2-D rope ViT with pooled soft
    tokens, sliding and full layers (each with its own rope and head size), the logits soft-capped
    by final_logit_softcapping; no per-layer input embeddings, no shared KV layers."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>", "boa_token": "<start_of_audio>",
             "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}
    tok = demo_tokenizer([*named.values(), "<|video|>"], named)
    tok.image_token_id = _ids(tok, "<image_soft_token>")[0]
    tok.audio_token_id = _ids(tok, "<audio_soft_token>")[0]
    ids = {k: _ids(tok, v)[0] for k, v in named.items()}
    text = _text(tok, "gemma4_text", num_hidden_layers=2, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
                 hidden_size_per_layer_input=0, tie_word_embeddings=True, global_head_dim=16)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
              "patch_size": 4, "position_embedding_size": 64}
    config = config_for("gemma4", text_config=text, vision_config=vision, audio_config=None,
                        boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
                        image_token_id=ids["image_token"], boa_token_id=ids["boa_token"],
                        eoa_token_index=ids["eoa_token"], audio_token_id=ids["audio_token"],
                        video_token_id=_ids(tok, "<|video|>")[0], tie_word_embeddings=True)
    images = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    return config, lenient_processor(processor_class_for("gemma4"), image_processor=images,
                                     tokenizer=tok, image_seq_length=70)


SCALED_RECIPES["gemma4"] = _gemma4
RECIPES["gemma4"] = _gemma4



def _cohere_compass():
    """Cohere Compass (North Vision): a Qwen3-VL-like deepstack tower; a Cohere LLM with M-RoPE
    per layer type whose forward multiplies the logits by logit_scale."""
    from transformers.models.cohere_compass.image_processing_pil_cohere_compass import (
        CohereCompassImageProcessorPil)
    names = ["<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>", "<|VIDEO_PAD|>"]
    tok = demo_tokenizer(names, {"image_token": "<|IMAGE_PAD|>", "video_token": "<|VIDEO_PAD|>"})
    ids = dict(zip(names, _ids(tok, *names)))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = _text(tok, "cohere_compass_text", num_hidden_layers=2, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"], logit_scale=0.5,
                 rope_parameters={"sliding_attention": rope, "full_attention": rope})
    config = config_for("cohere_compass", vision_config=DEEPSTACK_VISION, text_config=text,
                        image_token_id=ids["<|IMAGE_PAD|>"], video_token_id=ids["<|VIDEO_PAD|>"],
                        vision_start_token_id=ids["<|VISION_START|>"],
                        vision_end_token_id=ids["<|VISION_END|>"])
    images = CohereCompassImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                            size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48})
    return config, lenient_processor(processor_class_for("cohere_compass"),
                                     image_processor=images, tokenizer=tok)


SCALED_RECIPES["cohere_compass"] = _cohere_compass
RECIPES["cohere_compass"] = _cohere_compass


# ---- LLMs with layers run once per sample (`ds_omni.model.per_sample`): linear attention
GATED_DELTA = {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2,
               "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
               "rope_parameters": {**QWEN3_ROPE, "partial_rotary_factor": 0.5}}
"""A Qwen3.5 LLM: a gated delta net layer, then a full-attention one (partial rotary)."""


def _qwen3_5(model_type: str, **text_extra):
    """Qwen3.5 (and its MoE LLM variant): a Qwen3-VL-like tower without deepstack, an LLM of
    gated delta net and attention layers."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = demo_tokenizer(names, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    ids = dict(zip(names, _ids(tok, *names)))
    vision = {k: v for k, v in DEEPSTACK_VISION.items() if k != "deepstack_visual_indexes"}
    text = _text(tok, f"{model_type}_text", **GATED_DELTA, **text_extra)
    config = config_for(model_type, vision_config=vision, text_config=text,
                        vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"],
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
                                     tokenizer=tok)


RECIPES.update({
    "qwen3_5": lambda: _qwen3_5("qwen3_5"),
    "qwen3_5_moe": lambda: _qwen3_5("qwen3_5_moe", num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=16, shared_expert_intermediate_size=16),
})


def _lfm3_vl():
    """LFM3-VL: a NaViT-style tower of convolution and attention blocks; an LFM3 LLM of gated
    short-convolution, sliding-window and full-attention layers (its final norm is named
    `embedding_norm`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = demo_tokenizer(names, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    ids = dict(zip(names, _ids(tok, *names)))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    text = _text(tok, "lfm3", num_hidden_layers=3, pad_token_id=tok.pad_token_id,
                 layer_types=["conv", "sliding_attention", "full_attention"], sliding_window=4,
                 conv_L_cache=3)
    config = config_for("lfm3_vl", vision_config=vision, text_config=text,
                        projector_hidden_size=64, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for("lfm3_vl"), image_processor=images,
                                     tokenizer=tok)


RECIPES["lfm3_vl"] = _lfm3_vl


def _dots3_note():
    """dots3-note: DeepSeek-style MLA LLM of an indexed (top-k sparse) layer and a sliding one,
    a MoE layer; top-k 4 and window 4, so every sample outruns both."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    names = ["<|imgpad|>", "<|video_pad|>", "<|audio_comp_pad|>"]
    tok = demo_tokenizer(names)
    ids = dict(zip(names, _ids(tok, *names)))
    mla = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
           "v_head_dim": 8, "head_dim": 8}
    text = {"model_type": "dots3_note_text", "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 16, "shared_experts_intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "max_position_embeddings": 1024,
            "index_topk": 4, "index_head_dim": 8, "index_n_heads": 2,
            "layer_types": ["indexed_attention", "sliding_attention"], "sliding_window": 4,
            "mlp_layer_types": ["dense", "sparse"], **mla,
            **{f"swa_{k}": v for k, v in {**mla, "num_attention_heads": 4,
                                          "num_key_value_heads": 4}.items()}}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "patch_size": 4, "spatial_merge_size": 2,
              "adapter_in_dim": 32, "adapter_out_dim": 32, "adapter_merge_size": 2,
              "mlp_layer_types": ["dense", "dense"], "moe_intermediate_size": 16}
    audio = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "feature_size": 16, "downsample_hidden_size": 8,
             "adapter_input_size": 32, "adapter_out_dim": 32}
    config = config_for("dots3_note", text_config=text, vision_config=vision, audio_config=audio,
                        image_token_id=ids["<|imgpad|>"], video_token_id=ids["<|video_pad|>"],
                        audio_token_id=ids["<|audio_comp_pad|>"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=1, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for("dots3_note"), image_processor=images,
                                     tokenizer=tok)


RECIPES["dots3_note"] = _dots3_note


def _minicpm_reason(processor: str) -> str:
    return (f"HF's processor ({processor}) reads its video processor's settings when it is built, "
            "and that video processor is torchvision-only (the PyPI torchvision wheel, a CUDA "
            "build, does not load next to a CPU torch); its LLM, Qwen3.5's gated delta net and "
            "attention layers, is exact (see qwen3_5)")


NOT_EXACT.update({
    "minicpmv4_6": _minicpm_reason("MiniCPMV4_6Processor"),
    "minicpmv4_7": _minicpm_reason("MiniCPMV4_7Processor"),
})


_HYPER = ("keeps several residual streams per token (hyper-connections: the model's forward widens "
          "the hidden states before the first layer and mixes them after the last), which the "
          "backbone, running hidden states [T, D] from layer to layer, does not")
NOT_EXACT.update({
    "qwen4_exp": f"its LLM {_HYPER}, and adds per-layer embeddings of the input ids (PLE, n-gram "
                 "tables) inside its layers; its linear-attention layers would run per sample, "
                 "its indexed ones too",
    "glm5_next": f"its LLM {_HYPER}, and its decoder layers return (hidden states, top-k indices) "
                 "that the next layer reuses (cross-layer top-k sharing)",
    "hy_v4_vl": f"its LLM {_HYPER}, its decoder layers return (hidden states, top-k indices) that "
                "the next layer reuses (cross-layer top-k sharing), and its attention adds "
                "learned sinks, which the packed kernels do not",
})


def _mistral_large4():
    """Mistral Large 4: Mistral3's Pixtral tower and patch merger; a DeepSeek-V3.2-style MLA LLM
    of indexed (top-k sparse) layers, one with rope and one without (no_rope_layers), a dense
    then a MoE MLP, its logits soft-capped; top-k 4, so every sample outruns the indexer."""
    config, processor = _pixtral("mistral_large4", "mistral", {
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})
    tok = processor.tokenizer
    text = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 16,
            "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "index_topk": 4,
            "index_head_dim": 8, "index_n_heads": 2, "no_rope_layers": [1, 0],
            "final_logit_softcapping": 3.0, "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                "original_max_position_embeddings": 512, "beta_fast": 32.0,
                                "beta_slow": 1.0, "attention_factor": 1.0},
            "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = config_for("mistral_large4", vision_config=config.vision_config.to_dict(),
                        text_config=text, image_token_index=config.image_token_index,
                        spatial_merge_size=2)
    return config, processor


RECIPES["mistral_large4"] = _mistral_large4


def _ernie4_5_vl_moe():
    """ERNIE-4.5-VL: a Qwen2-VL-like patch ViT and a resampler; an M-RoPE MoE LLM whose MoE layer
    sends image tokens (and their start / end tokens) to vision experts, text tokens to text
    ones, by moe_mm_token_type_ids (`GenericFamily.layer_inputs`)."""
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil)
    named = {"image_token": "<|IMAGE_PLACEHOLDER|>", "image_start_token": "<|IMAGE_START|>",
             "image_end_token": "<|IMAGE_END|>", "video_token": "<|VIDEO_PLACEHOLDER|>",
             "video_start_token": "<|VIDEO_START|>", "video_end_token": "<|VIDEO_END|>"}
    tok = demo_tokenizer(list(named.values()), named)
    ids = {k: _ids(tok, v)[0] for k, v in named.items()}
    for key, value in ids.items():
        setattr(tok, f"{key}_id", value)
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_merge_size": 2}
    text = _text(tok, "ernie4_5_vl_moe_text", num_hidden_layers=2, moe_intermediate_size=[16, 8],
                 moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                  "mrope_section": [1, 1, 2]})
    config = config_for("ernie4_5_vl_moe", vision_config=vision, text_config=text,
                        **{f"{k}_id": v for k, v in ids.items()})
    images = Ernie4_5_VLMoeImageProcessorPil(patch_size=4, merge_size=2,
                                             size={"shortest_edge": 8 * 8,
                                                   "longest_edge": 48 * 48})
    return config, lenient_processor(processor_class_for("ernie4_5_vl_moe"),
                                     image_processor=images, tokenizer=tok)


RECIPES["ernie4_5_vl_moe"] = _ernie4_5_vl_moe
del NOT_EXACT["ernie4_5_vl_moe"]
