"""The LLM over pipeline stages (DeepSpeed's pipeline engine) equals one process.

One 2-rank launch (PP=2, dp=1) trains each case 3 steps inside the ranks; the oracle
(`tests/oracle.py`: plain PyTorch, one process, global batches built independently) must match
the loss (1e-6 relative), the first step's reduced gradients and the final parameters (1e-5
relative, fp32). Each stage returns its own parameters under the OmniModel's names; together they
must be the whole model, and under "uniform" placement (every stage holds the encoders) every
copy of an encoder parameter must be the same. The data mixes captioned pictures (with a clip of
beeps for the image+audio model) with plain sentences, so some micro-batches carry no item and
token counts differ from one micro-batch to the next. Cases on the same model and data share one
reference run.
"""

import pytest

from tests import oracle
from tests.fixtures import ds_config, text_source, tiny_config
from tests.harness import run_on_ranks

STEPS = 3
LR = 1e-3
PARAM_ATOL = 2e-3 * LR * STEPS  # as in test_parity: reduction-order noise through Adam

COMPOSED = {"tokenizer": "builtin:shapes",
            "vision": {"config": {"model_type": "clip_vision_model", "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "image_size": 32, "patch_size": 8}},
            "audio": {"config": {"model_type": "whisper", "d_model": 32, "encoder_layers": 1,
                                 "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                                 "decoder_layers": 1, "decoder_attention_heads": 2,
                                 "decoder_ffn_dim": 32, "num_mel_bins": 80,
                                 "max_source_positions": 50}},
            "llm": {"config": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 3, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "max_position_embeddings": 512,
                               "tie_word_embeddings": False}}}

#        case             model       placement  ZeRO
CASES = [("llava_stage0", "llava", "stage0", 0), ("llava_uniform", "llava", "uniform", 1),
         ("composed_uniform", "composed", "uniform", 0)]


def _config(model: dict, placement: str, out_dir: str):
    from ds_omni.config import ModelConfig, ParallelConfig, SourceConfig, from_dict
    cfg = tiny_config(out_dir, steps=STEPS)
    if model.get("model"):
        cfg.model = from_dict(ModelConfig, model["model"], "model")
    cfg.data.sources = [from_dict(SourceConfig, s) for s in model["sources"]]
    cfg.data.max_seq_len = model.get("max_seq_len", cfg.data.max_seq_len)
    cfg.parallel = ParallelConfig(pp=2, encoder_placement=placement)
    return cfg


def _train_ranks(rank, world, models, out_dir):
    return {name: oracle.train_on_rank(rank, world, _config(models[model], placement,
                                                            f"{out_dir}/{name}"),
                                       ds_config(zero), STEPS)
            for name, model, placement, zero in CASES}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    text = text_source(tmp)
    tones = {"name": "shapes_tones", "path": "builtin:shapes_tones",
             "schema": {"text": "conversations", "image": "image", "audio": "audio"}}
    return {"llava": {"sources": [{"name": "shapes", "path": "builtin:shapes"}, text]},
            "composed": {"model": COMPOSED, "sources": [tones, text], "max_seq_len": 160}}


@pytest.mark.dist
def test_pipeline_matches_single_process(models, tmp_path):
    from ds_omni.model.build import build_model
    results = run_on_ranks(_train_ranks, 2, args=(models, str(tmp_path / "pp")), timeout=420)
    refs = {}
    for name, model, placement, _ in CASES:
        cfg = _config(models[model], placement, str(tmp_path / f"ref_{model}"))
        if model not in refs:  # the reference knows no parallel plan: one per model and data
            step_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), 1, STEPS)
            refs[model] = step_keys, oracle.run_reference(cfg, step_keys)
            oracle.assert_moved(refs[model][1], model)
        step_keys, ref = refs[model]
        for r in results:
            assert [sorted(k) for k in r[name]["keys"]] == step_keys, name
        first, second = (r[name] for r in results)
        _check_replicas(placement, first, second)
        assert second["losses"] == first["losses"], name
        got = {"losses": first["losses"], "grads": {**first["grads"], **second["grads"]},
               "params": {**first["params"], **second["params"]}}
        oracle.assert_matches(ref, got, f"{name} PP=2", param_atol=PARAM_ATOL)
        assert sum(r[name]["nothing_to_encode"] for r in results) > 0, name


def _check_replicas(placement, first, second) -> None:
    """Only "uniform" holds a parameter on two stages: the encoders, every copy the same."""
    import torch
    shared = set(first["params"]) & set(second["params"])
    if placement == "stage0":
        assert not shared, f"a parameter on 2 stages: {sorted(shared)[:3]}"
        return
    assert shared and all(k.startswith("encoders.") for k in shared), sorted(shared)[:3]
    assert {k for k in first["params"] if k.startswith("encoders.")} == shared
    for key in shared:
        assert torch.equal(first["params"][key], second["params"][key]), key
