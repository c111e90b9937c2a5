"""benchmarks/feed_rate.py: its FLOPs per sample are gpu_mfu.py's (one model, one count), and a
small run writes figures that hold together."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_sample_flops_are_gpu_mfus_count():
    feed, mfu = _load("feed_rate"), _load("gpu_mfu")
    llm = SimpleNamespace(hidden_size=64, num_hidden_layers=3)  # what a LlamaConfig is read for
    body, head, tower, embeddings, positions, text = 1000, 300, (500, 2, 32), 16, 17, 5
    projector = 32 * 64 + 64 * 64
    flops = mfu.FlopModel(llm_body_params=body, head_params=head, vision_params=tower[0],
                          projector_params=projector, llm_layers=3, llm_width=64, vision_layers=2,
                          vision_width=32, vision_seq=positions, image_embeddings=embeddings)
    s = embeddings + text
    mask = torch.zeros(s + 1, dtype=torch.bool)
    mask[-text:] = True  # every text token a target; loss_mask[1:] counts them
    doc = mfu.Doc(input_ids=torch.zeros(s), loss_mask=mask, pixels=torch.zeros(3, 2, 2))
    assert feed.sample_flops(llm, (body, head), tower, embeddings, positions, text) == \
        flops.step_flops([[doc]])


@pytest.mark.slow
def test_small_run_writes_sane_figures(tmp_path, monkeypatch):
    feed = _load("feed_rate")
    out = tmp_path / "feed_rate.json"
    monkeypatch.setattr(sys, "argv", ["feed_rate.py", "--items", "2", "--repeats", "1",
                                      "--out", str(out)])
    feed.main()
    report = json.loads(out.read_text())
    assert set(report["processors"]) == {"clip336", "qwen2_vl", "siglip384", "whisper"}
    qwen = report["processors"]["qwen2_vl"]
    assert (qwen["embeddings"], qwen["encoder_positions"]) == (391, 1564)  # 644x476 / 14, merged 2x2
    for row in report["processors"].values():
        for llm in ("llava_1p4b", "llama2_7b"):
            r = row[llm]
            assert r["cores_per_gpu"] == pytest.approx(r["gpu_samples_per_s"] /
                                                       row["items_per_core_s"])
        assert row["llama2_7b"]["sample_tflop"] > row["llava_1p4b"]["sample_tflop"]
