"""Row indexes built once per file version and shared (`ds_omni/data/index.py`): reused by a
second reader and a second process, rebuilt (never trusted) when the data file changed, the
index is cut short, corrupt (garbage bytes, offsets out of order or past the file's end, in
every layout) or of another version; two racing processes build it once; rows equal those of a
reader without an index; the start-up check and the loader share one build. Planted errors: an
index check that ignores mtime_ns must fail the stale test, one that trusts any offsets the
spoiled one."""

import fcntl
import json
import logging
import multiprocessing as mp
import os
import tarfile
import time

import pytest

from ds_omni.config import SchemaConfig, SourceConfig
from ds_omni.config.loader import from_dict
from ds_omni.config.omni import OmniConfig
from ds_omni.data import index, sources
from ds_omni.data.check import startup_check
from ds_omni.data.sources import JsonRows, Source, TarRows
from ds_omni.errors import DataError
from tests.data_layouts import write_llava_json, write_webdataset
from tests.fixtures import tiny_config_dict


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """Index every file (the tests' files are small), into a folder of this test's own."""
    monkeypatch.setenv("DS_OMNI_INDEX_DIR", str(tmp_path / "index"))
    monkeypatch.setattr(index, "MIN_INDEXED_BYTES", 0)
    index.clear_memo()
    index.BUILDS.clear()
    index.LOADS.clear()
    yield tmp_path
    index.clear_memo()


def _files(tmp_path) -> dict:
    """(path, reader, the rows read without any index) per layout."""
    array, rows = write_llava_json(tmp_path / "array", n=600)
    obj, _ = write_llava_json(tmp_path / "object", n=300, key="data")
    lines = tmp_path / "rows.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n\n" for r in rows))
    tar = write_webdataset(tmp_path / "wds", n=9)
    return {"array": (array, JsonRows, rows),
            "object": (obj, lambda p: JsonRows(p, "data"), json.loads(obj.read_text())["data"]),
            "jsonl": (lines, JsonRows, rows),
            "tar": (tar, TarRows, list(_tar_rows_unindexed(tar)))}


def _tar_rows_unindexed(path):
    """The samples of a tar read straight through `tarfile` (no index), as TarRows gives them."""
    with tarfile.open(path) as tf:
        out = {}
        for m in tf:
            key, ext = m.name.split(".", 1)
            value = sources._tar_value(ext, tf.extractfile(m).read(), m.name)
            out.setdefault(key, {"__key__": key, "__url__": str(path)})[ext] = value
        yield from out.values()


def _kind(name: str) -> str:
    return "tar" if name == "tar" else "json"


