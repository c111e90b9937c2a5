"""Ulysses SP through the real launcher: sp=2 on 2 ranks, ZeRO-3, stop, resume, export.

One SP group of 2 ranks trains the same global batches as one process alone (dp=1 in both), so
the run must reproduce a plain single-process run step for step: the same samples and the same
losses, across a stop and a resume; and its checkpoint exports to a HuggingFace directory.
"""

import json
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests.e2e.launch import train, write_configs

pytestmark = pytest.mark.e2e
STEPS = 4


def test_sp2_resumes_exports_and_matches_one_process(tmp_path):
    cfg, ds, out_single = write_configs(tmp_path / "single", stage=3, steps=STEPS)
    single = train("single", 1, cfg, ds)
    assert single.returncode == 0, single.stdout[-3000:]

    cfg, ds, out = write_configs(tmp_path / "sp", stage=3, steps=STEPS, export_hf=True)
    first = train("deepspeed", 2, cfg, ds, "--set", "parallel.sp=2", "--stop-after", "2")
    assert first.returncode == 0, first.stdout[-3000:]
    second = train("deepspeed", 2, cfg, ds, "--set", "parallel.sp=2", "--resume")
    assert second.returncode == 0, second.stdout[-3000:]

    want, got = read_metrics(out_single), read_metrics(out)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert [r["sample_keys"] for r in got] == [r["sample_keys"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]  # padding is not counted
    report = json.loads((Path(out) / "report.json").read_text())
    assert report["sp"] == 2 and report["dp"] == 1
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(Path(out) / "hf").model_type == "llava"
