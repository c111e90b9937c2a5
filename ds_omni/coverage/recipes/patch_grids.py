"""Recipes of the common pattern: LLaVA-likes, Qwen2-VL / Qwen2.5-VL / Qwen3-VL (deepstack),
Idefics3 / SmolVLM, InternVL, GLM-4V, the OCR models, MoE LLMs, 4-axis rope."""

from __future__ import annotations

from typing import Callable

from ds_omni.coverage.recipes.common import (CLIP, NOT_EXACT, RECIPES, SIGLIP, TEXT, config_for,
                                             demo_tokenizer, lenient_processor, processor_class_for,
                                             tiny_text, token_ids)


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
    config = config_for("llava", vision_config=CLIP, text_config=tiny_text(tok, "llama"),
                        image_token_index=token_ids(tok, "<image>")[0], vision_feature_layer=-2)
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
    config = config_for("llava_onevision", vision_config=SIGLIP, text_config=tiny_text(tok),
                        image_token_index=token_ids(tok, "<image>")[0],
                     video_token_index=token_ids(tok, "<video>")[0], image_grid_pinpoints=pinpoints)
    images = LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32},
                                             image_grid_pinpoints=pinpoints)
    return config, lenient_processor(processor_class_for("llava_onevision"), image_processor=images,
                                     tokenizer=tok, num_image_tokens=16,
                                     vision_feature_select_strategy="full")


INTERN_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                 "context_image_token": "<IMG_CONTEXT>"}


def _intern_tiles(model_type: str, named: dict, tokens: list[str], llm: str = "qwen2"):
    """InternVL's tower over GOT-OCR2's tiles (crop to 1-4 patches of 32 pixels)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    tok = demo_tokenizer(tokens, named)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": [32, 32], "patch_size": [8, 8]}
    config = config_for(model_type, vision_config=vision, text_config=tiny_text(tok, llm),
                        image_token_id=token_ids(tok, "<IMG_CONTEXT>")[0], downsample_ratio=0.5)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                      min_patches=1, max_patches=4)
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
                                     tokenizer=tok, image_seq_length=4)


def _internvl():
    named = {**INTERN_TOKENS, "video_token": "<video>"}
    return _intern_tiles("internvl", named, list(named.values()))


def _idefics3(model_type: str):
    import importlib
    tokens = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
              *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]
    tok = demo_tokenizer(tokens)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
    config = config_for(model_type, vision_config=vision, text_config=tiny_text(tok, "llama"),
                        image_token_id=token_ids(tok, "<image>")[0], scale_factor=2)
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
    config = config_for("vipllava", vision_config=CLIP, text_config=tiny_text(tok, "llama"),
                        image_token_index=token_ids(tok, "<image>")[0],
                        vision_feature_layer=[-2, -1])
    images = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32})
    return config, processor_class_for("vipllava")(
        image_processor=images, tokenizer=tok, patch_size=8,
        vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _llava_next():
    from ds_omni.model.families.llava_next import anyres_processor
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    config = config_for("llava_next", vision_config=CLIP, text_config=tiny_text(tok, "llama"),
                        image_token_index=token_ids(tok, "<image>")[0], vision_feature_layer=-2,
                        image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]])
    return config, anyres_processor(config, tok, None)


def _glm4v(model_type: str = "glm4v", text_type: str = "glm4v_text"):
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    names = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|video|>"]
    tok = demo_tokenizer(names, {"image_token": "<|image|>", "video_token": "<|video|>"})
    ids = dict(zip(names, token_ids(tok, *names)))
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
              "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "image_size": 32}
    text = tiny_text(tok, text_type, rope_parameters={
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
    ids = dict(zip(names, token_ids(tok, *names)))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 4,
              "spatial_merge_size": 2}
    text = tiny_text(tok, "paddleocr_vl_text", rope_parameters={
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
    ids = {k: token_ids(tok, v)[0] for k, v in named.items()}
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
              "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 16, "fullatt_block_indexes": [1]}
    audio = {"num_mel_bins": 16, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 4,
             "encoder_ffn_dim": 64, "output_dim": 32, "n_window": 4, "max_source_positions": 64}
    text = tiny_text(tok, "qwen2_5_omni_text", rope_parameters={
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


def qwen3_vl_recipe(model_type: str, vision: dict = DEEPSTACK_VISION, text_type: str = "",
                    **text_extra):
    """Qwen3-VL (and its MoE LLM variant): a Qwen2-VL-like patch ViT with learned position
    embeddings and deepstack mergers, an interleaved M-RoPE Qwen3 LLM (`text_extra` on top of
    two layers; its config type `text_type`, default "<model_type>_text"). Qwen3.5 reuses it
    with its own tower and LLM layers, Cosmos3-Omni as it is."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = demo_tokenizer(names, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    ids = dict(zip(names, token_ids(tok, *names)))
    text = tiny_text(tok, text_type or f"{model_type}_text", **{"num_hidden_layers": 2,
                                               "rope_parameters": QWEN3_ROPE, **text_extra})
    config = config_for(model_type, vision_config=vision, text_config=text,
                        vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"],
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      min_pixels=8 * 8, max_pixels=48 * 48)
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
                                     tokenizer=tok)


