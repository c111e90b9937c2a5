"""`ds-omni data check` over the HF layouts: it names each source's layout and the columns taken,
and reports rows, modalities, token lengths and bad rows as for LLaVA sources."""

import json

from ds_omni.cli import main
from ds_omni.data.check import format_report
from tests.fixtures import tiny_config_dict
from tests.hf_layouts import part_rows, write_hub_folder, write_parquet


def test_data_check_reports_each_layout(tmp_path, capsys):
    rows = part_rows(6)
    rows[1]["messages"][0]["content"][0]["type"] = "picture"
    rows[2]["images"] = [None] * len(rows[2]["images"])
    parts = write_parquet(rows, "parts", tmp_path / "parts.parquet")
    hub = write_hub_folder(tmp_path / "hub", n=4)
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["data"] = {"max_seq_len": 256, "sources": [
        {"name": "parts", "path": str(parts), "on_bad_sample": "skip"},
        {"name": "cauldron", "path": str(hub), "config": "cauldron"}]}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert main(["data", "check", "--config", str(tmp_path / "cfg.json"), "--json",
                 "--no-progress"]) == 0
    whole = json.loads(capsys.readouterr().out)
    parts, cauldron = whole["sources"]["parts"], whole["sources"]["cauldron"]
    assert (parts["layout"], parts["schema"]["text"]["column"], parts["schema"]["image"]) == \
        ("messages", "messages", {"column": "images", "rows_with_it": 6})
    assert parts["rows"] == 6 and parts["modalities"]["image"] == 4 and parts["bad_rows"] == 2
    assert parts["problems"] == {"media_missing": 1, "text": 1}
    assert "message 0 part 0 has type 'picture'" in parts["examples"]["text"][0]
    assert cauldron["layout"] == "cauldron" and cauldron["layout_detected"]
    assert cauldron["rows"] == 4 and cauldron["bad_rows"] == 0 and cauldron["tokens"]["min"] > 16
    out = format_report(whole)
    assert "layout: cauldron (detected from the first rows); columns taken: text='texts'" in out
