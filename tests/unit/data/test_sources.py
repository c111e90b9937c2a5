"""Every format: chunk reads equal HF streaming's rows and random access by locator; chunks
cover all; a chunk read costs its own rows, not the rows before it."""

import pytest

from ds_omni.config import SchemaConfig, SourceConfig
from ds_omni.data.sources import Locator, Source
from ds_omni.errors import DataError
from tests.data_files import FORMATS, conversation_rows, write


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_and_fetch_agree(tmp_path, fmt):
    rows = conversation_rows(23)
    path, schema = write(fmt, rows, tmp_path)
    src = Source(SourceConfig(name="s", path=path, schema=SchemaConfig(**schema)), chunk_rows=5)
    assert len(src) == 23
    covered = sorted((c.file, r) for c in src.chunks for r in range(c.start, c.stop))
    assert covered == sorted({(c.file, r) for c in src.chunks for r in range(c.start, c.stop)})
    assert len(covered) == 23
    ids = []
    for chunk in src.chunks:
        first = chunk.start + 1 if chunk.stop - chunk.start > 1 else chunk.start  # resume mid-chunk
        locs = []
        for loc, row in src.stream(chunk, first):
            locs.append(loc)
            streamed, fetched = src.parts(row, loc), src.parts(src.fetch(loc), loc)
            assert streamed == fetched, (fmt, loc)
            text, media, sid = streamed
            assert text == rows[int(sid.split("/r")[1])]["conversations"]
            assert len(media["vision"]) == 1
            ids.append(sid)
        assert [(l.file, l.row) for l in locs] == [(chunk.file, r) for r in range(first, chunk.stop)]
    assert len(set(ids)) == len(ids)


def _hf_file(src, f):
    """File f as HF streaming reads it (what chunks were read with before)."""
    import datasets
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    ds = datasets.load_from_disk(src.files[0]).to_iterable_dataset() if src.fmt == "disk" else \
        datasets.load_dataset(src.fmt, data_files=[src.files[f]], split="train", streaming=True)
    return ds.decode(False)


@pytest.mark.parametrize("fmt", ["parquet", "json", "arrow", "disk"])
def test_chunk_reads_equal_hf_streaming(tmp_path, monkeypatch, fmt):
    """The same rows as HF streaming's skip/take, for chunks that start mid row group (parquet
    row groups of 4 rows, chunks of 6) and mid jsonl index stride."""
    import pyarrow.parquet as pq
    from ds_omni.data import sources
    rows = conversation_rows(23)
    path, schema = write(fmt, rows, tmp_path)
    if fmt == "parquet":  # small row groups, so chunks start and end inside them
        for f in tmp_path.glob("*.parquet"):
            pq.write_table(pq.read_table(f), f, row_group_size=4)
    src = Source(SourceConfig(name="s", path=path, schema=SchemaConfig(**schema)), chunk_rows=6)
    monkeypatch.setattr(sources, "JSON_INDEX_STRIDE", 4)
    hf = {f: _hf_file(src, f) for f in range(len(src.files))}
    for chunk in src.chunks:
        for first in sorted({chunk.start + 1, chunk.stop - 1, chunk.stop}):
            ours = [row for _, row in src.stream(chunk, first)]
            theirs = list(hf[chunk.file].skip(first).take(chunk.stop - first))
            assert ours == theirs, (fmt, chunk, first)


def test_parquet_chunk_decodes_only_its_row_groups(tmp_path, monkeypatch):
    """A chunk at the end of a many-row-group file decodes its own row groups, not the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(1000)]}), tmp_path / "a.parquet",
                   row_group_size=100)
    src = Source(SourceConfig(name="s", path=str(tmp_path / "a.parquet"),
                              schema=SchemaConfig(text="text", image=None)), chunk_rows=150)
    decoded = []
    real = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda self, **kw: (
        decoded.append(b.num_rows) or b for b in real(self, **kw)))
    last = src.chunks[-1]  # rows 900..999
    assert [r["text"] for _, r in src.stream(last, 950)] == [f"row {i}" for i in range(950, 1000)]
    assert sum(decoded) == 100
    decoded.clear()
    assert [r["text"] for _, r in src.stream(src.chunks[3], 460)] == \
        [f"row {i}" for i in range(460, 600)]
    assert sum(decoded) == 200  # row groups 400..499 and 500..599


def test_images_decode_from_every_stored_form(tmp_path):
    from ds_omni.data.media import image_size, load_image
    rows = conversation_rows(1)
    png = rows[0]["image"]["bytes"]
    (tmp_path / "a.png").write_bytes(png)
    for form in (png, {"bytes": png, "path": None}, str(tmp_path / "a.png"),
                 {"bytes": None, "path": str(tmp_path / "a.png")}):
        assert load_image(form).size == (32, 32) and image_size(form) == (32, 32)
    with pytest.raises(DataError, match="does not exist"):
        load_image(str(tmp_path / "missing.png"))
    with pytest.raises(DataError, match="unreadable image"):
        load_image(b"not a png at all")


def test_missing_path_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match="no data at"):
        Source(SourceConfig(name="x", path=str(tmp_path / "nothing")))
    (tmp_path / "a.csv").write_text("a,b\n1,2\n")
    (tmp_path / "b.parquet").write_text("")
    with pytest.raises(DataError, match="cannot infer one format"):
        Source(SourceConfig(name="x", path=str(tmp_path / "*")))
    with pytest.raises(DataError, match="cannot read .*b.parquet' as parquet"):
        len(Source(SourceConfig(name="x", path=str(tmp_path / "b.parquet"))))


def test_locator_round_trip():
    loc = Locator("my:source", 3, 41)
    assert Locator.parse(str(loc)) == loc
