"""Tiny random HF model directories of each family, saved as users have them (weights, config,
tokenizer, processor files). Shared by the family unit tests and the multi-process parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.family_checks import save_hf
from tests.fixtures import TINY_LLAMA, TINY_VISION


def demo_tokenizer():
    from transformers import AutoTokenizer
    from ds_omni.data.demo import ensure_builtin
    return AutoTokenizer.from_pretrained(str(ensure_builtin("builtin:shapes", "tokenizer")))


def _parts():
    vision = {k: v for k, v in TINY_VISION.items() if k != "model_type"}
    text = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    return vision, text


def make_llava_dir(out: Path) -> Path:
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    tok = demo_tokenizer()
    vision, text = _parts()
    config = LlavaConfig(vision_config=CLIPVisionConfig(**vision),
                         text_config=LlamaConfig(**text, vocab_size=len(tok)),
                         image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-2, image_seq_length=16)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32},
                                              crop_size={"height": 32, "width": 32}),
        tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1)
    torch.manual_seed(0)
    return save_hf(LlavaForConditionalGeneration(config), tok, out, processor)


def make_llava_next_dir(out: Path) -> Path:
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig,
                              LlavaNextForConditionalGeneration)
    from ds_omni.model.families.llava_next import anyres_processor
    tok = demo_tokenizer()
    vision, text = _parts()
    config = LlavaNextConfig(vision_config=CLIPVisionConfig(**vision),
                             text_config=LlamaConfig(**text, vocab_size=len(tok)),
                             image_token_index=tok.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],
                             vision_feature_layer=-2)
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config)
    with torch.no_grad():
        model.model.image_newline.normal_()  # HF inits it to zeros-ish; make it count
    return save_hf(model, tok, out, anyres_processor(config, tok, None))


def make_generic_dir(out: Path, model_type: str) -> Path:
    """A tiny random model of any family the coverage sweep has a recipe for, saved with its
    processor (loaded by the generic adapter)."""
    from ds_omni.coverage.sweep import RECIPES, save_processor_parts
    from ds_omni.model.families import family_for
    config, processor = RECIPES[model_type]()
    torch.manual_seed(0)
    family_for(model_type).build_hf(config).save_pretrained(str(out), safe_serialization=True)
    save_processor_parts(processor, out)
    return out


PATCH, MERGE = 4, 2  # 8-pixel merge blocks: a 32x32 image is 8x8 patches, 16 LLM tokens
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def qwen_tokenizer():
    """The demo tokenizer plus Qwen2-VL's vision tokens, which it names as its image/video tokens
    (the demo tokenizer's own image_token is "<image>", which Qwen2VLProcessor would expand)."""
    tok = demo_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    tok.image_token, tok.video_token = "<|image_pad|>", "<|video_pad|>"
    return tok


def image_processor():
    """HF's image processor for the tiny tower, with a pixel budget that keeps images small."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE,
                                    min_pixels=8 * 8, max_pixels=96 * 96)


def make_qwen2_vl_dir(out: Path, tok=None) -> Path:
    """A tiny random Qwen2-VL saved as hub checkpoints are: weights, config, tokenizer and
    preprocessor_config.json (the image processor's own save_pretrained); `tok` (default
    `qwen_tokenizer()`) sets the vocabulary."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    return _qwen_vl_dir(out, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                        {"depth": 2, "embed_dim": 32, "num_heads": 4, "mlp_ratio": 2,
                         "hidden_size": 64, "patch_size": PATCH, "spatial_merge_size": MERGE,
                         "temporal_patch_size": 2}, tok)


def _qwen_vl_dir(out: Path, config_class, model_class, vision_config: dict, tok=None) -> Path:
    """A Qwen2-VL-style model (tiny text config, `vision_config`) with the tokenizer, image and
    video processor files of these tests."""
    tok = tok or qwen_tokenizer()
    ids = dict(zip(QWEN_TOKENS, tok.convert_tokens_to_ids(QWEN_TOKENS)))
    config = config_class(
        vision_config=vision_config,
        # head_dim 16: 8 rotary frequencies split 2 (time) + 3 (height) + 3 (width)
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": len(tok),
                     "max_position_embeddings": 512, "bos_token_id": tok.bos_token_id,
                     "eos_token_id": tok.eos_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": [2, 3, 3]}},
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    torch.manual_seed(0)
    out = save_hf(model_class(config), tok, out)
    image_processor().save_pretrained(str(out))
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR))
    return out


