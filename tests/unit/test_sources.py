"""Every format: HF streaming and random access by locator give the same rows; chunks cover all."""

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
