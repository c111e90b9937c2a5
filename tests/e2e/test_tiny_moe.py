"""examples/tiny_moe.json (a tiny CLIP + Qwen3-MoE: 4 experts, top-2, HF's aux loss) trains on the
demo data through the real CLI, as examples/tiny_llava.json does (`tests/e2e/test_demo_seeds.py`,
`benchmarks/gpu_check.py`): as shipped (the deepspeed launcher, 2 ranks, parallel.ep=2, its
experts split by DeepSpeed's AutoEP) and on one process (`ds-omni train` alone, parallel.ep=1,
HF's own MoE blocks). The loss falls over a few steps, and every step's record in metrics.jsonl
carries the expert load (AutoEP's counters; at ep=1 HF's router's picks): tokens per expert of
the most loaded layer, which add up to top-k picks per token of the step, and its max / mean.
(`tests/dist/test_expert_parallel.py` checks such runs against one process, exactly.)

And the same example with a Qwen3.5-MoE LLM (a shared expert behind a sigmoid gate, which
AutoEP keeps whole under its own names) trains at ep=2 and exports HF's layout: the shared
experts under HF's names, loadable with transformers, equal to the trained checkpoint's."""

from __future__ import annotations

import json

import pytest

from ds_omni.train.metrics import read_metrics
from tests.e2e.launch import REPO, launcher_cmd, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # 30-50 s a run on 2 cores

EXAMPLE = REPO / "examples" / "tiny_moe.json"
STEPS = 8


def _train(tmp_path, launcher: str, nproc: int, *sets: str, config=EXAMPLE) -> list[dict]:
    """The example (or `config`) for STEPS steps (warm-up 1, no checkpoints in between): its
    metrics."""
    out = tmp_path / "run"
    overrides = [f"train.steps={STEPS}", "train.warmup_steps=1", "train.save_every=0",
                 f"train.output_dir={out}", *sets]
    res = run(launcher_cmd(launcher, nproc) + [
        "train", "--config", str(config), "--deepspeed", str(REPO / "ds_configs" / "zero2.json"),
        *[a for s in overrides for a in ("--set", s)]], timeout=600)
    assert res.returncode == 0, res.stdout[-3000:]
    records = read_metrics(str(out))
    assert [r["step"] for r in records] == list(range(STEPS)), records
    return records


def _loss_falls(records: list[dict]) -> None:
    losses = [r["loss"] for r in records]
    assert all(l == l for l in losses), losses  # finite
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses


def test_tiny_moe_trains_as_shipped_with_experts_over_two_ranks(tmp_path):
    """2 ranks, parallel.ep=2 as shipped: the loss falls and the expert load is in every record."""
    config = json.loads(EXAMPLE.read_text())
    assert config["parallel"]["ep"] == 2  # the shipped plan is the one under test
    records = _train(tmp_path, "deepspeed", 2)
    _loss_falls(records)
    _expert_load_adds_up(records, config)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["world_size"] == 2 and report["final_step"] == STEPS


def test_tiny_moe_trains_on_one_process_without_expert_parallelism(tmp_path):
    """`ds-omni train` alone with parallel.ep=1 (HF's MoE blocks, every expert here): the expert
    load is HF's own router's picks (`count_hf_experts`)."""
    records = _train(tmp_path, "single", 1, "parallel.ep=1")
    _loss_falls(records)
    _expert_load_adds_up(records, json.loads(EXAMPLE.read_text()))


def _expert_load_adds_up(records: list[dict], config: dict) -> None:
    """Every record's expert load: each token of the step (all ranks': `tokens` is global) picks
    top_k experts; the max / mean is that of the counts."""
    llm = config["model"]["llm"]["config"]
    experts, top_k = llm["num_experts"], llm["num_experts_per_tok"]
    for r in records:
        counts = [r[f"moe_tokens_expert{e}"] for e in range(experts)]
        assert sum(counts) == top_k * r["tokens"], (r["step"], counts, r["tokens"])
        mean = sum(counts) / experts
        assert r["moe_load_max_over_mean"] == pytest.approx(max(counts) / mean, rel=1e-6), r
        assert 1.0 <= r["moe_load_max_over_mean_mean"] <= r["moe_load_max_over_mean"], r


SHARED = {"model_type": "qwen3_5_moe_text", "hidden_size": 64, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
          "output_router_logits": True, "router_aux_loss_coef": 0.01, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 256, "tie_word_embeddings": False,
          "layer_types": ["full_attention", "full_attention"]}


def test_shared_experts_train_under_ep_and_export_under_hfs_names(tmp_path):
    import torch
    import ds_omni.model.families  # noqa: F401  (registers ds_omni's classes with transformers)
    from transformers import AutoModelForImageTextToText
    from ds_omni.model.convert import consolidate_checkpoint
    config = json.loads(EXAMPLE.read_text())
    config["model"]["llm"]["config"] = dict(SHARED)
    path = tmp_path / "shared.json"
    path.write_text(json.dumps(config))
    _loss_falls(_train(tmp_path, "deepspeed", 2, config=path))
    trained = consolidate_checkpoint(tmp_path / "run" / "checkpoints")
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path / "run" / "hf").state_dict()
    shared = {k.split("layers.", 1)[1]: v for k, v in hf.items() if ".shared_expert" in k}
    assert len(shared) == 2 * 4, sorted(shared)  # gate, up, down and the gate's, per layer
    for leaf, value in shared.items():
        assert torch.equal(value, trained[f"backbone.layers.{leaf}"]), leaf
