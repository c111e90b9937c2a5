"""Recipes of one vision tower and a projector into a causal LLM, each image one run of its
expanded image token: LLaVA, LLaVA-OneVision, VipLLaVA, LLaVA-NeXT, LLaVA-NeXT-Video and
Video-LLaVA, Mistral3 / LightOnOCR (a Pixtral tower), DeepSeek-VL (and its hybrid), Janus, Aria."""

from __future__ import annotations

from ds_omni.coverage.recipes.common import (CLIP, RECIPES, SIGLIP, config_for, demo_tokenizer,
                                             lenient_processor, processor_class_for, tiny_text,
                                             token_ids)


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


RECIPES.update({
    "vipllava": _vipllava,
    "llava_next": _llava_next,
    "llava": _llava,
    "llava_onevision": _llava_onevision,
    "mistral3": lambda: pixtral_recipe("mistral3", "mistral", {
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]"}),
    "lighton_ocr": lambda: pixtral_recipe("lighton_ocr", "qwen3", {
        "image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>",
        "image_end_token": "<|vision_end|>"}),
    "llava_next_video": lambda: _llava_video("llava_next_video"),
    "video_llava": lambda: _llava_video("video_llava"),
    "deepseek_vl": lambda: _deepseek_vl("deepseek_vl"),
    "deepseek_vl_hybrid": lambda: _deepseek_vl("deepseek_vl_hybrid"),
    "janus": _janus,
    "aria": _aria,
})
