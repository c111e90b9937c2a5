"""Mistakes users make, each failing with a message that names the cause; no silent mistraining,
no hang; skipped samples visible; image aspect handling."""

import json

import pytest

from ds_omni.config import DataConfig, ReorderConfig, SchemaConfig, SourceConfig
from ds_omni.data.build import cost_model_for
from ds_omni.data.loader import OmniLoader
from ds_omni.data.media import square_image
from ds_omni.data.problems import SampleError
from ds_omni.data.rank_place import RankPlace
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.skipped import flush_skipped, skipped_totals
from ds_omni.data.sources import Locator, Source
from ds_omni.errors import DataError
from tests.data_layouts import TEXT_ONLY, png, write_all_bad, write_llava_json, write_webdataset


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ds_omni.model.build import build_model
    from tests.fixtures import tiny_config
    return build_model(tiny_config(str(tmp_path_factory.mktemp("m"))).model)


def _proc(built, **kw):
    return SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors, markers={"vision": "<image>"},
                           max_seq_len=128, **kw)


def _measure(src, proc, row, i=0):
    loc = Locator(src.name, 0, i)
    try:
        text, media, sid = src.parts(row, loc)
        return proc.measure(text=text, media=media, sample_id=sid, source=src.name)
    except DataError as e:
        raise src.explain(e, row) from None


def test_wrong_columns_list_the_columns_that_exist(tmp_path, built):
    path, rows = write_llava_json(tmp_path / "d", n=4)
    src = Source(SourceConfig(name="s", path=str(path), schema=SchemaConfig(text="conversation")))
    with pytest.raises(SampleError, match=r"schema.text='conversation' is not a column of source "
                                          r"'s'; its rows have \['id', 'image', 'conversations'\]"):
        _measure(src, _proc(built), rows[0])
    src = Source(SourceConfig(name="s", path=str(path), schema=SchemaConfig(image="img")))
    with pytest.raises(SampleError, match=r"more <image> markers than vision items \(0\)\. "
                                          r"schema.image='img' is not a column of this row of source 's'; this row has \['id', "
                                          r"'image', 'conversations'\]"):
        _measure(src, _proc(built), rows[0])


def test_webdataset_hint(tmp_path, built):
    path = write_webdataset(tmp_path / "wds")
    src = Source(SourceConfig(name="w", path=str(path), schema=SchemaConfig(
        text="json.conversations", image="image", id="__key__")))
    with pytest.raises(SampleError, match=r"this row has \['__key__', '__url__', 'json', "
                                          r"'json.id', 'json.conversations', 'jpg'\].*'jpg' or 'png'"
                                          r".*'__key__'"):
        _measure(src, _proc(built), src.fetch(Locator("w", 0, 0)))
    # the right schema: image and text-only samples of one tar both measure
    src = Source(SourceConfig(name="w", path=str(path), schema=SchemaConfig(
        text="json.conversations", image="jpg", id="__key__")))
    assert [_measure(src, _proc(built), src.fetch(Locator("w", 0, i)), i).encoder_seqs != ()
            for i in range(4)] == [True, False, True, False]


def test_missing_relative_file_names_the_root(tmp_path, built):
    path, rows = write_llava_json(tmp_path / "d", n=2, text_only_every=0)
    (tmp_path / "d" / rows[0]["image"]).unlink()
    src = Source(SourceConfig(name="s", path=str(path)))
    with pytest.raises(SampleError, match=r"media file 'images/r0.png' not found: resolved against "
                                          r".*/d' \(the folder of the data file, as schema.root is "
                                          r"not set\).*set data.sources\[s\].schema.root"):
        src.parts(rows[0], Locator("s", 0, 0))
    src = Source(SourceConfig(name="s", path=str(path), schema=SchemaConfig(root=str(tmp_path))))
    with pytest.raises(SampleError, match=r"\(schema.root='.*'\)"):
        src.parts(rows[1], Locator("s", 0, 1))


def test_conversation_strings(tmp_path, built):
    as_list = _proc(built)(text=TEXT_ONLY, media={}, sample_id="a", source="s")
    parsed = _proc(built)(text=json.dumps(TEXT_ONLY), media={}, sample_id="a", source="s")
    assert parsed.input_ids.tolist() == as_list.input_ids.tolist()
    assert parsed.loss_mask.tolist() == as_list.loss_mask.tolist()
    assert not all(parsed.loss_mask[1:])  # the prompt is not a target
    with pytest.raises(SampleError, match="string holding a JSON conversation") as e:
        _proc(built, conversation_strings="error")(text=json.dumps(TEXT_ONLY), media={},
                                                   sample_id="a", source="s")
    assert e.value.kind == "conversation_string"
    plain = _proc(built, conversation_strings="text")(text=json.dumps(TEXT_ONLY), media={},
                                                      sample_id="a", source="s")
    assert all(plain.loss_mask[1:])


