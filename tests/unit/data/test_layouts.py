"""Rows in the HF ecosystem's layouts, written by `datasets`: chat messages with typed content
parts render to `apply_chat_template`'s tokens on the same messages with the assistant turns
trained; images come from the `images` column in order or inline in the part; bad rows name the
row and the fix, and are skipped under on_bad_sample "skip"."""

import base64
import json

import pytest

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.config import SchemaConfig, SourceConfig
from ds_omni.data.media import image_size
from ds_omni.data.problems import SampleError
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.sources import Locator, Source
from ds_omni.data.templates import resolve_template
from ds_omni.model.family import Family
from tests.chat_templates import make_tokenizer
from tests.hf_layouts import ANSWERS, image_bytes, part_rows, write_parquet


class _Image(ItemProcessor):
    """Qwen2-VL's wrapped image, one placeholder per 8 pixels of width (so order shows)."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.convert_tokens_to_ids(
            ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])

    def process(self, item):
        return EncodedItem(inputs={}, num_embeddings=image_size(item)[0] // 8)

    def tokens(self, item):
        return [self.ids[0]] + [self.ids[1]] * item.num_embeddings + [self.ids[2]]


def _sample(tok, source, i):
    loc = Locator(source.name, 0, i)
    text, media, sid = source.parts(source.fetch(loc), loc)
    proc = SampleProcessor(tokenizer=tok, family=Family(), item_processors={"vision": _Image(tok)},
                           markers={"vision": "<image>"}, max_seq_len=4096,
                           template=resolve_template("auto", tok))
    return proc(text=text, media=media, sample_id=sid, source=source.name)


def _clean(messages):
    """The messages as a user hands them to apply_chat_template (no arrow nulls)."""
    return [{"role": m["role"], "content": [{k: v for k, v in p.items() if v is not None}
                                            for p in m["content"]]} for m in messages]


def _expected(tok, row):
    """HF's ids for the same messages (each image's pad repeated as the processor expands it) and
    the mask of the tokens of the answer and its end-of-turn token."""
    widths = [image_size(im)[0] // 8 for im in row["images"]]
    messages = _clean(row["messages"])
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert tok.apply_chat_template(messages)["input_ids"] == tok(rendered)["input_ids"]
    answer = messages[1]["content"][0]["text"] + "<|im_end|>"
    start = rendered.rindex(answer)
    enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids, mask = [], []
    for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
        n = widths.pop(0) if t == pad else 1
        ids += [t] * n
        mask += [a < start + len(answer) and b > start] * n
    return ids, mask


@pytest.fixture(scope="module", params=["png", "jpeg"])
def parts_source(tmp_path_factory, request):
    path = write_parquet(part_rows(4, jpeg=request.param == "jpeg"), "parts",
                         tmp_path_factory.mktemp("p") / "d.parquet")
    return Source(SourceConfig(name="p", path=str(path)))


def test_typed_parts_render_as_apply_chat_template_with_the_answers_trained(parts_source):
    tok = make_tokenizer("qwen2_vl")
    assert parts_source.layout.name == "messages" and parts_source.layout.detected
    assert (parts_source.layout.text, parts_source.layout.media["vision"]) == ("messages", "images")
    for i in range(4):
        row = parts_source.fetch(Locator("p", 0, i))
        sample = _sample(tok, parts_source, i)
        ids, mask = _expected(tok, row)
        assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == mask
        assert tok.decode(sample.input_ids[sample.loss_mask]) == ANSWERS[i % 3] + "<|im_end|>"
        assert len(sample.items) == len(row["images"])


def test_inline_media_stand_where_their_part_is(tmp_path):
    """A path (relative to the data file), bytes, an HF Image struct and a data URL inline;
    parts without media take the column's images in order."""
    wide, narrow = image_bytes(40), image_bytes(16, "JPEG")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "w.png").write_bytes(wide)
    url = "data:image/png;base64," + base64.b64encode(wide).decode()
    user = [{"type": "image", "image": "img/w.png"}, {"type": "text", "text": "Describe."},
            {"type": "image"}, {"type": "image_url", "image_url": {"url": url}},
            {"type": "image", "image": {"bytes": narrow, "path": None}}]
    row = {"id": "x", "images": [{"bytes": narrow}], "messages": [
        {"role": "user", "content": user}, {"role": "assistant", "content": "Shapes."}]}
    first = {"id": "y", "images": ["img/w.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}]}, row["messages"][1]]}
    (tmp_path / "d.jsonl").write_text((json.dumps(first) + "\n") * 2)
    source = Source(SourceConfig(name="s", path=str(tmp_path / "d.jsonl")))
    text, media, _ = source.parts(row, Locator("s", 0, 0))
    assert text[0]["content"] == "<image>Describe.<image><image><image>"
    assert [image_size(m)[0] for m in media["vision"]] == [40, 16, 40, 16]
    assert media["vision"][0] == str(tmp_path / "img" / "w.png")


BAD = {
    "unknown part": ([{"type": "picture"}, {"type": "text", "text": "Hi?"}], 1,
                     r"sample s/bad: message 0 part 0 has type 'picture'; the part types read are "
                     r"\['text', 'audio', 'image', 'image_url'.*Fix the row", "text"),
    "more parts": ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi?"}], 1,
                   r"message 0 part 1 is image part 2 but the row's 'images' column holds 1 "
                   r"images.*give each image part its media", "markers"),
    "null media": ([{"type": "image"}, {"type": "text", "text": "Hi?"}], None,
                   r"message 0 part 0: image 1 of the row's 'images' column is missing \(null\)",
                   "media_missing"),
    "more images": ([{"type": "text", "text": "Hi?"}], 2,
                    r"the 'images' column holds 2 images but the messages take 0.*add a "
                    r"\{\"type\": \"image\"\} part", "markers"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rows_name_the_row_and_the_fix(tmp_path, case):
    content, images, message, kind = BAD[case]
    images = [None] if images is None else [{"bytes": image_bytes(16), "path": None}] * images
    rows = part_rows(2) + [{"id": "bad", "images": images, "messages": [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]}]}]
    source = Source(SourceConfig(name="s", path=str(write_parquet(rows, "parts",
                                                                  tmp_path / "d.parquet"))))
    source.parts(source.fetch(Locator("s", 0, 0)), Locator("s", 0, 0))
    with pytest.raises(SampleError, match=message) as e:
        source.parts(source.fetch(Locator("s", 0, 2)), Locator("s", 0, 2))
    assert e.value.kind == kind


def test_image_paths_resolve_against_the_data_file_and_a_missing_one_is_named(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(image_bytes(24))
    rows = [{"id": i, "images": [path], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi?"}, {"type": "image"}]},
        {"role": "assistant", "content": "Yes."}]} for i, path in enumerate(["img/a.png", "b.png"])]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = Source(SourceConfig(name="s", path=str(tmp_path / "d.jsonl")))
    text, media, _ = source.parts(rows[0], Locator("s", 0, 0))
    assert media == {"vision": [str(tmp_path / "img" / "a.png")]}
    assert text[0]["content"] == "Hi?<image>"
    with pytest.raises(SampleError, match=r"sample s/1: media file 'b.png' not found.*schema.root"):
        source.parts(rows[1], Locator("s", 0, 1))


def test_bad_rows_are_skipped_and_logged_under_skip(tmp_path):
    from ds_omni.config import DataConfig, ReorderConfig
    from ds_omni.data.build import cost_model_for
    from ds_omni.data.loader import OmniLoader
    from ds_omni.data.rank_place import RankPlace
    from ds_omni.data.skipped import flush_skipped
    from ds_omni.model.build import build_model
    from tests.fixtures import tiny_config
    built = build_model(tiny_config(str(tmp_path / "m")).model)
    rows = part_rows(6)
    rows[1]["messages"][0]["content"][0]["type"] = "picture"
    rows[2]["images"] = rows[2]["images"][:1] if len(rows[2]["images"]) == 2 else []
    path = write_parquet(rows, "parts", tmp_path / "d.parquet")
    cfg = DataConfig(sources=[SourceConfig(name="s", path=str(path), on_bad_sample="skip")],
                     max_seq_len=256, chunk_rows=8, reorder=ReorderConfig(mode="loader_order"))
    proc = SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors, markers={"vision": "<image>"},
                           max_seq_len=256)
    loader = OmniLoader([Source(s, cfg.chunk_rows) for s in cfg.sources], {"s": proc},
                        cost_model_for(built, []), cfg, global_batch_size=4,
                        place=RankPlace(num_micro=2))
    for _ in range(2):  # 8 samples: every row read
        batch = loader.next_step()
        assert batch.error is None and len(batch.keys) == 4
        assert not {"0/s:0:1", "0/s:0:2"} & set(batch.keys)
    flush_skipped(loader, tmp_path, 0, 0)
    logged = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert {(e["id"], e["kind"]) for e in logged} == {("s/m1", "text"), ("s/m2", "markers")}


