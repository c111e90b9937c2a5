"""Recipes whose HF forward applies numbers outside its modules (`ds_omni.model.outside`):
embedding multipliers, logit scales and soft-capping, suppressed tokens (Chameleon)."""

from __future__ import annotations

from typing import Callable

from ds_omni.coverage.recipes.common import (CLIP, RECIPES, config_for, demo_tokenizer,
                                             lenient_processor, processor_class_for, tiny_text,
                                             token_ids)
from ds_omni.coverage.recipes.patch_grids import DEEPSTACK_VISION


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
    text = tiny_text(tok, "granite_docling_text", num_hidden_layers=2, embedding_multiplier=12.0,
                 logits_scaling=4.0, residual_multiplier=0.263, attention_multiplier=0.125,
                 pad_token_id=0)
    config = config_for("granite_docling", vision_config=vision, text_config=text,
                        image_token_id=token_ids(tok, "<image>")[0], tie_word_embeddings=False,
                        pad_token_id=0)
    images = GraniteDoclingImageProcessorPil(size={"height": 32, "width": 32}, max_patches=4)
    return config, lenient_processor(processor_class_for("granite_docling"),
                                     image_processor=images, tokenizer=tok, image_seq_len=4)


def _granite4_vision():
    """Granite 4 Vision: LLaVA-NeXT tiles through a CLIP tower, Window Q-Former projectors whose
    features its Granite LLM adds before the layers its config names, no image embedding itself
    (`ds_omni.model.deepstack`). Its map aims pairs at layers 0 and 1, then spatial ones at 1
    (which replaces the pair for layer 1, as HF's dict does) and at 2, 5 and 6 (layers the
    two-layer LLM lacks: HF never adds them, not even before the final norm)."""
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil)
    tok = demo_tokenizer(["<image>"], {"image_token": "<image>"})
    pinpoints = [[32, 64], [64, 32], [64, 64]]
    vision = {**CLIP, "hidden_size": 64}  # the Q-Former has hidden_size // 64 heads
    text = tiny_text(tok, "granite4_vision_text", num_hidden_layers=2, embedding_multiplier=12.0,
                     logits_scaling=4.0, residual_multiplier=0.263, attention_multiplier=0.125)
    config = config_for("granite4_vision", vision_config=vision, text_config=text,
                        image_token_index=token_ids(tok, "<image>")[0],
                        image_grid_pinpoints=pinpoints, downsample_rate="1/2",
                        deepstack_layer_map=[[-2, 0], [-1, 1]],
                        spatial_target_layers=[1, 2, 5, 6], projector_dropout=0.0,
                        qformer_config={"num_hidden_layers": 1, "intermediate_size": 64,
                                        "max_position_embeddings": 64})
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32},
                                        crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=pinpoints)
    return config, lenient_processor(processor_class_for("granite4_vision"),
                                     image_processor=images, tokenizer=tok, patch_size=8,
                                     vision_feature_select_strategy="default",
                                     num_additional_image_tokens=1, downsample_rate="1/2")


SCALED_RECIPES: dict[str, Callable] = {
    "granite_docling": _granite_docling,
}
RECIPES.update(SCALED_RECIPES)
RECIPES["granite4_vision"] = _granite4_vision



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
    text = {k: v for k, v in tiny_text(tok, "chameleon").items()
            if k not in ("model_type", "head_dim")}
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
    tok.image_token_id = token_ids(tok, "<image_soft_token>")[0]
    tok.audio_token_id = token_ids(tok, "<audio_soft_token>")[0]
    ids = {k: token_ids(tok, v)[0] for k, v in named.items()}
    text = tiny_text(tok, "gemma4_text", num_hidden_layers=2, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
                 hidden_size_per_layer_input=0, tie_word_embeddings=True, global_head_dim=16)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
              "patch_size": 4, "position_embedding_size": 64}
    config = config_for("gemma4", text_config=text, vision_config=vision, audio_config=None,
                        boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
                        image_token_id=ids["image_token"], boa_token_id=ids["boa_token"],
                        eoa_token_index=ids["eoa_token"], audio_token_id=ids["audio_token"],
                        video_token_id=token_ids(tok, "<|video|>")[0], tie_word_embeddings=True)
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
    ids = dict(zip(names, token_ids(tok, *names)))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = tiny_text(tok, "cohere_compass_text", num_hidden_layers=2, sliding_window=4,
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
