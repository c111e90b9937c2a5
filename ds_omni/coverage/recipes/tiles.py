"""Recipes whose processor cuts an image into tiles of a fixed number of tokens each (plus a
global view): InternVL and Qianfan-OCR (GOT-OCR2's tiles), Idefics3 / SmolVLM, DeepSeek-OCR 2,
Ovis2 (indicator tokens around and between the tiles); and GOT-OCR 2.0 itself, its tiling off
(one fixed view)."""

from __future__ import annotations

from ds_omni.coverage.recipes.common import (RECIPES, config_for, demo_tokenizer, lenient_processor,
                                             processor_class_for, tiny_text, token_ids)


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


def _qianfan_ocr():
    """InternVL-like tiles with a Qwen3 LLM; the chat template's "<image>" is expanded."""
    return _intern_tiles("qianfan_ocr", INTERN_TOKENS, [*INTERN_TOKENS.values(), "<image>"],
                         "qwen3")


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


RECIPES.update({
    "internvl": _internvl,
    "idefics3": lambda: _idefics3("idefics3"),
    "smolvlm": lambda: _idefics3("smolvlm"),
    "qianfan_ocr": _qianfan_ocr,
    "got_ocr2": _got_ocr2,
})
RECIPES["deepseek_ocr2"] = _deepseek_ocr2
RECIPES["ovis2"] = _ovis2
