"""Recipes of the types whose HF processor needs torchvision (an image processor that exists only
as a torchvision class, or a video processor the processor reads when it is built). Where this
process has no torchvision the sweep checks them in its torchvision child
(`ds_omni.coverage.torchvision_rows`), which finds them by their classes, not by this module."""

from __future__ import annotations

from ds_omni.coverage.recipes.common import (RECIPES, config_for, demo_tokenizer, lenient_processor,
                                             processor_class_for, tiny_text, token_ids)


def _lfm2_vl():
    """LFM2-VL: a SigLIP2 NaFlex tower, pixel-unshuffle projector; an LFM2 LLM of gated short
    convolutions and attention. Its image processor tiles images past `max_image_tokens`."""
    from transformers import Lfm2VlImageProcessor
    grid = [f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)]
    named = {"image_token": "<image>", "image_start_token": "<|image_start|>",
             "image_end_token": "<|image_end|>", "image_thumbnail_token": "<|img_thumbnail|>"}
    tok = demo_tokenizer([*named.values(), *grid], named)
    vision = {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "patch_size": 4,
              "num_patches": 64}
    text = tiny_text(tok, "lfm2", num_hidden_layers=2, layer_types=["conv", "full_attention"],
                     pad_token_id=tok.pad_token_id, block_auto_adjust_ff_dim=False)
    config = config_for("lfm2_vl", vision_config=vision, text_config=text,
                        image_token_id=token_ids(tok, "<image>")[0], projector_hidden_size=64,
                        downsample_factor=2, tie_word_embeddings=False)
    images = Lfm2VlImageProcessor(encoder_patch_size=4, downsample_factor=2, tile_size=32,
                                  min_image_tokens=4, max_image_tokens=16, min_tiles=2,
                                  max_tiles=4, size={"height": 32, "width": 32})
    return config, lenient_processor(processor_class_for("lfm2_vl"), image_processor=images,
                                     tokenizer=tok)


RECIPES["lfm2_vl"] = _lfm2_vl


def _minicpm_v(model_type: str):
    """MiniCPM-V 4.6 / 4.7 and MiniCPM-OCR: a SigLIP-like tower with a window-attention merger
    inside it (after layer `insert_layer_id`; OCR's "4x" mode skips it), a 2x2 merger MLP,
    Qwen3.5's LLM (gated delta net + attention). The V models' image processor has a PIL class,
    OCR's only a torchvision one; every processor reads its (torchvision) video processor's
    settings when it is built."""
    import transformers
    from ds_omni.coverage.recipes.layers import GATED_DELTA
    named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
             "image_start_token": "<image>", "image_end_token": "</image>",
             "slice_start_token": "<slice>", "slice_end_token": "</slice>",
             "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}
    tok = demo_tokenizer(list(named.values()), named)
    ids = {k: token_ids(tok, v)[0] for k, v in named.items()}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 4}
    # 4.7's canvas M-RoPE places an image's markers and the newlines between its slice rows
    canvas = {"image_start_id": ids["image_start_token"], "image_end_id": ids["image_end_token"],
              "slice_start_id": ids["slice_start_token"], "slice_end_id": ids["slice_end_token"],
              "newline_id": tok.encode("\n", add_special_tokens=False)[-1]}
    config = config_for(model_type, vision_config=vision, insert_layer_id=0,
                        text_config=tiny_text(tok, "qwen3_5_text", **GATED_DELTA),
                        image_token_id=ids["image_token"], video_token_id=ids["video_token"],
                        **(canvas if model_type == "minicpmv4_7" else {}))
    settings = {"scale_resolution": 32, "patch_size": 4, "max_slice_nums": 4}
    ocr = model_type == "minicpm_ocr"
    image_cls = "MiniCPMOcrImageProcessor" if ocr else "MiniCPMV4_6ImageProcessorPil"
    video_cls = "MiniCPMOcrVideoProcessor" if ocr else "MiniCPMV4_6VideoProcessor"
    return config, lenient_processor(
        processor_class_for(model_type), tokenizer=tok,
        image_processor=getattr(transformers, image_cls)(**settings),
        video_processor=getattr(transformers, video_cls)(**settings))