# HF's Qwen2VLVideoProcessor settings for the tiny tower (saved as its save_pretrained would; the
# class itself needs torchvision): frames of 8x8 to 32x32 pixels, at most 6 frames.
VIDEO_PROCESSOR = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": PATCH,
                   "temporal_patch_size": 2, "merge_size": MERGE, "max_frames": 6,
                   "size": {"shortest_edge": 8 * 8, "longest_edge": 32 * 32}}


RATE = 16000
MELS, WINDOW_S = 16, 1
AUDIO_TOKENS = {"audio_bos_token": "<|audio_bos|>", "audio_token": "<|AUDIO|>",
                "audio_eos_token": "<|audio_eos|>"}


def audio_tokenizer():
    tok = demo_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(AUDIO_TOKENS.values())})
    tok.audio_token = AUDIO_TOKENS["audio_token"]  # the demo tokenizer names "<audio>" otherwise
    return tok


def audio_hf_processor(tok):
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor
    return Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(
        feature_size=MELS, chunk_length=WINDOW_S), tokenizer=tok)


def make_qwen2_audio_dir(out: Path) -> Path:
    from transformers import (Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration,
                              Qwen2Config)
    tok = audio_tokenizer()
    config = Qwen2AudioConfig(
        audio_config=Qwen2AudioEncoderConfig(
            num_mel_bins=MELS, d_model=32, encoder_layers=2, encoder_attention_heads=4,
            encoder_ffn_dim=64, max_source_positions=WINDOW_S * RATE // 160 // 2),
        text_config=Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                max_position_embeddings=512, tie_word_embeddings=False),
        audio_token_index=tok.convert_tokens_to_ids(AUDIO_TOKENS["audio_token"]))
    torch.manual_seed(0)
    return save_hf(Qwen2AudioForConditionalGeneration(config), tok,
                   out, audio_hf_processor(tok))


SIGLIP_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "image_size": 32, "patch_size": 8}


def siglip_llava_next_processor(tok, pinpoints):
    """LLaVA-NeXT's processor as a user writes it for a SigLIP tower: SigLIP's mean/std, and no
    CLS state per tile (num_additional_image_tokens=0)."""
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=pinpoints, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                              vision_feature_select_strategy="full", image_token="<image>",
                              num_additional_image_tokens=0)


def make_llava_next_siglip_dir(out: Path) -> Path:
    """LLaVA-NeXT on a SigLIP tower (no CLS state, so the "full" feature strategy keeps every
    patch), saved with the processor a user would write for it."""
    from transformers import (LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              SiglipVisionConfig)
    tok = demo_tokenizer()
    _, text = _parts()
    pinpoints = [[32, 64], [64, 32], [64, 64]]
    config = LlavaNextConfig(vision_config=SiglipVisionConfig(**SIGLIP_VISION),
                             text_config=LlamaConfig(**text, vocab_size=len(tok)),
                             image_token_index=tok.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=pinpoints, vision_feature_layer=-1,
                             vision_feature_select_strategy="full")
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config)
    with torch.no_grad():
        model.model.image_newline.normal_()
    return save_hf(model, tok, out, siglip_llava_next_processor(tok, pinpoints))


def make_qwen2_5_vl_dir(out: Path) -> Path:
    """A tiny random Qwen2.5-VL: windows of 2x2 merged tokens (16 pixels), full attention in the
    second block, 4 M-RoPE time steps per second of video; the processor files of the Qwen2-VL dir."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    return _qwen_vl_dir(out, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                        {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4,
                         "out_hidden_size": 64, "patch_size": PATCH, "spatial_merge_size": MERGE,
                         "temporal_patch_size": 2, "window_size": 16,
                         "fullatt_block_indexes": [1], "tokens_per_second": 4})
