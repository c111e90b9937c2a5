"""Recipes whose LLM has layers that are not plain attention (`ds_omni.model.per_sample`: linear
attention, short convolutions, indexed attention) or per-token layer inputs (ERNIE's experts)."""

from __future__ import annotations

from ds_omni.coverage.recipes.common import (NOT_EXACT, RECIPES, config_for, demo_tokenizer,
                                             lenient_processor, processor_class_for, tiny_text,
                                             token_ids)
from ds_omni.coverage.recipes.llava import pixtral_recipe
from ds_omni.coverage.recipes.patch_grids import DEEPSTACK_VISION, QWEN3_ROPE, qwen3_vl_recipe


# ---- LLMs with layers run once per sample (`ds_omni.model.per_sample`): linear attention
GATED_DELTA = {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2,
               "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
               "rope_parameters": {**QWEN3_ROPE, "partial_rotary_factor": 0.5}}
"""A Qwen3.5 LLM: a gated delta net layer, then a full-attention one (partial rotary)."""


def _qwen3_5(model_type: str, **text_extra):
    """Qwen3.5 (and its MoE LLM variant): Qwen3-VL's tower without deepstack, an LLM of gated
    delta net and attention layers."""
    vision = {k: v for k, v in DEEPSTACK_VISION.items() if k != "deepstack_visual_indexes"}
    return qwen3_vl_recipe(model_type, vision, **GATED_DELTA, **text_extra)


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
    ids = dict(zip(names, token_ids(tok, *names)))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    text = tiny_text(tok, "lfm3", num_hidden_layers=3, pad_token_id=tok.pad_token_id,
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
    ids = dict(zip(names, token_ids(tok, *names)))
    # MLA (keys and values from one latent per token): as many KV heads as query heads
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
    config, processor = pixtral_recipe("mistral_large4", "mistral", {
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})
    tok = processor.tokenizer  # MLA: as many KV heads as query heads (no GQA)
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
    ids = {k: token_ids(tok, v)[0] for k, v in named.items()}
    for key, value in ids.items():
        setattr(tok, f"{key}_id", value)
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_merge_size": 2}
    text = tiny_text(tok, "ernie4_5_vl_moe_text", num_hidden_layers=2,
                     moe_intermediate_size=[16, 8],
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
