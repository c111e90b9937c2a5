"""`ds-omni plan --simulate` on a shipped example config: the plan's report and the five
baselines, as JSON and for people; bad cluster input is an error without a traceback."""

import json
from pathlib import Path

import pytest

from ds_omni.cli import main
from ds_omni.sim.baselines import BASELINES

ROOT = Path(__file__).resolve().parents[3]
ARGS = ["plan", "--config", str(ROOT / "examples/tiny_llava.json"), "--deepspeed",
        str(ROOT / "ds_configs/zero2.json"), "--simulate", "--gpus", "16", "--gpus-per-node", "8",
        "--gpu", "h100", "--set", "train.global_batch_size=256", "--set", "train.micro_batch_size=4"]


@pytest.mark.slow  # builds the model on the meta device (~10 s of imports and configs)
def test_plan_simulate_prints_the_report_and_the_baselines(capsys):
    assert main(ARGS + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = out["plan"]
    assert p["plan"]["dp"] == 16 and p["plan"]["zero_stage"] == 2 and p["samples"] == 256
    assert p["step_time"] > 0 and 0 < p["mfu"] < 1 and p["fits"]
    assert set(out["baselines"]) == set(BASELINES)
    assert all("step_time" in b for b in out["baselines"].values()), out["baselines"]
    assert main(ARGS) == 0
    text = capsys.readouterr().out
    assert "critical path: rank" in text and "baselines (same model, same samples):" in text


def test_plan_simulate_rejects_a_cluster_smaller_than_a_node(capsys):
    args = [a if a != "16" else "4" for a in ARGS]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "gpus_per_node=8 is more than the cluster's gpus=4" in err and "Traceback" not in err


def test_workload_files(tmp_path):
    from ds_omni.errors import ConfigError
    from ds_omni.sim.from_config import load_workload
    from tests.unit.sim.test_sim_step import llava_7b
    m = llava_7b()
    default = load_workload(None, m, 512)
    assert default.audio_fraction == 0 and default.max_tokens == 512  # no audio encoder
    fields = tmp_path / "w.json"
    fields.write_text(json.dumps({"image_fraction": 0.9, "patches_range": [64, 256]}))
    spec = load_workload(str(fields), m, 4096)
    assert spec.image_fraction == 0.9 and spec.patches_range == (64, 256)
    report = tmp_path / "check.json"
    report.write_text(json.dumps({"sources": {"a": {
        "checked": 10, "modalities": {"image": 5, "audio": 0, "text_only": 5},
        "tokens": {"buckets": {"<=1024": 10}}, "items_per_sample": {"0": 5, "1": 5}}}}))
    assert load_workload(str(report), m, 2048).max_tokens == 2048
    fields.write_text(json.dumps({"image_share": 0.9}))
    with pytest.raises(ConfigError, match="unknown fields \\['image_share'\\]"):
        load_workload(str(fields), m, 512)


@pytest.mark.slow  # the meta-device model, then a search of ~3,000 plans (~15 s of CPU)
def test_plan_search_prints_the_best_plans_the_baselines_and_the_dropped(capsys):
    args = [a for a in ARGS if a != "--simulate"] + ["--search", "--top", "3"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # the JSON alone: DeepSpeed's logs go to stderr
    assert 1 <= len(out["top"]) <= 3 and out["counts"]["unexplored"] == 0
    times = [r["step_time"] for r in out["top"]]
    assert times == sorted(times) and all(r["bound"] <= r["step_time"] for r in out["top"])
    assert set(out["baselines"]) == set(BASELINES)
    assert set(out["baselines_as_run"]) == {"megatron_as_run", "disaggregated_as_run",
                                            "static_cp_as_run"}, out["baselines_as_run"]
    reasons = " ".join(d["reason"] for d in out["dropped"])
    assert "must divide the LLM's attention heads" in reasons  # training's plan_run said so
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("searched ") and "baselines of plan 1" in text and "dropped:" in text
    assert "baselines as their papers ran them:" in text


def test_the_search_refuses_pp_where_the_model_layers_cannot_be_stages(tmp_path):
    """ERNIE-4.5-VL's decoder layers take per-token inputs the pipeline stages do not carry:
    `pipeline_layers` refuses them on the built model, which `plan_run` never builds. The
    search's training check refuses such a model's pp plans with that reason (it once ranked
    such plans first for examples/finetune_qwen3_vl_moe.json, which `ds-omni plan` then refused),
    and keeps the pp plans of models whose layers can be stages: the tiny LLaVA, and Qwen3-VL-MoE,
    whose deepstack levels the stages carry (`pipeline_deepstack`)."""
    from ds_omni.errors import ModelError
    from ds_omni.sim.from_config import sim_plan, training_check
    from tests.family_dirs import make_generic_dir
    from tests.fixtures import ds_config, tiny_config
    cfgs = {"llava": tiny_config(str(tmp_path / "llava"), global_batch_size=8, micro_batch_size=1)}
    for family in ("qwen3_vl_moe", "ernie4_5_vl_moe"):
        cfg = tiny_config(str(tmp_path / family), global_batch_size=8, micro_batch_size=1)
        cfg.model.pretrained = str(make_generic_dir(tmp_path / f"{family}_dir", family))
        cfg.model.tokenizer = cfg.model.vision = cfg.model.llm = None
        cfgs[family] = cfg
    for name, cfg in cfgs.items():
        base, check = sim_plan(cfg, ds_config(1), 4), training_check(cfg, ds_config(1), 4)
        check(base)  # no pp: trains
        if name == "ernie4_5_vl_moe":
            with pytest.raises(ModelError, match="per token"):
                check(base.replace(pp=2, dp="auto"))
        else:
            check(base.replace(pp=2, dp="auto"))
