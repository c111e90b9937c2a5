"""The composed-backbone examples (issue 37) load through the strict loader and `ds-omni plan`
resolves them at their world size: examples/finetune_qwen3_vl_moe.json (Qwen3-VL-30B-A3B on 2 nodes
of 8 GPUs, sp x pp, the search's pick) and examples/finetune_70b_backbone.json (CLIP-L/14-336 + a Llama-3.1-
70B-class LLM, pp x tp x sp on 8 nodes). The model folders hold the published configs alone (no
weights: the plan builds the model on the meta device)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ds_omni.cli import main
from ds_omni.config import load_config

ROOT = Path(__file__).resolve().parents[3]

QWEN3_VL_30B_A3B = {  # Qwen/Qwen3-VL-30B-A3B-Instruct's config.json, its sizes
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 2048,
                    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
                    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                    "tie_word_embeddings": False,
                    "max_position_embeddings": 262144, "decoder_sparse_step": 1,
                    "mlp_only_layers": [], "norm_topk_prob": True, "rope_theta": 5000000,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20],
                                     "mrope_interleaved": True}},
    "vision_config": {"model_type": "qwen3_vl_moe", "depth": 27, "hidden_size": 1152,
                      "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048,
                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}}
LLAMA_70B = {  # meta-llama/Llama-3.1-70B-Instruct's sizes
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "tie_word_embeddings": False}
CLIP_L_336 = {  # openai/clip-vit-large-patch14-336's vision tower
    "architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model", "hidden_size": 1024,
    "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "image_size": 336, "patch_size": 14}


def _folder(path: Path, config: dict) -> str:
    """A model folder of `config` and an empty safetensors file (the plan reads no weights)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    return str(path)


def _qwen3_vl_moe(path: Path) -> str:
    """The coverage sweep's tiny Qwen3-VL-MoE processor (its tokenizer, chat template and image
    processor) beside the full-size config."""
    from ds_omni.coverage.sweep import RECIPES, save_processor_parts
    tiny, processor = RECIPES["qwen3_vl_moe"]()
    path.mkdir(parents=True)
    save_processor_parts(processor, path)
    ids = {k: getattr(tiny, k) for k in ("image_token_id", "video_token_id",
                                         "vision_start_token_id", "vision_end_token_id")}
    return _folder(path, {**QWEN3_VL_30B_A3B, **ids})  # the tokens of the tiny tokenizer


def _llama_and_clip(tmp_path: Path) -> tuple[str, str]:
    """A 70B-class LLM folder (a ChatML tokenizer with the example's image token) and a CLIP-L
    vision folder (its image processor)."""
    from transformers import CLIPImageProcessor

    from tests.family_dirs import qwen_tokenizer
    from tests.finetune_dirs import CHATML, QWEN2_5, _with_template
    llm, vision = tmp_path / "llama_70b", tmp_path / "clip"
    tok = _with_template(qwen_tokenizer(), CHATML + ["<|reserved_special_token_0|>"], QWEN2_5)
    tok.save_pretrained(str(llm))
    CLIPImageProcessor(size={"shortest_edge": 336}, crop_size=336).save_pretrained(str(vision))
    return _folder(llm, LLAMA_70B), _folder(vision, CLIP_L_336)


def _plan(example: str, world: int, sets: list[str], capsys) -> str:
    cfg = load_config(ROOT / "examples" / example)  # the strict loader
    degrees = (cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.pp, cfg.parallel.ep)
    assert sum(d > 1 for d in degrees) >= 2, degrees  # composed: two model-parallel axes at least
    args = ["plan", "--config", str(ROOT / "examples" / example), "--deepspeed",
            str(ROOT / "ds_configs/zero1.json"), "--world-size", str(world),
            "--gpus-per-node", "8"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_qwen3_vl_moe_example_plans_sp_inside_pp_on_two_nodes(tmp_path, capsys):
    """sp 2 inside pp 4 plans at 16 ranks (dp 2), the search's pick on ZeRO-1 (0.98 s a step
    modelled; sp 2 x ep 4 next at 1.32 s before the stages carried deepstack levels); pp 2 beside
    ep 4 plans too."""
    folder = json.dumps(_qwen3_vl_moe(tmp_path / "qwen3_vl_moe"))
    out = _plan("finetune_qwen3_vl_moe.json", 16, [f"model.pretrained={folder}"], capsys)
    plan = out[out.index('"plan"'):out.index('"layout"')]  # (AutoEP's log lines around it)
    assert all(f'"{k}": {v}' in plan for k, v in (("sp", 2), ("pp", 4), ("dp", 2))), plan
    args = ["plan", "--config", str(ROOT / "examples/finetune_qwen3_vl_moe.json"), "--deepspeed",
            str(ROOT / "ds_configs/zero1.json"), "--world-size", "16", "--set",
            f"model.pretrained={folder}", "--set", "parallel.pp=2", "--set", "parallel.sp=1",
            "--set", "parallel.ep=4"]
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    plan = out[out.index('"plan"'):out.index('"layout"')]
    assert all(f'"{k}": {v}' in plan for k, v in (("pp", 2), ("ep", 4), ("dp", 8))), plan


def test_70b_backbone_example_plans_pp_tp_sp_on_eight_nodes(tmp_path, capsys):
    llm, vision = _llama_and_clip(tmp_path)
    out = _plan("finetune_70b_backbone.json", 64, [f"model.llm.pretrained={json.dumps(llm)}",
                                                   f"model.vision.pretrained={json.dumps(vision)}"],
                capsys)
    plan = json.loads(out[out.index("{\n"):])["plan"]  # (a library's log line may come first)
    assert (plan["tp"], plan["pp"], plan["sp"], plan["dp"]) == (4, 4, 2, 2), plan