# ---- recipes added by the second sweep (LLaVA-likes, OCR models, MoE LLMs, 4-axis rope)
def pixtral_recipe(model_type: str, text_type: str, tokens: dict[str, str]):
    """Mistral3 (Mistral Small 3.x) and LightOnOCR: a Pixtral tower (2-D RoPE over any aspect
    ratio, one [IMG_BREAK] per row of patches), a patch merger, a Mistral or Qwen3 LLM."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    tok = demo_tokenizer(list(tokens.values()), tokens)
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8, "image_size": 64,
              "patch_size": 4}
    extra = {"sliding_window": None} if text_type == "mistral" else {}
    config = config_for(model_type, vision_config=vision,
                        text_config=tiny_text(tok, text_type, **extra),
                        image_token_id=token_ids(tok, tokens["image_token"])[0],
                        spatial_merge_size=2)
    images = PixtralImageProcessorPil(size={"longest_edge": 48},
                                      patch_size={"height": 8, "width": 8})
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
                                     tokenizer=tok, patch_size=4, spatial_merge_size=2)


def _llava_video(model_type: str):
    """LLaVA-NeXT-Video (any-resolution tiles) and Video-LLaVA (separate image and video towers),
    on images."""
    tok = demo_tokenizer(["<image>", "<video>"],
                         {"image_token": "<image>", "video_token": "<video>"})
    fields = {"image_token_index": token_ids(tok, "<image>")[0],
              "video_token_index": token_ids(tok, "<video>")[0]}
    if model_type == "llava_next_video":
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil as cls)
        fields["image_grid_pinpoints"] = [[32, 64], [64, 32], [64, 64]]
    else:
        from transformers.models.video_llava.image_processing_video_llava import (
            VideoLlavaImageProcessor as cls)
    config = config_for(model_type, vision_config=CLIP, text_config=tiny_text(tok, "llama"),
                        **fields)
    images = cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                 **{k: v for k, v in fields.items() if k == "image_grid_pinpoints"})
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
                                     tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
                                     vision_feature_select_strategy="default")


def _qianfan_ocr():
    """InternVL-like tiles with a Qwen3 LLM; the chat template's "<image>" is expanded."""
    return _intern_tiles("qianfan_ocr", INTERN_TOKENS, [*INTERN_TOKENS.values(), "<image>"],
                         "qwen3")


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
    config = config_for(model_type, vision_config=SIGLIP, text_config=tiny_text(tok, "llama"),
                        image_token_id=token_ids(tok, "<image_placeholder>")[0], **fields)
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
    config = config_for("janus", vision_config=vision, vq_config=vq,
                        text_config=tiny_text(tok, "llama"),
                        image_token_id=token_ids(tok, "<image_placeholder>")[0])
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
    text = tiny_text(tok, "aria_text", moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1)
    config = config_for("aria", vision_config=vision, text_config=text,
                        image_token_index=token_ids(tok, "<|img|>")[0],
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
    ids = dict(zip(names, token_ids(tok, *names)))
    if model_type == "hyperclovax_vision_v2":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)
        vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64,
                  "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1]}
        text = tiny_text(tok, "hyperclovax")
        images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                          min_pixels=8 * 8, max_pixels=48 * 48)
    else:
        from transformers.models.video_llama_3.image_processing_pil_video_llama_3 import (
            VideoLlama3ImageProcessorPil)
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "patch_size": 4}
        text = tiny_text(tok)
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
    ids = {k: token_ids(tok, v)[0] for k, v in named.items()}
    audio = {"num_mel_bins": 16, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 4,
             "encoder_ffn_dim": 64, "output_dim": 32, "n_window": 4, "max_source_positions": 64,
             "downsample_hidden_size": 8}
    text = tiny_text(tok, "qwen3_omni_moe_text", num_hidden_layers=2, rope_parameters=QWEN3_ROPE,
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
    "qwen3_vl": lambda: qwen3_vl_recipe("qwen3_vl"),
    "qwen3_vl_moe": lambda: qwen3_vl_recipe("qwen3_vl_moe", num_experts=4, num_experts_per_tok=2,
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
    ids = {k: token_ids(tok, v)[0] for k, v in named.items()}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "out_hidden_size": 32, "patch_size": 4,
              "spatial_merge_size": 2, "text_hidden_size": 32, "max_image_size": 64,
              "min_image_size": 8}
    text = tiny_text(tok, "hunyuan_vl_text", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 1, 1]})
    config = config_for("hunyuan_vl", vision_config=vision, text_config=text,
                        image_token_id=ids["image_token"], im_start_id=ids["image_start_token"],
                     im_end_id=ids["image_end_token"], im_newline_id=token_ids(tok, "<img_nl>")[0])
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
    ids = dict(zip(names, token_ids(tok, *names)))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "patch_size": 4, "num_patches": 64,
              "spatial_merge_size": 2}
    text = tiny_text(tok, "cosmos3_edge_text", rope_parameters={
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
    config = config_for("got_ocr2", vision_config=vision, text_config=tiny_text(tok),
                        image_token_index=token_ids(tok, "<imgpad>")[0])
    images = GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}, crop_to_patches=False)
    return config, lenient_processor(processor_class_for("got_ocr2"), image_processor=images,
                                     tokenizer=tok)


