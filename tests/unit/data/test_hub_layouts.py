"""The Cauldron's turns, a hub dataset snapshot folder read offline, an InternVL meta JSON, and
the layout found when no schema is given (an ambiguous one an error that says what to write)."""

import json
import socket

import pytest

from ds_omni.config import DataConfig, SchemaConfig, SourceConfig
from ds_omni.data.media import image_size
from ds_omni.data.sources import Locator, Source
from ds_omni.errors import ConfigError, DataError
from tests.chat_templates import make_tokenizer
from tests.hf_layouts import (cauldron_rows, part_rows, write_hub_folder, write_internvl_meta,
                              write_parquet)
from tests.unit.data.test_layouts import _sample


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_hub_folder(tmp_path_factory.mktemp("hub") / "shapes")


def test_cauldron_images_go_before_the_first_user_turn(hub):
    tok = make_tokenizer("qwen2_vl")
    source = Source(SourceConfig(name="c", path=str(hub), config="cauldron"))
    assert (source.layout.name, source.layout.text, source.layout.media["vision"]) == \
        ("cauldron", "texts", "images")
    for i in range(2):
        row = source.fetch(Locator("c", 0, i))
        messages = []
        for k, turn in enumerate(row["texts"]):
            user = [{"type": "text", "text": turn["user"]}]
            messages += [{"role": "user", "content": ([{"type": "image"}] if k == 0 else []) + user},
                         {"role": "assistant", "content": turn["assistant"]}]
        width = image_size(row["images"][0])[0] // 8
        expected = tok.apply_chat_template(messages, tokenize=False).replace(
            "<|image_pad|>", "<|image_pad|>" * width)
        sample = _sample(tok, source, i)
        assert sample.input_ids.tolist() == tok(expected, add_special_tokens=False)["input_ids"]
        answers = "".join(t["assistant"] + "<|im_end|>" for t in row["texts"])
        assert tok.decode(sample.input_ids[sample.loss_mask]).replace("\n", "") == answers


def test_hub_snapshot_configs_and_splits_offline(hub, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("the hub snapshot reader reached for the network")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    train = Source(SourceConfig(name="p", path=str(hub)))  # the default config
    assert [f.rsplit("/", 1)[1] for f in train.files] == ["train-00000-of-00002.parquet",
                                                         "train-00001-of-00002.parquet"]
    assert len(train) == 8 and train.layout.name == "messages"
    assert len(Source(SourceConfig(name="t", path=str(hub), split="test"))) == 2
    with pytest.raises(DataError, match=r"config 'parts' of .* has splits \['test', 'train'\], "
                                        r"not 'valid'; set the source's split"):
        Source(SourceConfig(name="p", path=str(hub), split="valid"))
    with pytest.raises(DataError, match=r"'nope' not found. Available: \['parts', 'cauldron'\]; "
                                        r"set the source's config"):
        Source(SourceConfig(name="p", path=str(hub), config="nope"))


def test_internvl_meta_is_a_list_of_weighted_sources(tmp_path):
    meta = write_internvl_meta(tmp_path)
    cfg = DataConfig(internvl_meta=str(meta),
                     sources=[SourceConfig(name="shapes_b", path=str(meta.parent / "shapes_b" /
                                                                     "ann.jsonl"), weight=3)])
    assert {s.name: s.weight for s in cfg.sources} == {"shapes_b": 3, "shapes_a": 6}
    source = Source(cfg.sources[1])
    text, media, _ = source.parts(source.fetch(Locator("shapes_a", 0, 0)), Locator("shapes_a", 0, 0))
    assert source.layout.name == "llava" and media["vision"][0].startswith(str(tmp_path))
    (tmp_path / "bad.json").write_text(json.dumps({"x": {"annotation": "a.jsonl"}}))
    with pytest.raises(ConfigError, match="'length' .* and 'repeat_time' must be numbers"):
        DataConfig(internvl_meta=str(tmp_path / "bad.json"))


def test_layout_found_from_the_rows_and_an_ambiguous_one_says_what_to_write(tmp_path):
    rows = [{"id": "a", "text": "plain words"}, {"id": "b", "text": "more words"}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert Source(SourceConfig(name="t", path=str(tmp_path / "t.jsonl"))).layout.name == "text"
    both = [{**r, "texts": c["texts"]} for r, c in zip(part_rows(2), cauldron_rows(2))]
    for r in both:
        r["images"] = [None]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in both))
    with pytest.raises(DataError, match=r"cannot tell the layout from the first rows: columns "
                                        r"\['messages', 'texts'\].*\"schema\": \{\"layout\": "
                                        r"\"messages\", \"text\": \"messages\"\}"):
        Source(SourceConfig(name="b", path=str(tmp_path / "b.jsonl"))).layout
    chosen = Source(SourceConfig(name="b", path=str(tmp_path / "b.jsonl"),
                                 schema=SchemaConfig(layout="cauldron", text="texts")))
    assert chosen.layout.name == "cauldron" and not chosen.layout.detected
    llava = write_parquet(part_rows(2), "parts", tmp_path / "p.parquet")
    assert Source(SourceConfig(name="p", path=str(llava))).layout.describe() == (
        "layout 'messages' (detected; text='messages', image='images')")


