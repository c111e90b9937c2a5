"""Conversations -> tokens, loss mask and encoder items; packing into one row."""

import pytest
import torch

from ds_omni.batch import IGNORE_INDEX
from ds_omni.data.packing import pack, sample_targets
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.sources import Locator, Source
from ds_omni.config import SourceConfig
from ds_omni.errors import DataError


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ds_omni.model.build import build_model
    from tests.fixtures import tiny_config
    return build_model(tiny_config(str(tmp_path_factory.mktemp("m"))).model)


@pytest.fixture(scope="module")
def source():
    return Source(SourceConfig(name="shapes", path="builtin:shapes"))


def _processor(built, max_seq_len=128, overlong="error"):
    return SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors, markers={"vision": "<image>"},
                           max_seq_len=max_seq_len, overlong=overlong)


def _read(source, row: int):
    """(text, media, sample id) of row `row` of the first file."""
    loc = Locator(source.name, 0, row)
    return source.parts(source.fetch(loc), loc)


def _image(source):
    return _read(source, 0)[1]["vision"][0]


def test_only_assistant_text_is_trained_on(built, source):
    text, media, sid = _read(source, 0)
    s = _processor(built)(text=text, media=media, sample_id=sid, source="shapes")
    tok = built.tokenizer
    trained = tok.decode(s.input_ids[s.loss_mask])
    assert trained == text[1]["value"] + tok.eos_token
    assert s.input_ids[0] == tok.bos_token_id
    image_id = built.item_processors["vision"].placeholder_id
    assert int((s.input_ids == image_id).sum()) == 16  # (32 / 8) ** 2 patches, CLS dropped
    assert [enc for enc, _ in s.items] == ["vision"]
    assert torch.equal(s.position_ids, torch.arange(s.length))


def test_marker_and_item_counts_must_match(built, source):
    proc, img = _processor(built), _image(source)
    convo = [{"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "x"}]
    with pytest.raises(DataError, match="more <image> markers than vision items"):
        proc(text=convo, media={"vision": [img]}, sample_id="a", source="s")
    convo = [{"from": "human", "value": "no marker"}, {"from": "gpt", "value": "x"}]
    with pytest.raises(DataError, match="1 vision items but 0 markers"):
        proc(text=convo, media={"vision": [img]}, sample_id="b", source="s")


def test_several_images_and_text_only(built, source):
    proc, img = _processor(built), _image(source)
    convo = [{"from": "human", "value": "<image> vs <image>"}, {"from": "gpt", "value": "same"}]
    s = proc(text=convo, media={"vision": [img, img]}, sample_id="two", source="s")
    assert len(s.items) == 2
    t = proc(text="just some text", media={}, sample_id="t", source="s")
    assert t.items == [] and t.num_targets == t.length - 1  # plain text: every next token


def test_bad_conversations(built):
    proc = _processor(built)
    with pytest.raises(DataError, match="empty text"):
        proc(text="  ", media={}, sample_id="e", source="s")
    with pytest.raises(DataError, match="bad turn"):
        proc(text=[{"from": "robot", "value": "x"}], media={}, sample_id="r", source="s")
    with pytest.raises(DataError, match="no assistant turn"):
        proc(text=[{"from": "human", "value": "hi"}], media={}, sample_id="h", source="s")


def test_overlong_error_or_truncate(built):
    text = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3
    with pytest.raises(DataError, match=r"more than data.max_seq_len=16; raise max_seq_len"):
        _processor(built, 16)(text=text, media={}, sample_id="long", source="s")
    s = _processor(built, 16, "truncate")(text=text, media={}, sample_id="long", source="s")
    assert s.length == 16


def test_pack_keeps_samples_apart(built, source):
    proc = _processor(built)
    samples = [proc(text=t, media=m, sample_id=i, source="shapes")
               for t, m, i in (_read(source, k) for k in range(3))]
    mb = pack(samples, built.item_processors)
    lengths = [s.length for s in samples]
    assert mb.input_ids.shape == (1, sum(lengths))
    assert mb.cu_seqlens.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert mb.encoder_inputs["vision"]["pixel_values"].shape == (3, 3, 32, 32)
    for k, s in enumerate(samples):
        start, end = mb.cu_seqlens[k], mb.cu_seqlens[k + 1]
        assert torch.equal(mb.position_ids[0, start:end], torch.arange(s.length))
        assert mb.targets[0, end - 1] == IGNORE_INDEX  # last token predicts nothing across samples
        assert torch.equal(mb.targets[0, start:end], sample_targets(s))
    assert mb.num_targets == sum(s.num_targets for s in samples)
    # each target is the next token of the same sample
    t = mb.targets[0]
    keep = (t != IGNORE_INDEX).nonzero().flatten()
    assert torch.equal(t[keep], mb.input_ids[0, keep + 1])