@pytest.mark.parametrize("layout", ["array", "object", "jsonl", "tar"])
def test_built_once_reused_and_rows_identical(shared, layout):
    path, reader, expected = _files(shared)[layout]
    first = reader(str(path))
    again = reader(str(path))  # the same process: the memo
    assert index.BUILDS[_kind(layout)] == 1 and index.LOADS[_kind(layout)] == 0
    index.clear_memo()  # as another process would start: from the index file
    other = reader(str(path))
    assert index.BUILDS[_kind(layout)] == 1 and index.LOADS[_kind(layout)] == 1
    for r in (first, again, other):
        assert r.num_rows == len(expected)
        assert list(r.rows(0, r.num_rows)) == expected
        assert [r.row(i) for i in (0, 257, len(expected) - 1) if i < len(expected)] == \
            [expected[i] for i in (0, 257, len(expected) - 1) if i < len(expected)]
    files = list((shared / "index").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["path"] == str(path.resolve())


def _rewrite_same_size(path) -> list[dict]:
    """Replace a JSON array by one with other rows (more of them) of exactly the same size, and
    move its mtime on by one second: only mtime_ns tells the versions apart."""
    old = path.read_bytes()
    rows = [{"id": f"n{i}", "conversations": []} for i in range(len(json.loads(old)) + 40)]
    body = json.dumps(rows).encode()
    assert len(body) < len(old)
    path.write_bytes(body[:-1] + b" " * (len(old) - len(body)) + b"]")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert os.stat(path).st_size == len(old)
    return rows


def _check_stale_rebuilt(tmp_path) -> None:
    path, _ = write_llava_json(tmp_path / "stale", n=300)
    assert JsonRows(str(path)).num_rows == 300
    rows = _rewrite_same_size(path)
    index.clear_memo()
    fresh = JsonRows(str(path))
    assert fresh.num_rows == len(rows) and list(fresh.rows(0, fresh.num_rows)) == rows
    assert index.BUILDS["json"] == 2
    with path.open("a") as f:  # a size change, same second
        f.write("\n")
    index.clear_memo()
    assert JsonRows(str(path)).num_rows == len(rows) and index.BUILDS["json"] == 3


def test_stale_index_is_rebuilt(shared, caplog):
    with caplog.at_level(logging.INFO, "ds_omni.data.index"):
        _check_stale_rebuilt(shared)
    assert "the data file changed since" in caplog.text


def test_plant_index_ignoring_mtime_fails_the_stale_test(shared, monkeypatch):
    monkeypatch.setattr(index, "_fresh", lambda doc, stat: doc.get("size") == stat.size)
    with pytest.raises(AssertionError):
        _check_stale_rebuilt(shared)


@pytest.mark.parametrize("spoil, why", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),
    (lambda text: "\x00garbage", "not valid JSON"),
    (lambda text: json.dumps({**json.loads(text), "version": 0}), "index version 0"),
    (lambda text: json.dumps({**json.loads(text), "format": "other"}), "not a ds_omni index"),
    (lambda text: json.dumps({**json.loads(text), "index": {**json.loads(text)["index"],
                                                            "offsets": [0]}}), "malformed"),
])
def test_bad_index_is_rebuilt_saying_why(shared, caplog, spoil, why):
    path, rows = write_llava_json(shared / "d", n=600)
    JsonRows(str(path))
    (target,) = (shared / "index").glob("*.json")
    target.write_text(spoil(target.read_text()))
    index.clear_memo()
    with caplog.at_level(logging.INFO, "ds_omni.data.index"):
        again = JsonRows(str(path))
    assert index.BUILDS["json"] == 2 and list(again.rows(0, 600)) == rows
    said = [r.message for r in caplog.records if "rebuilding the index" in r.message]
    assert len(said) == 1 and why in said[0] and str(path.resolve()) in said[0]
    assert json.loads(target.read_text())["version"] == index.INDEX_VERSION  # written anew


def _spoil_index(index_doc: dict, **changes) -> str:
    return json.dumps({**index_doc, "index": {**index_doc["index"], **changes}})


def _swapped(offsets: list) -> list:
    return [offsets[1], offsets[0], *offsets[2:]]