def test_llama_factory_and_sharegpt_rows_take_their_images_column(tmp_path):
    from tests.data_layouts import png
    (tmp_path / "a.png").write_bytes(png(24, 16))
    turns = {"messages": [{"role": "user", "content": "<image>What is it?"},
                          {"role": "assistant", "content": "A square."}],
             "conversations": [{"from": "human", "value": "<image>What is it?"},
                               {"from": "gpt", "value": "A square."}]}
    for column, layout in (("messages", "messages"), ("conversations", "llava")):
        rows = [{column: turns[column], "images": ["a.png"]}] * 2
        (tmp_path / f"{column}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        source = Source(SourceConfig(name="s", path=str(tmp_path / f"{column}.jsonl")))
        assert (source.layout.name, source.layout.media["vision"]) == (layout, "images")
        text, media, _ = source.parts(rows[0], Locator("s", 0, 0))
        assert media == {"vision": [str(tmp_path / "a.png")]}
        assert "<image>What is it?" in json.dumps(text)


def test_bad_cauldron_rows_name_the_row_and_the_fix(tmp_path):
    from ds_omni.data.problems import SampleError
    rows = cauldron_rows(3)
    rows[1]["texts"][0]["assistant"] = None
    rows[2]["images"] = [None]
    source = Source(SourceConfig(name="c", path=str(write_parquet(rows, "cauldron",
                                                                  tmp_path / "c.parquet"))))
    assert source.parts(source.fetch(Locator("c", 0, 0)), Locator("c", 0, 0))[0][0]["content"] \
        .startswith("<image>")
    with pytest.raises(SampleError, match=r"sample c/c:0:1: texts\[0\] is .*The Cauldron's turns "
                                          r"are \{\"user\": str, \"assistant\": str\}") as e:
        source.parts(source.fetch(Locator("c", 0, 1)), Locator("c", 0, 1))
    assert e.value.kind == "text"
    with pytest.raises(SampleError, match=r"sample c/c:0:2: message 0 part 0: image 1 of the "
                                          r"row's 'images' column is missing \(null\)"):
        source.parts(source.fetch(Locator("c", 0, 2)), Locator("c", 0, 2))


def test_hub_snapshot_without_configs_splits_by_file_name(tmp_path):
    rows = part_rows(6)
    write_parquet(rows[:4], "parts", tmp_path / "data" / "train-00000-of-00001.parquet")
    write_parquet(rows[4:], "parts", tmp_path / "data" / "test-00000-of-00001.parquet")
    (tmp_path / "README.md").write_text("# shapes\n")
    assert len(Source(SourceConfig(name="s", path=str(tmp_path)))) == 4
    assert len(Source(SourceConfig(name="s", path=str(tmp_path), split="test"))) == 2