def _deepseek_ocr2():
    """DeepSeek-OCR 2: a SAM tower (then two stride-2 convolutions) whose patches a Qwen2-like
    encoder reads with learned queries, fixed at 256 for the global view and 144 per tile
    (query_1024_resolution, query_768_resolution), so the grids must be 16x16 and 12x12 after the
    convolutions: one-pixel patches make those a 64-pixel view and 48-pixel tiles (the sweep's
    wide image is cut into 6), not 1024 and 768; a MoE LLM."""
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import (
        DeepseekOcr2ImageProcessorPil)
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    sam = {"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 1,
           "num_attention_heads": 4, "image_size": 64, "patch_size": 1, "window_size": 8,
           "global_attn_indexes": [], "mlp_dim": 64, "downsample_channels": [16, 32]}
    encoder = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
    text = {k: v for k, v in tiny_text(tok, "deepseek_ocr2_text").items() if k != "head_dim"}
    text.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                n_shared_experts=1, mlp_layer_types=["dense", "sparse"])
    config = config_for("deepseek_ocr2", text_config=text,
                        vision_config={"sam_config": sam, "encoder_config": encoder},
                        image_token_id=token_ids(tok, "<image>")[0])
    images = DeepseekOcr2ImageProcessorPil(size={"height": 64, "width": 64}, tile_size=48)
    return config, lenient_processor(processor_class_for("deepseek_ocr2"), image_processor=images,
                                     tokenizer=tok, patch_size=1, downsample_ratio=4)


