"""The fine-tune examples (`examples/finetune_*.json`) train as shipped: each runs 2 steps on a tiny
model folder of the shape it names (`tests/finetune_dirs.py`, with the model's own chat
template), with every field of the example kept and only its paths, steps and sizes changed. One
process trains the four one after another (`tests/e2e/run_configs.py`, the CLI's `train`)."""

from __future__ import annotations

import copy
import json
import math
import re
import sys
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests import finetune_dirs
from tests.e2e.launch import REPO, run

pytestmark = pytest.mark.e2e

# example -> (HF class of its export, the template its tiny folder carries)
EXAMPLES = {
    "finetune_qwen2_vl.json": ("Qwen2VLForConditionalGeneration", finetune_dirs.QWEN2_VL),
    "finetune_llava_onevision.json": ("LlavaOnevisionForConditionalGeneration",
                                      finetune_dirs.LLAVA_ONEVISION),
    "finetune_idefics3.json": ("Idefics3ForConditionalGeneration", finetune_dirs.SMOLVLM),
    "finetune_composed.json": ("LlavaForConditionalGeneration", finetune_dirs.QWEN2_5),
}
STEPS = {"train.steps": 2, "train.warmup_steps": 1}
SIZES = {"train.global_batch_size": 2, "train.micro_batch_size": 1, "data.max_seq_len": 512}
LLM_WEIGHT = "layers.0.self_attn.q_proj.weight"  # an LLM layer LoRA adapts (and the export merges)


def _leaves(node, where: str = "") -> dict:
    """Dotted path ("data.sources[0].path") -> value of every scalar or list of scalars."""
    if isinstance(node, dict):
        return {k: v for key, child in node.items()
                for k, v in _leaves(child, f"{where}.{key}" if where else key).items()}
    if isinstance(node, list) and any(isinstance(x, dict) for x in node):
        return {k: v for i, child in enumerate(node)
                for k, v in _leaves(child, f"{where}[{i}]").items()}
    return {where: node}


def _set(config: dict, dotted: str, value) -> None:
    """Replace the value at an existing dotted path (a KeyError if the example lacks it)."""
    *parents, leaf = re.findall(r"[^.\[\]]+", dotted)
    node = config
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if leaf not in node:
        raise KeyError(f"{dotted} is not a field of the example")
    node[leaf] = value


def adapt(example: dict, paths: dict) -> dict:
    """The example with `paths`, STEPS and SIZES replaced, and nothing else."""
    config = copy.deepcopy(example)
    for dotted, value in {**paths, **STEPS, **SIZES}.items():
        _set(config, dotted, value)
    return config


def _paths(name: str, work: Path, train_file: Path, val_file: Path) -> dict:
    data = {"data.sources[0].path": str(train_file),
            "data.sources[0].schema.root": str(train_file.parent),
            "data.eval_sources[0].path": str(val_file),
            "data.eval_sources[0].schema.root": str(val_file.parent),
            "train.output_dir": str(work / "out")}
    if name == "finetune_composed.json":
        llm, clip = finetune_dirs.make_composed_parts(work)
        return {**data, "model.llm.pretrained": str(llm), "model.vision.pretrained": str(clip)}
    make = {"finetune_qwen2_vl.json": finetune_dirs.make_qwen2_vl,
            "finetune_llava_onevision.json": finetune_dirs.make_llava_onevision,
            "finetune_idefics3.json": finetune_dirs.make_idefics3}[name]
    return {**data, "model.pretrained": str(make(work / "model"))}


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _llm_weight(weights: dict):
    [key] = [k for k in weights
             if k.endswith(LLM_WEIGHT) and "vision" not in k and "visual" not in k]
    return weights[key]


def _check_run(out: Path, base: Path, hf_class: str, template: str) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    report = json.loads((out / "report.json").read_text())
    assert math.isfinite(report["last_eval_loss"]), report
    tag = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / tag / "manifest.json").is_file()
    hf = out / "hf"
    assert type(AutoModelForImageTextToText.from_pretrained(hf)).__name__ == hf_class
    assert AutoTokenizer.from_pretrained(hf).chat_template == template  # the model's own, kept
    assert not (hf / "adapter").exists()  # lora.export "merged": adapters folded in
    assert not torch.equal(_llm_weight(_weights(hf)), _llm_weight(_weights(base)))


@pytest.mark.slow  # the quick tier loads every example (tests/unit/config/test_shipped_configs.py)
def test_finetune_examples_train_on_tiny_folders_of_their_shape(tmp_path):
    train_file, val_file = finetune_dirs.write_llava_data(tmp_path / "data")
    configs, runs = [], {}
    for name in EXAMPLES:
        example = json.loads((REPO / "examples" / name).read_text())
        work = tmp_path / name.removesuffix(".json")
        paths = _paths(name, work, train_file, val_file)
        config = adapt(example, paths)
        assert _leaves(config).keys() == _leaves(example).keys()
        configs.append(work / "config.json")
        configs[-1].write_text(json.dumps(config))
        base = paths.get("model.pretrained") or paths["model.llm.pretrained"]
        runs[name] = (work / "out", Path(base))
    res = run([sys.executable, "-m", "tests.e2e.run_configs",
               str(REPO / "ds_configs" / "zero2.json"), *map(str, configs)], timeout=900)
    assert res.returncode == 0, res.stdout[-5000:]
    for name, (hf_class, template) in EXAMPLES.items():
        _check_run(*runs[name], hf_class, template)