def _loader(built, sources, **kw):
    cfg = DataConfig(sources=sources, max_seq_len=128, chunk_rows=4,
                     reorder=ReorderConfig(mode="loader_order"), **kw)
    return OmniLoader([Source(s, cfg.chunk_rows) for s in cfg.sources],
                      {s.name: _proc(built) for s in cfg.sources}, cost_model_for(built, []), cfg,
                      global_batch_size=4, place=RankPlace(num_micro=2))


def test_all_bad_source_is_an_error_not_a_hang(tmp_path, built):
    bad = SourceConfig(name="bad", path=str(write_all_bad(tmp_path)), on_bad_sample="skip")
    batch = _loader(built, [bad]).next_step()
    assert "data source 'bad' gave 6 bad samples in a row and no good one" in batch.error
    path, _ = write_llava_json(tmp_path / "good", n=8)
    loader = _loader(built, [SourceConfig(name="good", path=str(path)), bad], max_bad_run=3)
    errors = [loader.next_step().error for _ in range(3)]
    assert any(e and "data source 'bad' gave 3 bad samples in a row" in e for e in errors)


def test_skipped_samples_are_logged(tmp_path, built, capsys):
    path, rows = write_llava_json(tmp_path / "d", n=8, text_only_every=0)
    (tmp_path / "d" / rows[1]["image"]).write_bytes(b"corrupt")
    (tmp_path / "d" / rows[2]["image"]).unlink()
    cfg = SourceConfig(name="s", path=str(path), on_bad_sample="skip")
    loader = _loader(built, [cfg])
    batch = loader.next_step()
    assert batch.error is None and len(batch.keys) == 4
    flush_skipped(loader, tmp_path, 0, 0)
    logged = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert {(e["id"], e["kind"]) for e in logged} == {("s/r1", "media_unreadable"),
                                                       ("s/r2", "media_missing")}
    assert all(e["source"] == "s" and e["reason"] for e in logged)
    assert "skipped 2 bad sample(s) (s: 2)" in capsys.readouterr().out
    assert skipped_totals(loader) == {"s": 2}
    # under "error", the message says how to skip instead
    loader = _loader(built, [SourceConfig(name="s", path=str(path))])
    assert 'set data.sources[s].on_bad_sample to "skip"' in loader.next_step().error


def test_image_aspect(built):
    from PIL import Image
    wide = Image.new("RGB", (40, 8), (255, 0, 0))
    wide.paste((0, 255, 0), (0, 0, 4, 8))
    padded = square_image(wide, "pad", (10, 20, 30))
    assert padded.size == (40, 40)
    assert padded.getpixel((0, 0)) == (10, 20, 30) and padded.getpixel((20, 20)) == (255, 0, 0)
    assert padded.getpixel((1, 20)) == (0, 255, 0)
    assert square_image(wide, "resize", (0, 0, 0)).size == (18, 18)
    assert square_image(Image.new("RGB", (9, 9)), "pad", (0, 0, 0)).size == (9, 9)
    text = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Red."}]
    out = {aspect: _proc(built, image_aspect=aspect)(text=text, media={"vision": [wide]},
                                                     sample_id="a", source="s")
           for aspect in ("crop", "pad", "resize")}
    pixels = {a: s.items[0][1].inputs["pixel_values"] for a, s in out.items()}  # [3, S, S]
    # crop keeps only red; pad puts the mean colour (0 after normalising) above and below
    crop, pad = pixels["crop"], pixels["pad"]
    assert (crop[:, 0] - crop[:, 16]).abs().max() < 1e-4 and pad[:, 0].abs().max() < 0.02
    assert pixels["pad"][:, 16].abs().max() > 0.5  # the image's middle row is still red
    # the image's left end (green): lost by the crop, kept by pad and resize
    green = {a: float(p[1, 16, 0] - p[0, 16, 0]) for a, p in pixels.items()}
    assert green["crop"] < 0 < green["pad"] and green["resize"] > 0
