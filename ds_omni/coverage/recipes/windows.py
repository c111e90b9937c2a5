"""Recipes whose LLM attends other than causally over the whole row: sliding windows (Gemma 3,
EXAONE) and bidirectional blocks (Gemma 3's images, PaliGemma's prefix)."""

from __future__ import annotations

from ds_omni.coverage.recipes.common import (RECIPES, SIGLIP, config_for, demo_tokenizer,
                                             lenient_processor, processor_class_for, tiny_text,
                                             token_ids)


# -------------------------------------------------- recipes: sliding windows, bidirectional blocks
# Small windows (4 tokens) so that every sample of the sweep is longer than its window.
def _gemma3(model_type: str = "gemma3"):
    """Gemma 3: image tokens attend to each other both ways; sliding and full layers, each with its
    own rope table; query_pre_attn_scalar scaling; tied, scaled embeddings."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>"}
    tok = demo_tokenizer(list(named.values()), named)
    ids = {k: token_ids(tok, v)[0] for k, v in named.items()}
    text = tiny_text(tok, "gemma3_text", num_hidden_layers=2, sliding_window=4,
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
                        text_config=tiny_text(tok, "gemma"), projection_dim=32,
                        image_token_index=token_ids(tok, "<image>")[0])
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
                        text_config=tiny_text(tok, "mistral", sliding_window=4),
                        image_token_id=token_ids(tok, "<image>")[0])
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
    text = tiny_text(tok, "cohere2", sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"])
    config = config_for("aya_vision", vision_config=SIGLIP, text_config=text,
                        image_token_index=token_ids(tok, "<|IMG_PATCH|>")[0], downsample_factor=2)
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
    text = tiny_text(tok, "exaone4", sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"])
    config = config_for("exaone4_5", vision_config=vision, text_config=text,
                        image_token_id=token_ids(tok, "<|image_pad|>")[0],
                        video_token_id=token_ids(tok, "<|video_pad|>")[0])
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
