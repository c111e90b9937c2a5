"""LLaVA-NeXT: any-resolution tiling gives each image its own number of embeddings."""

import pytest
import torch

from tests.family_checks import (assert_logits_match, assert_loss_and_grads_match,
                                 assert_round_trip, load_omni, processor_for)
from tests.family_dirs import make_llava_next_dir

SIZES = [(32, 32), (64, 32), (40, 56)]  # (width, height) of the test images


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return make_llava_next_dir(tmp_path_factory.mktemp("llava_next"))

@pytest.fixture(scope="module")
def built(next_dir):
    return load_omni(next_dir)


@pytest.fixture(scope="module")
def reference(next_dir):
    from transformers import LlavaNextForConditionalGeneration
    return LlavaNextForConditionalGeneration.from_pretrained(str(next_dir))


def _images():
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    return [Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy())
            for w, h in SIZES]


def _samples(built):
    proc, img = processor_for(built), _images()
    return [
        proc(text=[{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "a wide one"}],
             media={"vision": [img[1]]}, sample_id="wide", source="t"),
        proc(text="text only", media={}, sample_id="text", source="t"),
        proc(text=[{"from": "human", "value": "<image> and <image>"}, {"from": "gpt", "value": "two"}],
             media={"vision": [img[0], img[2]]}, sample_id="two", source="t"),
    ]


def _hf_inputs(sample):
    """What LlavaNextProcessor gives: tiles padded to the most tiles of the batch, image sizes."""
    if not sample.items:
        return {"input_ids": sample.input_ids[None]}
    tiles = [item.inputs["pixel_values"] for _, item in sample.items]
    k = max(t.shape[0] for t in tiles)
    padded = torch.stack([torch.cat([t, t.new_zeros(k - t.shape[0], *t.shape[1:])]) for t in tiles])
    sizes = torch.stack([item.inputs["image_sizes"] for _, item in sample.items])
    return {"input_ids": sample.input_ids[None], "pixel_values": padded, "image_sizes": sizes}


def test_images_of_different_sizes_get_different_token_counts(built):
    counts = [built.item_processors["vision"].process(im).num_embeddings for im in _images()]
    assert len(set(counts)) == len(counts)


def test_token_counts_match_the_hf_processor(built, next_dir):
    from transformers import AutoProcessor
    hf_proc = AutoProcessor.from_pretrained(str(next_dir))
    image_id = built.item_processors["vision"].placeholder_id
    for image in _images():
        ids = hf_proc(images=[image], text="<image>", return_tensors="pt")["input_ids"][0]
        assert int((ids == image_id).sum()) == built.item_processors["vision"].process(image).num_embeddings


def test_logits_match_hf(built, reference):
    assert_logits_match(built, reference, _samples(built), _hf_inputs)


def test_loss_and_gradients_match_hf(built, reference):
    assert_loss_and_grads_match(built, reference, _samples(built), _hf_inputs)


def test_export_round_trip_is_exact(built, reference, tmp_path):
    assert_round_trip(built, tmp_path / "export", reference)