@pytest.mark.parametrize("layout, spoil, why", [
    ("array", lambda b: b"\xff\xfe" + b[5:], "cannot be read"),  # not UTF-8
    ("array", lambda b: b"", "not valid JSON"),  # written by a writer that died (no os.replace)
    ("array", lambda b: json.dumps({**json.loads(b), "version": index.INDEX_VERSION + 1}).encode(),
     f"index version {index.INDEX_VERSION + 1}"),  # a newer ds_omni's
    ("array", lambda b: _spoil_index(json.loads(b), offsets=_swapped(
        json.loads(b)["index"]["offsets"])).encode(), "out of order"),
    ("jsonl", lambda b: _spoil_index(json.loads(b), offsets=[
        *json.loads(b)["index"]["offsets"][:-1], 10 ** 9]).encode(), "past the file's end"),
    ("tar", lambda b: b[: len(b) // 3], "not valid JSON"),
    ("tar", lambda b: _spoil_index(json.loads(b), samples=[
        *json.loads(b)["index"]["samples"][:-1],
        [json.loads(b)["index"]["samples"][-1][0], [["x.txt", 10 ** 9, 5]]]]).encode(),
     "past the file's end"),
])
def test_a_spoiled_index_of_any_layout_is_rebuilt(shared, caplog, layout, spoil, why):
    """Garbage bytes, an empty file, a newer version, offsets swapped or past the end (JSON
    lines, a JSON array, a tar's members): rebuilt, one log line saying why, rows unchanged."""
    path, reader, rows = _files(shared)[layout]
    reader(str(path))
    (target,) = [t for t in (shared / "index").glob("*.json") if t.name.startswith(path.name)]
    target.write_bytes(spoil(target.read_bytes()))
    index.clear_memo()
    with caplog.at_level(logging.INFO, "ds_omni.data.index"):
        again = reader(str(path))
    assert index.BUILDS[_kind(layout)] == 2 and list(again.rows(0, len(rows))) == rows
    said = [r.message for r in caplog.records if "rebuilding the index" in r.message]
    assert len(said) == 1 and why in said[0] and str(path.resolve()) in said[0], said


def test_plant_index_trusting_any_offsets_fails_the_spoiled_test(shared, caplog, monkeypatch):
    """Without the order and range checks a swapped offset is trusted: rows go wrong or missing."""
    monkeypatch.setattr(index, "ascending", lambda offsets, size: True)
    with pytest.raises(AssertionError):  # no rebuild (BUILDS stays 1)
        test_a_spoiled_index_of_any_layout_is_rebuilt(
            shared, caplog, "array", lambda b: _spoil_index(json.loads(b), offsets=_swapped(
                json.loads(b)["index"]["offsets"])).encode(), "out of order")


def _slow_build(path, builds_log, start_at):
    """One racing process: build through a builder that logs and sleeps."""
    real = sources._json_index

    def slow(*args):
        with open(builds_log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)
        return real(*args)
    sources._json_index = slow
    index.clear_memo()
    time.sleep(max(0.0, start_at - time.time()))
    r = JsonRows(path)
    return [r.num_rows, r.offsets, r.row(r.num_rows - 1)]


def test_two_processes_racing_build_once(shared):
    path, rows = write_llava_json(shared / "race", n=600)
    builds_log = shared / "builds.log"
    with mp.get_context("fork").Pool(2) as pool:
        start_at = time.time() + 0.2
        results = pool.starmap(_slow_build, [(str(path), str(builds_log), start_at)] * 2)
    assert len(builds_log.read_text().split()) == 1  # one build, the other process waited
    assert results[0] == results[1] and results[0][0] == 600 and results[0][2] == rows[-1]


def test_a_dead_builder_is_taken_over(shared):
    path, rows = write_llava_json(shared / "dead", n=300)
    target = index.index_path(index.FileStat.of(str(path)), "json",
                              {"key": None, "row_hint": None})
    target.parent.mkdir(parents=True)
    child = os.fork()
    if child == 0:  # takes the lock, then dies without writing the index
        with open(str(target) + ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            time.sleep(0.3)
            os._exit(0)
    time.sleep(0.1)
    r = JsonRows(str(path))
    os.waitpid(child, 0)
    assert r.num_rows == 300 and index.BUILDS["json"] == 1 and target.is_file()


def test_a_stuck_builder_is_an_error_naming_rank_and_file(shared, monkeypatch):
    path, _ = write_llava_json(shared / "stuck", n=30)
    target = index.index_path(index.FileStat.of(str(path)), "json",
                              {"key": None, "row_hint": None})
    target.parent.mkdir(parents=True)
    monkeypatch.setattr(index, "LOCK_TIMEOUT_S", 0.2)
    monkeypatch.setenv("RANK", "3")
    with open(str(target) + ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("rank 0 (host n1, pid 42)\n")
        held.flush()
        with pytest.raises(DataError, match=r"^rank 3: waited 0 s for the index of '.*stuck/"
                           r"llava.json', which rank 0 \(host n1, pid 42\) is building"):
            JsonRows(str(path))


def test_unwritable_index_dir_indexes_in_memory(shared, monkeypatch, caplog):
    (shared / "a_file").write_text("")
    monkeypatch.setenv("DS_OMNI_INDEX_DIR", str(shared / "a_file" / "index"))
    path, rows = write_llava_json(shared / "ro", n=40)
    with caplog.at_level(logging.WARNING, "ds_omni.data.index"):
        r = JsonRows(str(path))
    assert list(r.rows(0, 40)) == rows and index.BUILDS["json"] == 1
    assert "cannot be written" in caplog.text and "DS_OMNI_INDEX_DIR" in caplog.text


def test_small_files_are_scanned_by_each_reader(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_OMNI_INDEX_DIR", str(tmp_path / "index"))
    index.BUILDS.clear()
    path, rows = write_llava_json(tmp_path / "small", n=20)
    assert path.stat().st_size < index.MIN_INDEXED_BYTES
    assert [JsonRows(str(path)).num_rows for _ in range(2)] == [20, 20]
    assert index.BUILDS["json"] == 2 and not (tmp_path / "index").exists()


def test_start_up_check_and_loader_share_one_build(shared):
    path, _ = write_llava_json(shared / "llava", n=600)
    cfg_dict = tiny_config_dict(str(shared / "out"))
    cfg_dict["data"] = {"sources": [{"name": "llava", "path": str(path)}], "max_seq_len": 128}
    cfg = from_dict(OmniConfig, cfg_dict)
    startup_check(cfg)
    source = Source(SourceConfig(name="llava", path=str(path), schema=SchemaConfig()))
    assert len(source) == 600 and index.BUILDS["json"] == 1
