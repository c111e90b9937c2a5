"""More recipes of types whose HF image processor exists only as a torchvision class (next to
`torchvision_only`), or whose PIL one is broken (Fuyu's, `hf_processor.BROKEN_PIL`): where this
process has no torchvision the sweep checks them where it has. Command A Vision (tiles and a thumbnail),
Apertus 1.5 (a VQ image tokenizer whose codes the LLM embeds), Kimi K2.5 (MoonViT, a DeepSeek-V3
LLM), Step 3.7 (a global view and local crops), Fuyu (patches straight into the LLM). Molmo 2 is
refused by its classes (`generic.merge_problem`); PerceptionLM's tower needs timm (a recipe where
timm imports, else NOT_EXACT)."""

from __future__ import annotations

from transformers.utils import is_timm_available

from ds_omni.coverage.recipes.common import (NOT_EXACT, RECIPES, SIGLIP, config_for, demo_tokenizer,
                                             lenient_processor, processor_class_for, tiny_text,
                                             token_ids)


def _cohere2_vision():
    """Command A Vision: a SigLIP tower over 32-pixel tiles (plus a thumbnail when there are
    several), a pixel-shuffle SwiGLU projector, a Cohere 2 LLM of a sliding-window layer with
    rope and a full one without."""
    from transformers.models.cohere2_vision.image_processing_cohere2_vision import (
        Cohere2VisionImageProcessor)
    named = {"image_token": "<|IMG_PATCH|>", "boi_token": "<|START_OF_IMG|>",
             "eoi_token": "<|END_OF_IMG|>", "img_line_break_token": "<|IMG_LINE_BREAK|>"}
    tok = demo_tokenizer(list(named.values()), named)
    text = tiny_text(tok, "cohere2", num_hidden_layers=2, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"])
    config = config_for("cohere2_vision", vision_config=SIGLIP, text_config=text,
                        image_token_id=token_ids(tok, named["image_token"])[0],
                        downsample_factor=2, alignment_intermediate_size=64)
    images = Cohere2VisionImageProcessor(size={"height": 32, "width": 32}, patch_size=2,
                                         max_patches=4)
    return config, lenient_processor(processor_class_for("cohere2_vision"), image_processor=images,
                                     tokenizer=tok)


def _apertus1p5():
    """Apertus 1.5: a VQ image tokenizer (convolutions, one 8x8 code per 8x8 pixels) whose codes,
    offset into the vocabulary, are embedded by the LLM's own embedding; an Apertus LLM whose
    head is pruned to the text vocabulary (`output_vocab_size`)."""
    from transformers.models.apertus1p5.image_processing_apertus1p5 import (
        Apertus1p5ImageProcessor)
    named = {"image_token": "<|image|>", "audio_token": "<|audio|>", "boi_token": "<|boi|>",
             "eoi_token": "<|eoi|>", "image_wrapper_token": "<|img_wrap|>",
             "eol_token": "<|eol|>", "boa_token": "<|boa|>", "eoa_token": "<|eoa|>"}
    tok = demo_tokenizer(list(named.values()), named)
    codes = 16  # each codebook's size: image codes, then audio codes, after the text vocabulary
    rope = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
            "original_max_position_embeddings": 512, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}  # Apertus's own, within the tiny context
    text = tiny_text(tok, "apertus1p5_text", vocab_size=len(tok) + 2 * codes,
                     output_vocab_size=len(tok), rope_parameters=rope)
    vision = {"codebook_size": codes, "embed_dim": 8, "latent_channels": 8, "base_channels": 32,
              "channel_multiplier": [1, 1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [8],
              "resolution": 32}
    audio = {"model_type": "wavtokenizer_encoder", "num_filters": 8, "upsampling_ratios": [2, 2],
             "num_lstm_layers": 1, "hidden_size": 32, "codebook_dim": 32, "codebook_size": codes}
    config = config_for("apertus1p5", text_config=text, vision_config=vision, audio_config=audio,
                        image_token_id=token_ids(tok, named["image_token"])[0],
                        audio_token_id=token_ids(tok, named["audio_token"])[0],
                        image_token_offset=len(tok), audio_token_offset=len(tok) + codes)
    images = Apertus1p5ImageProcessor(size={"min_pixels": 16 * 16, "max_pixels": 32 * 32},
                                      spatial_factor=8)
    return config, lenient_processor(processor_class_for("apertus1p5"), image_processor=images,
                                     tokenizer=tok)


# (MLA: its keys and values come from one shared latent per token, so HF's config has as many
# KV heads as query heads; no GQA to set)
MLA_MOE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
           "v_head_dim": 8, "head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}
"""A DeepSeek-V3 LLM: multi-head latent attention, a dense layer then a MoE one."""


def _kimi_k25():
    """Kimi K2.5: MoonViT (a NaViT tower over patch grids, 2-D rope, 2x2 patch merging) and a
    DeepSeek-V3 LLM."""
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    named = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"}
    tok = demo_tokenizer(["<|media_begin|>", "<|media_end|>", *named.values()], named)
    ids = dict(zip(["begin", "end", "image", "video"],
                   token_ids(tok, "<|media_begin|>", "<|media_end|>", *named.values())))
    vision = {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 2,
              "num_attention_heads": 4, "num_hidden_layers": 2, "hidden_size": 32,
              "intermediate_size": 64}
    config = config_for("kimi_k25", text_config=tiny_text(tok, "deepseek_v3", **MLA_MOE),
                        vision_config=vision, projection_hidden_size=32,
                        image_token_id=ids["image"], video_token_id=ids["video"],
                        vision_start_token_id=ids["begin"], vision_end_token_id=ids["end"],
                        tie_word_embeddings=False)
    images = Kimi_K25ImageProcessor(size={"max_height": 8, "max_width": 8}, max_patches=64,
                                    patch_size=4, merge_size=2)
    return config, lenient_processor(processor_class_for("kimi_k25"), image_processor=images,
                                     tokenizer=tok)


def _step3p7():
    """Step 3.7 Flash: a SigLIP-like tower with 2-D rope and two stride-2 convolutions, run on a
    global view and on local crops (16-pixel windows, positions interpolated); a Step LLM of a
    sliding-window layer and a full one (per-type rope), a dense then a MoE MLP."""
    from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor
    tok = demo_tokenizer(["<im_patch>", "<patch_start>", "<patch_end>", "<patch_newline>",
                          "<im_start>", "<im_end>"])
    vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 4, "mlp_ratio": 2.0, "max_position_embeddings": 64}
    text = tiny_text(tok, "step3p5", num_hidden_layers=2, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"],
                     mlp_layer_types=["dense", "sparse"], n_routed_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=16, share_expert_dim=16)
    config = config_for("step3p7", vision_config=vision, text_config=text,
                        image_token_id=token_ids(tok, "<im_patch>")[0])
    images = Step3p7ImageProcessor(size={"height": 32, "width": 32}, patch_size=16,
                                   max_image_size=64, vision_patch_size=4, downsampler_stride=4)
    return config, lenient_processor(processor_class_for("step3p7"), image_processor=images,
                                     tokenizer=tok)


