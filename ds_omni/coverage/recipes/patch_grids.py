"""Recipes of a vision tower over patch grids with a patch merger (the processor gives each image
its grid; Qwen-style image pads) and, mostly, a multi-axis rope LLM: Qwen2-VL / Qwen2.5-VL,
Qwen3-VL (deepstack) and the Qwen-Omni thinkers, GLM-4V and its kin (GLM-4.5V, GLM-OCR),
PaddleOCR-VL, HunYuan-VL (4-axis rope), Cosmos3-Edge and -Omni, HyperCLOVA X vision v2 and
VideoLLaMA3 (1-D positions)."""

from __future__ import annotations

from typing import Callable

from ds_omni.coverage.recipes.common import (RECIPES, TEXT, config_for, demo_tokenizer,
                                             lenient_processor, processor_class_for, tiny_text,
                                             token_ids)


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


RECIPES.update({
    "qwen2_5_omni_thinker": _qwen2_5_omni_thinker,
    "glm4v": _glm4v,
    "glm46v": lambda: _glm4v("glm46v", "glm4v_text"),
    "glmga": lambda: _glm4v("glmga", "glm4v_text"),
    "paddleocr_vl": _paddleocr_vl,
    "qwen2_vl": lambda: _qwen_vl("qwen2_vl"),
    "qwen2_5_vl": lambda: _qwen_vl("qwen2_5_vl"),
    **DEEPSTACK_RECIPES,
    "glm4v_moe": _glm4v_moe,
    "hyperclovax_vision_v2": lambda: _qwen_vision_llm("hyperclovax_vision_v2"),
    "video_llama_3": lambda: _qwen_vision_llm("video_llama_3"),
    "hunyuan_vl": _hunyuan_vl,
    "cosmos3_edge": _cosmos3_edge,
})


# ---- types transformers maps no processor to, whose model file names one (`PROCESSOR_OF`)
RECIPES.update({
    "cosmos3_omni": lambda: qwen3_vl_recipe("cosmos3_omni", text_type="qwen3_vl_text"),
    "glm_ocr": lambda: _glm4v("glm_ocr", "glm_ocr_text"),
})