def _ovis2():
    """Ovis2: a ViT whose patches become soft tokens of a visual vocabulary, embedded by its
    visual table; the indicator tokens around and between an image's tiles (start, grid, column,
    row, end) are replaced by the table's last rows (`generic.indicator_ids`). Wide images are cut
    into tiles (the sweep's 84 x 56 one into 2 or more)."""
    from transformers.models.ovis2.image_processing_pil_ovis2 import Ovis2ImageProcessorPil
    marks = ["<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]
    tok = demo_tokenizer(["<image>", "<IMG_ATOM>", *marks], {"image_token": "<image>"})
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "vocab_size": 64}
    config = config_for("ovis2", vision_config=vision, text_config=tiny_text(tok),
                        image_token_id=token_ids(tok, "<IMG_ATOM>")[0],
                        visual_indicator_token_ids=token_ids(tok, *marks), vocab_size=len(tok),
                        hidden_size=32)
    images = Ovis2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True,
                                    max_patches=4)
    return config, lenient_processor(processor_class_for("ovis2"), image_processor=images,
                                     tokenizer=tok, image_seq_length=16)


NOT_EXACT.update({
    "blip": "BlipForConditionalGeneration has no inner ...Model: its text decoder is a BERT-style "
            "decoder with cross-attention to the image, not a decoder-only LLM fed embeddings",
    "blip-2": "Blip2ForConditionalGeneration has no inner ...Model: its LLM is a whole "
              "...ForCausalLM (OPT or T5) with its own head, which the generic backbone cannot "
              "split",
    "florence2": "its language model is an encoder-decoder (BART); ds_omni's backbone is "
                 "decoder-only",
    "emu3": "HF pads the images of one call to the largest and its VQ-VAE's convolutions see the "
            "padding, so an image's codes depend on the other images of the sample (its tiny "
            "recipe's logits differ by 0.6 from the second, smaller image on); ds_omni encodes "
            "each image alone",
    "pp_chart2table": "HF's processor has no image token to expand (the chat template writes the "
                      "image's tokens itself), so nothing says how one image becomes tokens",
})



RECIPES.update({
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
    "mistral3": lambda: pixtral_recipe("mistral3", "mistral", {
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]"}),
    "lighton_ocr": lambda: pixtral_recipe("lighton_ocr", "qwen3", {
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
})


# ---- types transformers maps no processor to, whose model file names one (`PROCESSOR_OF`)
RECIPES.update({
    "cosmos3_omni": lambda: qwen3_vl_recipe("cosmos3_omni", text_type="qwen3_vl_text"),
    "glm_ocr": lambda: _glm4v("glm_ocr", "glm_ocr_text"),
})
RECIPES["deepseek_ocr2"] = _deepseek_ocr2
RECIPES["ovis2"] = _ovis2
NOT_EXACT["shieldgemma2"] = (
    "transformers cannot load a ShieldGemma 2 checkpoint into the class its image-text-to-text "
    "mapping names (Gemma3ForConditionalGeneration): the saved keys keep a `model.` prefix (its "
    "key mapping is for ShieldGemma2ForImageClassification) and every weight loads as missing; "
    "and its processor cannot cut one image: ShieldGemma2Processor ignores the text it is given "
    "and writes its own chat-template prompt per safety policy around each image (one image a "
    "sample). Its model is Gemma 3's, which is exact")
NOT_EXACT.update({
    "kosmos-2": "transformers maps no processor to it (its own Kosmos2Processor is not in the auto "
                "mapping) and its text model is not a generic backbone: its forward scales the "
                "embeddings, adds sinusoidal position embeddings offset by the padding "
                "(Kosmos2TextSinusoidalPositionalEmbedding) and places the image embeddings at "
                "image_embeds_position_mask itself, and it has no rotary_emb; a dedicated adapter "
                "is needed",
    "kosmos-2.5": "transformers maps no processor to it (its own Kosmos2_5Processor is not in the "
                  "auto mapping) and its text model is not a generic backbone: its forward adds "
                  "sinusoidal position and segment embeddings and places the image embeddings "
                  "at image_embeds_position_mask itself, and it has no rotary_emb; a dedicated "
                  "adapter is needed",
    "fast_vlm": "not verified: its vision tower is timm's FastViTHD (vision_config timm_wrapper) "
                "and timm, which needs torchvision, does not install next to a CPU torch; "
                "transformers maps no processor to it, and neither its model file nor its docs "
                "name one (they load the checkpoint's through AutoProcessor)",
})
