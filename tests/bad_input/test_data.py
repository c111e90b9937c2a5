"""Bad data, in every layout (jsonl, JSON document, parquet, arrow, webdataset tar, save_to_disk),
is refused at start-up naming the source, the file (and line) and what to change; a malformed
jsonl line is a bad sample: named by file and line, skipped under on_bad_sample "skip", and
counted by `ds-omni data check` without a traceback."""

import json
from pathlib import Path

import pytest

from ds_omni.cli import main
from ds_omni.data.problems import MALFORMED
from ds_omni.data.sources import Locator, Source
from ds_omni.config import SourceConfig, from_dict
from ds_omni.errors import DataError
from tests.bad_input.common import config, refused, says, snapshot, train, write
from tests.data_files import conversation_rows, text_rows
from tests.data_files import write as write_layout

TEXT = {"schema": {"text": "text", "image": None}}
LINES = [json.dumps(r) for r in text_rows(6)]


def _file(name: str, body, **fields):
    """A source of one file `name` holding `body` (str or bytes)."""
    def make(d: Path) -> dict:
        path = d / name
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
        return {"name": "s", "path": str(path), **TEXT, **fields}
    return make


def _layout(fmt: str, schema: dict | None = None, rows=None):
    """A source in layout `fmt` (tests/data_files.py), its schema changed by `schema`."""
    def make(d: Path) -> dict:
        path, default = write_layout(fmt, rows or conversation_rows(4), d / "data", files=1)
        return {"name": "s", "path": path, "schema": {**default, **(schema or {})}}
    return make


def _broken_line(n: int) -> str:
    """The jsonl lines with line `n` (1-based) cut short."""
    lines = list(LINES)
    lines[n - 1] = lines[n - 1][:-9]
    return "\n".join(lines) + "\n"


def _image_rows(d: Path) -> dict:
    path, schema = write_layout("json", conversation_rows(3), d / "data", files=1)
    Path(schema["root"], "r1.png").unlink()
    return {"name": "s", "path": path, "schema": schema}


DATA_CASES = {  # name: (source, words)
    "jsonl_malformed_line": (_file("a.jsonl", _broken_line(3)),
                             ["a.jsonl' line 3 is not valid JSON", "on_bad_sample", "\"skip\""]),
    "jsonl_malformed_first_line": (_file("a.jsonl", _broken_line(1)),
                                   ["a.jsonl' line 1 is not valid JSON"]),
    "jsonl_every_line_malformed_under_skip": (
        _file("a.jsonl", "{\"text\": \n{\"text\": \n", on_bad_sample="skip"),
        ["a.jsonl' line 1 is not valid JSON"]),
    "jsonl_empty": (_file("a.jsonl", ""), ["data source 's'", "hold no rows", "a.jsonl"]),
    "jsonl_blank_lines": (_file("a.jsonl", "\n\n\n"), ["hold no rows"]),
    "jsonl_not_utf8": (_file("a.jsonl", "\n".join(LINES).encode("utf-16")),
                       ["cannot read", "a.jsonl' as json", "utf-8"]),
    "json_truncated": (_file("a.json", "[" + ",".join(LINES)[:-5]),
                       ["a.json' is not valid JSON near byte"]),
    "json_two_lists": (_file("a.json", json.dumps({"a": [{"text": "x"}], "b": [{"text": "y"}]})),
                       ["keys ['a', 'b']", "set the source's json_field"]),
    "json_field_missing": (_file("a.json", json.dumps({"a": [{"text": "x"}]}), json_field="rows"),
                           ["without a list under json_field='rows'", "its keys are ['a']"]),
    "json_rows_not_objects": (_file("a.json", json.dumps(["x", "y"])),
                              ["element 0", "is a str", "must be a JSON object"]),
    "csv": (_file("a.csv", "text\nx\n"), ["cannot infer one format", "['.csv']", "set 'format'"]),
    "parquet_garbage": (_file("a.parquet", b"not parquet"), ["cannot read", "a.parquet' as parquet"]),
    "arrow_garbage": (_file("a.arrow", b"not arrow"), ["cannot read", "a.arrow' as arrow"]),
    "tar_garbage": (_file("a.tar", b"not a tar"), ["cannot read", "a.tar' as webdataset"]),
    "format_says_parquet": (_file("a.jsonl", "\n".join(LINES), format="parquet"),
                            ["a.jsonl' as parquet"]),
    "no_such_path": (lambda d: {"name": "s", "path": str(d / "nope"), **TEXT},
                     ["data source 's': no data at", "nope", "give a file, a glob"]),
    "folder_without_data": (lambda d: (d / "empty").mkdir() or {"name": "s",
                                                               "path": str(d / "empty"), **TEXT},
                            ["no data at", "empty"]),
    "jsonl_wrong_text_column": (_layout("json", {"text": "txt"}),
                                ["schema.text='txt' is not a column", "its rows have",
                                 "data.sources[s].schema.text"]),
    "parquet_wrong_text_column": (_layout("parquet", {"text": "txt"}),
                                  ["schema.text='txt' is not a column"]),
    "arrow_wrong_text_column": (_layout("arrow", {"text": "txt"}),
                                ["schema.text='txt' is not a column"]),
    "disk_wrong_text_column": (_layout("disk", {"text": "txt"}),
                               ["schema.text='txt' is not a column"]),
    "webdataset_wrong_image_column": (_layout("webdataset", {"image": "jpg"}),
                                      ["<image> markers but no row has their images",
                                       "schema.image='jpg'"]),
    "parquet_no_image_column": (_layout("parquet", {"image": None}),
                                ["<image> markers", "schema.image is null"]),
    "relative_image_missing": (_image_rows, ["media file 'r1.png' not found", "schema.root"]),
    "schema_root_wrong": (_layout("json", {"root": "/nonexistent"}),
                          ["not found", "'/nonexistent'", "schema.root"]),
}