RECIPES.update({t: lambda t=t: _minicpm_v(t)
                for t in ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr")})


def _unlimited_ocr():
    """Unlimited-OCR (DeepSeek-OCR's design): a SAM tower whose 16x-downsampled features feed a
    CLIP encoder, both concatenated and projected; a global view plus tiles, a newline embedding
    after every row and a separator after the views; a DeepSeek-V2-style LLM with MoE layers on
    reference sliding-window attention."""
    from transformers import UnlimitedOcrImageProcessor
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    sam = {"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 2,
           "num_attention_heads": 4, "image_size": 64, "patch_size": 4, "window_size": 4,
           "global_attn_indexes": [1], "mlp_dim": 64, "downsample_channels": [16, 32]}
    clip = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 16, "patch_size": 4}
    # DeepSeek-V2's LLM (its MLA off): its attention has no separate KV head count
    text = tiny_text(tok, "unlimited_ocr_text", num_hidden_layers=2, num_key_value_heads=4,
                     sliding_window=4, n_routed_experts=4, num_experts_per_tok=2,
                     n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1)
    config = config_for("unlimited_ocr", vision_config={"sam_config": sam, "encoder_config": clip},
                        text_config=text, image_token_id=token_ids(tok, "<image>")[0])
    images = UnlimitedOcrImageProcessor(size={"height": 64, "width": 64}, tile_size=32,
                                        min_patches=2, max_patches=4)
    return config, lenient_processor(processor_class_for("unlimited_ocr"), image_processor=images,
                                     tokenizer=tok, patch_size=4, downsample_ratio=4)


RECIPES["unlimited_ocr"] = _unlimited_ocr


def _muse(model_type: str):
    """Muse Glimmer / Spark: a windowed patch ViT (axial rope) with pixel-shuffle merging, an MLP
    adapter and a weightless norm; an LLM of gated, QK-normed attention, sliding-window layers and
    NoPE full-attention ones (`layer_types.mark_nope`), its logits scaled and soft-capped. Spark's
    LLM adds MoE layers and gated residuals, and an audio tower (unused here)."""
    from transformers import MuseGlimmerImageProcessor
    named = {"image_token": "<|patch|>", "video_token": "<|video|>", "audio_token": "<|audio|>"}
    tok = demo_tokenizer(["<|image_start|>", "<|image_end|>", *named.values()], named)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "patch_size": 4, "pos_emb_height": 4, "pos_emb_width": 4,
              "max_position_embeddings": 16, "merge_size": 2}
    ids = token_ids(tok, "<|patch|>", "<|video|>", "<|audio|>")
    spark = model_type == "muse_spark"
    audio = {"audio_token_id": ids[2], "audio_config": {
        "patch_sizes": [4, 2], "hidden_sizes": [16, 32], "depths": [1, 1],
        "num_hidden_layers": 2, "out_hidden_size": 32}} if spark else {}
    moe = {"num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "moe_hidden_size": 16} if spark else {}
    text = tiny_text(tok, f"{model_type}_text", num_hidden_layers=2, sliding_window=4,
                     final_logit_softcapping=2.0, **moe)
    config = config_for(model_type, vision_config=vision, text_config=text,
                        image_token_id=ids[0], video_token_id=ids[1], out_hidden_size=128,
                        projector_hidden_size=64, **audio)
    images = MuseGlimmerImageProcessor(patch_size=4, merge_size=2, max_image_tokens=64)
    return config, lenient_processor(processor_class_for(model_type), image_processor=images,
                                     tokenizer=tok)


RECIPES.update({"muse_glimmer": lambda: _muse("muse_glimmer"),
                "muse_spark": lambda: _muse("muse_spark")})
