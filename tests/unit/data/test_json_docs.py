"""JSON arrays and JSON objects holding a list: exact row counts, streaming from any row, random
access, the layouts told apart from JSON lines, errors that name the file."""

import json

import pytest

from ds_omni.config import SchemaConfig, SourceConfig
from ds_omni.data import json_docs
from ds_omni.data.sources import Locator, Source
from ds_omni.errors import DataError
from tests.data_layouts import write_llava_json


@pytest.fixture
def small_blocks(monkeypatch):
    """Tiny read blocks and index stride, so every boundary case is crossed on small files."""
    monkeypatch.setattr(json_docs, "BLOCK", 7)
    monkeypatch.setattr(json_docs, "STRIDE", 3)


ROWS = [{"id": f"r{i}", "text": "héllo ü → " * (i % 4), "x": [i, 1.5e3, None]} for i in range(20)]


@pytest.mark.parametrize("layout", ["array", "object"])
def test_rows_counted_streamed_and_fetched(tmp_path, small_blocks, layout):
    doc = ROWS if layout == "array" else {"version": "1.0", "meta": {"n": [1, 2]}, "data": ROWS,
                                           "tags": ["x"]}
    path = tmp_path / "a.json"
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False))
    d = json_docs.open_document(str(path))
    assert d.num_rows == 20 and d.key == (None if layout == "array" else "data")
    assert [d.row(i) for i in range(20)] == ROWS
    assert list(d.rows(4, 11)) == ROWS[4:11] and list(d.rows(18, 99)) == ROWS[18:]


def test_json_lines_are_not_documents(tmp_path):
    (tmp_path / "a.json").write_text("\n".join(json.dumps(r) for r in ROWS[:3]))
    assert json_docs.open_document(str(tmp_path / "a.json")) is None
    (tmp_path / "one.json").write_text(json.dumps({"id": 1, "conversations": [{"from": "gpt"}]}))
    assert json_docs.open_document(str(tmp_path / "one.json"), row_hint="conversations") is None


def test_object_needs_a_key_when_ambiguous(tmp_path):
    path = tmp_path / "coco.json"
    path.write_text(json.dumps({"images": [{"a": 1}], "annotations": [{"b": 2}, {"b": 3}]}))
    with pytest.raises(DataError, match=r"set the source's json_field.*'images', 'annotations'"):
        json_docs.open_document(str(path))
    assert json_docs.open_document(str(path), key="annotations").num_rows == 2
    with pytest.raises(DataError, match=r"without a list under json_field='nope'.*keys are"):
        json_docs.open_document(str(path), key="nope")


def test_bad_documents_name_the_file(tmp_path):
    (tmp_path / "broken.json").write_text('[{"a": 1}, {"a": ')
    with pytest.raises(DataError, match=r"broken.json' is not valid JSON near byte 11"):
        json_docs.open_document(str(tmp_path / "broken.json"))
    (tmp_path / "strings.json").write_text('["a", "b"]')
    with pytest.raises(DataError, match=r"element 1 of .*strings.json' is a str"):
        json_docs.open_document(str(tmp_path / "strings.json")).row(1)


@pytest.mark.parametrize("key", [None, "data"])
def test_llava_json_source(tmp_path, monkeypatch, key):
    """A LLaVA-Instruct file: right row count, HF-free streaming equal to random access, relative
    image paths resolved against the file's folder whatever the working directory."""
    path, rows = write_llava_json(tmp_path / "llava", n=12, key=key)
    monkeypatch.chdir(tmp_path)  # not the data's folder
    src = Source(SourceConfig(name="llava", path=str(path), json_field=key), chunk_rows=5)
    assert len(src) == 12 and len(src.chunks) == 3
    streamed = [(loc, row) for c in src.chunks for loc, row in src.stream(c, c.start + 1)]
    assert [loc.row for loc, _ in streamed] == [1, 2, 3, 4, 6, 7, 8, 9, 11]
    for loc, row in streamed:
        assert row == src.fetch(loc) == rows[loc.row]
        text, media, sid = src.parts(row, loc)
        assert sid == f"llava/{rows[loc.row]['id']}"
        if "image" in row:
            assert media["vision"] == [str(path.parent.resolve() / row["image"])]
        else:
            assert media == {}


def test_large_array_streams_in_bounded_memory(tmp_path):
    """A file much larger than the read block: counted by walking it, one element at a time."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps([{"id": i, "t": "x" * 200} for i in range(30000)]))  # ~6.6 MB
    import tracemalloc
    tracemalloc.start()
    d = json_docs.open_document(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert d.num_rows == 30000 and d.row(29999)["id"] == 29999
    assert peak < 4 * json_docs.BLOCK + 2_000_000, peak  # never the whole file
