"""The HF ecosystem's layouts train: typed-part messages (with a bad row skipped), The Cauldron
from a hub snapshot folder and an InternVL meta JSON, mixed, 3 steps on 2 ranks under ZeRO-2
through the deepspeed launcher; the start-up log names each source's layout."""

import json
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests.e2e.launch import train, write_configs
from tests.hf_layouts import part_rows, write_hub_folder, write_internvl_meta, write_parquet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_hf_layouts_train_three_steps_on_two_ranks_under_zero2(tmp_path):
    rows = part_rows(12)
    rows[3]["messages"][0]["content"][0]["type"] = "picture"  # a bad row, skipped
    parts = write_parquet(rows, "parts", tmp_path / "parts" / "train.parquet")
    hub = write_hub_folder(tmp_path / "hub")
    meta = write_internvl_meta(tmp_path / "internvl")
    cfg, ds, out = write_configs(tmp_path, stage=2, steps=3)
    config = json.loads(Path(cfg).read_text())
    config["data"].update(internvl_meta=str(meta), chunk_rows=4, sources=[
        {"name": "parts", "path": str(parts), "on_bad_sample": "skip"},
        {"name": "cauldron", "path": str(hub), "config": "cauldron"}])
    Path(cfg).write_text(json.dumps(config))
    res = train("deepspeed", 2, cfg, ds, timeout=400)
    assert res.returncode == 0, res.stdout[-4000:]
    for name, layout in (("parts", "messages"), ("cauldron", "cauldron"), ("shapes_a", "llava")):
        assert f"data source '{name}': layout '{layout}' (detected" in res.stdout, name
    records = read_metrics(out)
    assert len(records) == 3 and all(r["loss"] == r["loss"] for r in records)
    sources = {key.split("/", 1)[1].split(":")[0] for r in records for key in r["sample_keys"]}
    assert {"parts", "cauldron"} <= sources
    report = json.loads((Path(out) / "report.json").read_text())
    assert report["world_size"] == 2
