"""The LLaVA-style two-stage recipe (`examples/two_stage/`) as shipped, through `ds-omni train`
(`tests/e2e/two_stage_run.py`, one process): stage 1 trains the projector alone, stage 2 starts
from exactly stage 1's HF export and fine-tunes the LLM, and stage 2 resumes exactly."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from ds_omni.config import load_config
from ds_omni.train.metrics import read_metrics
from tests.e2e.launch import REPO, run

pytestmark = pytest.mark.e2e
EXAMPLES = REPO / "examples" / "two_stage"
STAGE1, STAGE2 = EXAMPLES / "stage1_align.json", EXAMPLES / "stage2_finetune.json"
# the three parts of the export (an HF LlavaForConditionalGeneration), by key prefix
PARTS = {"vision": "vision_tower.", "projector": "multi_modal_projector.", "llm": "language_model."}


def test_stage2_starts_from_stage1s_export():
    """Both load strictly; stage 2's model is stage 1's `<output_dir>/hf` (the quick tier)."""
    stage1, stage2 = load_config(STAGE1), load_config(STAGE2)
    assert stage2.model.pretrained == stage1.train.output_dir + "/hf"
    assert stage1.train.export_hf
    assert stage1.model.frozen_parts() == ["vision", "llm"]
    assert stage2.model.frozen_parts() == ["vision"] and stage2.train.lr < stage1.train.lr


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _changed(before: dict, after: dict) -> dict[str, set[bool]]:
    """Part -> whether each of its tensors changed ({True}, {False} or both)."""
    import torch
    assert before.keys() == after.keys()
    part = {k: next(p for p, prefix in PARTS.items() if k.startswith(prefix)) for k in before}
    changed: dict[str, set[bool]] = {p: set() for p in PARTS}
    for key in before:
        changed[part[key]].add(not torch.equal(before[key], after[key]))
    return changed


def _initial_weights(out: Path) -> dict:
    """Stage 1's model as built (the seeded random init), exported as stage 1's export is."""
    from ds_omni.model.build import build_model
    from ds_omni.model.convert import export_hf
    built = build_model(load_config(STAGE1).model)
    return _weights(export_hf(built.model, out, built.tokenizer))


@pytest.mark.slow  # about a minute: 4 runs in one process
def test_two_stage_recipe_trains_projector_then_llm_and_resumes(tmp_path):
    res = run([sys.executable, "-m", "tests.e2e.two_stage_run", str(tmp_path)], timeout=600)
    assert res.returncode == 0, res.stdout[-5000:]
    stage1 = _weights(tmp_path / "stage1" / "hf")
    # stage 1: only the projector moved; the tower and the LLM are bit for bit the initial ones
    assert _changed(_initial_weights(tmp_path / "init"), stage1) == {
        "vision": {False}, "projector": {True}, "llm": {False}}
    # stage 2 built exactly stage 1's export before its first step
    assert _changed(stage1, _weights(tmp_path / "stage2_start")) == {
        "vision": {False}, "projector": {False}, "llm": {False}}
    # stage 2 trained every tensor of the LLM and the projector, not the tower
    assert _changed(stage1, _weights(tmp_path / "stage2" / "hf")) == {
        "vision": {False}, "projector": {True}, "llm": {True}}
    full, resumed = read_metrics(tmp_path / "stage2"), read_metrics(tmp_path / "stage2_resumed")
    assert [r["step"] for r in resumed] == [0, 1]
    assert all(math.isfinite(r["loss"]) for r in full)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    # stopped after 1 step and resumed: the same final weights as the uninterrupted run
    assert _changed(_weights(tmp_path / "stage2" / "hf"),
                    _weights(tmp_path / "stage2_resumed" / "hf")) == {
        "vision": {False}, "projector": {False}, "llm": {False}}


def test_the_comparison_sees_one_element_moved_by_1e_6():
    """The planted error of the recipe's test (a projector or LLM tensor nudged on loading, an
    LLM left unfrozen for one tensor): one element of one tensor moved by 1e-6 shows."""
    import torch
    before = {"vision_tower.w": torch.ones(3), "multi_modal_projector.w": torch.ones(3),
              "language_model.a": torch.ones(3), "language_model.b": torch.ones(3)}
    after = {k: v.clone() for k, v in before.items()}
    after["language_model.b"][1] += 1e-6
    assert _changed(before, after) == {"vision": {False}, "projector": {False},
                                       "llm": {False, True}}