def test_audio_and_video_parts_stand_where_they_are():
    """`input_audio` base64 data and a video path inline; an audio part takes the `audios`
    column's clip; each item's marker stands where its part does."""
    from ds_omni.data.layouts import Layout, to_turns
    wav = base64.b64encode(b"RIFF-clip").decode()
    messages = [{"role": "user", "content": [
        {"type": "audio"}, {"type": "text", "text": "and"},
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        {"type": "video", "video": "/clips/v.mp4"}, {"type": "video_url",
                                                     "video_url": {"url": "file:///clips/w.mp4"}}]},
        {"role": "assistant", "content": "Two sounds, two clips."}]
    layout = Layout("messages", "messages", {"audio": "audios", "video": "videos"})
    markers = {"vision": "<image>", "audio": "<audio>", "video": "<video>"}
    text, media = to_turns(layout, messages, {"audio": [b"column-clip"]}, markers, "sample x",
                           lambda item: item)
    assert text[0]["content"] == "<audio>and<audio><video><video>"
    assert media == {"audio": [b"column-clip", b"RIFF-clip"],
                     "video": ["/clips/v.mp4", "/clips/w.mp4"]}
    with pytest.raises(SampleError, match="training reads no network; download the files"):
        to_turns(layout, [{"role": "user", "content": [
            {"type": "image", "url": "https://example.com/a.png"}]}], {}, markers, "sample x",
            lambda item: item)