@pytest.mark.parametrize("name", sorted(DATA_CASES))
def test_bad_data_is_refused_at_start_up(tmp_path, capsys, no_training, name):
    source, words = DATA_CASES[name]
    cfg = config(tmp_path / "out")
    cfg["data"]["sources"] = [source(tmp_path)]
    says(refused(capsys, *write(tmp_path, cfg)), *words)
    assert snapshot(tmp_path / "out") == {}


def test_malformed_line_under_skip_starts(tmp_path, capsys, no_training):
    cfg = config(tmp_path / "out")
    cfg["data"]["sources"] = [_file("a.jsonl", _broken_line(2), on_bad_sample="skip")(tmp_path)]
    assert train(capsys, *write(tmp_path, cfg))[0] == "started"


def test_malformed_line_is_a_bad_sample_the_loader_names(tmp_path):
    """What the loader (every layout reads rows through `Source`) gets for line 4."""
    source = Source(from_dict(SourceConfig, _file("a.jsonl", "\n" + _broken_line(3))(tmp_path)))
    rows = list(source.stream(source.chunks[0], 0))
    assert [MALFORMED in row for _, row in rows] == [False, False, True, False, False, False]
    loc, row = rows[2]
    with pytest.raises(DataError) as e:
        source.parts(row, loc)
    says(str(e.value), "sample s:0:2", "a.jsonl' line 4 is not valid JSON", "\"skip\"")
    assert e.value.kind == "malformed"


def test_data_check_counts_a_malformed_line_without_a_traceback(tmp_path, capsys):
    cfg = config(tmp_path / "out")
    cfg["data"]["sources"] = [_file("a.jsonl", _broken_line(5), on_bad_sample="skip")(tmp_path)]
    c, _ = write(tmp_path, cfg)
    assert main(["data", "check", "--config", c, "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)["sources"]["s"]
    assert report["problems"] == {"malformed": 1} and report["bad_rows"] == 1
    says(report["examples"]["malformed"][0], "a.jsonl' line 5 is not valid JSON")
    assert "Traceback" not in captured.err
    cfg["data"]["sources"][0]["on_bad_sample"] = "error"
    c, _ = write(tmp_path, cfg)
    assert main(["data", "check", "--config", c, "--no-progress"]) == 2  # the start-up check's
    err = capsys.readouterr().err
    says(err, "ds-omni: error: data source 's'", "a.jsonl' line 5 is not valid JSON")
    assert "Traceback" not in err
