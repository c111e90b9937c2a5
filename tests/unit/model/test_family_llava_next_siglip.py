"""LLaVA-NeXT on a SigLIP tower: no CLS state, so no extra placeholder per image, and SigLIP's
pixel normalisation in the processor ds_omni builds or exports."""

import shutil

import pytest
import torch

from tests.family_checks import assert_logits_match, load_omni
from tests.family_dirs import make_llava_next_siglip_dir
from tests.unit.model.test_family_llava_next import _hf_inputs, _images, _samples

SIGLIP_NORM = [0.5] * 3


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    return make_llava_next_siglip_dir(tmp_path_factory.mktemp("llava_next_siglip"))


@pytest.fixture(scope="module")
def built(siglip_dir):
    return load_omni(siglip_dir)


def _hf_count(hf_proc, image) -> int:
    image_id = hf_proc.tokenizer.convert_tokens_to_ids("<image>")
    ids = hf_proc(images=[image], text="<image>", return_tensors="pt")["input_ids"][0]
    return int((ids == image_id).sum())


def test_placeholders_per_image_match_the_users_processor(built, siglip_dir):
    from transformers import AutoProcessor
    hf_proc = AutoProcessor.from_pretrained(str(siglip_dir))
    for image in _images():
        assert built.item_processors["vision"].process(image).num_embeddings == _hf_count(hf_proc, image)


def test_pixels_come_from_the_saved_processor(built, siglip_dir):
    """transformers 5 saves the image processor inside processor_config.json; it must be used."""
    from transformers import AutoProcessor
    hf_proc = AutoProcessor.from_pretrained(str(siglip_dir))
    image = _images()[2]
    ours = built.item_processors["vision"].process(image).inputs["pixel_values"]
    assert torch.equal(ours, hf_proc.image_processor(images=[image], return_tensors="pt")["pixel_values"][0])


def test_logits_match_hf(built, siglip_dir):
    from transformers import LlavaNextForConditionalGeneration
    reference = LlavaNextForConditionalGeneration.from_pretrained(str(siglip_dir))
    assert_logits_match(built, reference, _samples(built), _hf_inputs)


def test_processor_for_a_folder_without_one_fits_the_tower(siglip_dir, tmp_path):
    """A folder with weights and tokenizer only: ds_omni builds the processor from the config, and
    exports it; both normalise as SigLIP does and count the model's own embeddings."""
    from transformers import AutoProcessor
    from ds_omni.model.convert import export_hf
    bare = tmp_path / "bare"
    shutil.copytree(siglip_dir, bare)
    (bare / "processor_config.json").unlink()
    built = load_omni(bare)
    export_hf(built.model, tmp_path / "export", built.tokenizer, model_dir=built.model_dir)
    exported = AutoProcessor.from_pretrained(str(tmp_path / "export"))
    assert list(exported.image_processor.image_mean) == SIGLIP_NORM
    assert list(exported.image_processor.image_std) == SIGLIP_NORM
    for image in _images():
        assert _hf_count(exported, image) == built.item_processors["vision"].process(image).num_embeddings