def sentencepiece_tokenizer(words: list[str], specials: list[str]):
    """A tiny SentencePiece-like tokenizer (unigram over characters, "▁" before the first word)
    in which `words` are ordinary pieces, not added tokens: Fuyu's processor tokenizes the image's
    text with a leading "▁" of its own, which it cuts off, as its real tokenizer gives one."""
    import string
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    base = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = ["▁", *string.ascii_letters, *string.digits, *string.punctuation,
             *("▁" + c for c in string.ascii_lowercase)]
    pieces = dict.fromkeys([*base, *specials, *words, *chars])  # in order, once each
    scores = {**{t: 0.0 for t in base + specials}, **{t: -1.0 for t in words}}
    model = models.Unigram([(t, scores.get(t, -2.0)) for t in pieces], unk_id=3)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def _fuyu():
    """Fuyu: no vision tower, each 8x8 patch of the (padded) image goes through one linear layer
    into the LLM, a row of patch tokens ends with |NEWLINE|; a Persimmon LLM (final norm
    `final_layernorm`)."""
    from transformers.models.fuyu.image_processing_fuyu import FuyuImageProcessor
    tok = sentencepiece_tokenizer(["|SPEAKER|", "|NEWLINE|"], ["<0x04>"])
    # Persimmon's attention has no num_key_value_heads (multi-head only): no GQA
    text = tiny_text(tok, "persimmon", num_key_value_heads=4, pad_token_id=tok.pad_token_id)
    config = config_for("fuyu", text_config=text, patch_size=8, image_size=32,
                        image_token_id=token_ids(tok, "|SPEAKER|")[0],
                        pad_token_id=tok.pad_token_id)
    images = FuyuImageProcessor(size={"height": 32, "width": 32},
                                patch_size={"height": 8, "width": 8})
    return config, processor_class_for("fuyu")(image_processor=images, tokenizer=tok)


RECIPES.update({
    "cohere2_vision": _cohere2_vision,
    "apertus1p5": _apertus1p5,
    "kimi_k25": _kimi_k25,
    "step3p7": _step3p7,
    "fuyu": _fuyu,
})


def _perception_lm():
    """PerceptionLM: a timm Perception Encoder tower (TimmWrapper; its class token dropped), an
    MLP projector with 2x2 average pooling, a LLaMA LLM; a thumbnail and up to 4 tiles."""
    from transformers.models.perception_lm.image_processing_perception_lm import (
        PerceptionLMImageProcessor)
    named = {"image_token": "<|image|>", "video_token": "<|video|>"}
    tok = demo_tokenizer(list(named.values()), named)
    vision = {"model_type": "timm_wrapper", "architecture": "vit_pe_core_tiny_patch16_384",
              "model_args": {"embed_dim": 32, "depth": 2, "num_heads": 4, "img_size": [32, 32],
                             "patch_size": 8, "global_pool": "", "ref_feat_shape": [4, 4],
                             "use_post_transformer_norm": False}}
    config = config_for("perception_lm", vision_config=vision, text_config=tiny_text(tok, "llama"),
                        image_token_id=token_ids(tok, named["image_token"])[0],
                        video_token_id=token_ids(tok, named["video_token"])[0],
                        projector_pooling_ratio=2)
    images = PerceptionLMImageProcessor(tile_size=32, max_num_tiles=4,
                                        size={"width": 32, "height": 32})
    return config, lenient_processor(processor_class_for("perception_lm"), image_processor=images,
                                     tokenizer=tok, patch_size=8, pooling_ratio=2)


if is_timm_available():
    RECIPES["perception_lm"] = _perception_lm  # exact where timm imports (checked with 1.0.31)
else:
    NOT_EXACT["perception_lm"] = (
        "its vision tower is a timm model (vision_config of type timm_wrapper, the Perception "
        "Encoder) and timm is not installed here (timm requires torchvision, whose PyPI wheel "
        "does not load next to a CPU torch; where torchvision imports but timm does not, "
        "transformers cannot import TimmWrapperConfig, so its config does not even build); "
        "with timm 1.0.31 on the path its tiny recipe is exact")
