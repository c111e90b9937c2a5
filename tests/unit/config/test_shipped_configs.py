"""Every shipped JSON config loads strictly, and every DeepSpeed config merges with every example."""

import json
from pathlib import Path

import pytest

from ds_omni.config import load_config
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.train.ds_config import derive_ds_config, load_ds_json

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").rglob("*.json"))  # two_stage/ too
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def test_there_are_configs():
    assert EXAMPLES and len(DS_CONFIGS) >= 6


COMPOSED = {"finetune_qwen3_vl_moe.json", "finetune_70b_backbone.json"}
"""Full fine-tunes of a composed backbone, whose plan reads the model folder's config: planned
with one in tests/unit/config/test_composed_examples.py."""


@pytest.mark.parametrize("example", [p for p in EXAMPLES if p.name not in COMPOSED],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("ds_path", DS_CONFIGS, ids=lambda p: p.name)
def test_example_with_deepspeed_config(example, ds_path):
    cfg = load_config(example)
    par = cfg.parallel  # dp: 2, or ep where the experts need more data ranks
    plan = ParallelPlan.from_config(par, par.sp * par.pp * par.tp * max(2, par.ep), cfg.data.reorder)
    user = load_ds_json(ds_path)
    if cfg.parallel.ep > 1 and user["zero_optimization"]["stage"] == 3 and cfg.train.export_hf:
        from ds_omni.errors import ConfigError  # refused at start-up: the export could not read it
        from ds_omni.train.setup import plan_run
        with pytest.raises(ConfigError, match="train.export_hf to false"):
            plan_run(cfg, user, plan.world_size)
        return
    merged = derive_ds_config(cfg, user, plan)
    assert merged["train_batch_size"] == cfg.train.global_batch_size
    assert '"auto"' not in json.dumps(merged)  # no value left "auto" (a key may say autoep_size)


FINETUNE = [p for p in EXAMPLES if p.name.startswith("finetune_") and p.name not in COMPOSED]


def test_finetune_examples_are_complete_recipes():
    """Each fine-tune example points at model folders, renders with the model's own template,
    trains LoRA and has an eval source; examples/README.md explains every example file.
    (tests/e2e/test_finetune_examples.py trains each on a tiny folder, in the slow tier.)"""
    assert len(FINETUNE) == 4
    readme = (REPO / "examples" / "README.md").read_text()
    assert all(f"`{p.relative_to(REPO / 'examples')}`" in readme for p in EXAMPLES)
    for path in FINETUNE:
        cfg = load_config(path)
        folders = [cfg.model.pretrained] if cfg.model.pretrained else \
            [cfg.model.llm.pretrained, cfg.model.vision.pretrained]
        assert all(f and f.startswith("/path/to/") for f in folders), path.name
        assert cfg.data.template == "model" and cfg.model.lora is not None, path.name
        assert cfg.data.eval_sources and cfg.train.eval_every, path.name
