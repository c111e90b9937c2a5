"""`ds-omni data check`: a per-source report (text and --json), every problem kind counted, exit
1 on errors, --sample; and the cheap part at `ds-omni train` start-up (exit 2, clear message)."""

import json

import pytest

from ds_omni.cli import main
from tests.data_files import conversation_rows, write
from tests.data_layouts import write_llava_json, write_problem_json, write_webdataset
from tests.fixtures import ds_config, tiny_config_dict


def _config(tmp_path, sources, **data) -> str:
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["data"] = {"sources": sources, "max_seq_len": 128, **data}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    parquet, schema = write("parquet", conversation_rows(6), tmp / "pq")
    return {
        "llava": {"name": "llava", "path": str(write_llava_json(tmp / "llava", n=8)[0])},
        "wds": {"name": "wds", "path": str(write_webdataset(tmp / "wds")),
                "schema": {"text": "json.conversations", "image": "jpg", "id": "__key__"}},
        "parquet": {"name": "pq", "path": parquet, "schema": schema},
        "problems": {"name": "bad", "path": str(write_problem_json(tmp / "bad")[0]),
                     "on_bad_sample": "skip"},
    }


def test_clean_sources_pass(tmp_path, layouts, capsys):
    cfg = _config(tmp_path, [layouts["llava"], layouts["wds"], layouts["parquet"]])
    assert main(["data", "check", "--config", cfg, "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == []
    llava, wds, pq = (report["sources"][n] for n in ("llava", "wds", "pq"))
    assert (llava["rows"], llava["checked"], llava["modalities"]) == (
        8, 8, {"image": 6, "audio": 0, "video": 0, "text_only": 2})
    assert llava["items_per_sample"] == {"0": 2, "1": 6}
    assert wds["modalities"]["text_only"] == 4 and pq["rows"] == 6 and pq["bad_rows"] == 0
    assert set(llava["columns"]) == {"id", "image", "conversations"}
    assert llava["schema"]["image"] == {"column": "image", "rows_with_it": 6}
    assert sum(llava["tokens"]["buckets"].values()) == 8


def test_every_problem_is_counted(tmp_path, layouts, capsys):
    cfg = _config(tmp_path, [layouts["problems"]], max_aspect_ratio=10.0)
    assert main(["data", "check", "--config", cfg, "--json", "--no-progress"]) == 1
    r = json.loads(capsys.readouterr().out)
    bad = r["sources"]["bad"]
    assert bad["problems"] == {"conversation_string": 1, "markers": 1, "media_missing": 1,
                               "media_unreadable": 1, "overlong": 1}
    assert bad["extreme_aspect"] == 1 and bad["over_max_seq_len"] == 1
    assert bad["bad_rows"] == 4  # the JSON-string conversation is parsed, so it trains
    assert any("rows over data.max_seq_len=128 would stop training" in e for e in r["errors"])
    assert "missing" in json.dumps(bad["examples"]["media_missing"])
    # the text report, and --sample
    assert main(["data", "check", "--config", cfg, "--sample", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out  # rows 0, 4, 7: one bad row, skipped by policy
    assert "source 'bad': json, 1 file(s), 8 rows, 3 checked" in out
    assert "bad rows: 1 {'markers': 1}" in out and out.rstrip().endswith("no errors")


def test_check_rejects_a_wrong_schema(tmp_path, layouts, capsys):
    cfg = _config(tmp_path, [{**layouts["wds"], "schema": {"text": "json.conversations"}}])
    assert main(["data", "check", "--config", cfg, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-omni: error: data source 'wds': the text has <image> markers but no "
                          "row has their images: schema.image='image' is not a column")
    assert "'jpg' or 'png'" in err and "Traceback" not in err


@pytest.mark.parametrize("source, message", [
    ({"schema": {"text": "conversation"}}, "schema.text='conversation' is not a column of source "
                                           "'llava'; its rows have ['id', 'image', 'conversations']"),
    ({"schema": {"root": "/nowhere"}}, "media file 'images/r0.png' not found: resolved against "
                                       "'/nowhere' (schema.root='/nowhere')"),
])
def test_train_start_up_check(tmp_path, layouts, capsys, source, message):
    cfg = _config(tmp_path, [{**layouts["llava"], **source}])
    (tmp_path / "ds.json").write_text(json.dumps(ds_config(2)))
    assert main(["train", "--config", cfg, "--deepspeed", str(tmp_path / "ds.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-omni: error: data source 'llava': ") and message in err
    assert "Traceback" not in err
