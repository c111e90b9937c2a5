"""LLaVA-OneVision videos through the generic adapter (`families/hf_video.py`): a tiny model saved
and loaded through `build_model`, one packed row (a video, an image, text only) against HF's own
forward with `pixel_values_videos`; the frames' pixels against numpy; the token count HF's
processor writes; the cost model's view of a video; the errors of settings it does not repeat."""

import json

import numpy as np
import pytest
import torch

from ds_omni.config import ModelConfig, VideoConfig
from ds_omni.errors import ConfigError, ModelError
from ds_omni.model.build import build_model
from ds_omni.model.families import hf_processor
from tests.data_files import write_video
from tests.family_checks import (VIDEO_MARKERS, assert_logits_match,
                                 assert_loss_and_grads_match, processor_for)
from tests.family_dirs import make_generic_dir

SIGLIP = {"size": {"height": 32, "width": 32}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
"""The video processor saved with the model: the tower's 32x32 and SigLIP's mean and std (not
the class's CLIP ones, so reading the saved file is what makes the pixels right)."""


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory):
    out = make_generic_dir(tmp_path_factory.mktemp("ov"), "llava_onevision")
    (out / "video_preprocessor_config.json").write_text(json.dumps(SIGLIP))
    return out


@pytest.fixture(scope="module")
def built(ov_dir):
    return build_model(ModelConfig(pretrained=str(ov_dir)))


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """An mp4 of 12 frames at 4 fps (40x24: resized), and a lossless mkv of 3 frames at 2 fps
    (32x32: the tower's size, so its pixels are the written ones)."""
    out = tmp_path_factory.mktemp("videos")
    return {"mp4": str(write_video(out / "a.mp4", 12, 40, 24, fps=4, seed=1)),
            "mkv": str(write_video(out / "b.mkv", 3, 32, 32, fps=2, seed=2, codec="ffv1"))}


def _processor(built):
    return processor_for(built, markers=VIDEO_MARKERS)


def _rows(videos):
    from PIL import Image
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 56, 3), np.uint8))
    return {"video": ("<video>what moves here?", {"video": [videos["mp4"]]}),
            "image": ("<image>a picture of noise", {"vision": [image]}),
            "text": ("a caption with no video at all", {}),
            "still": ("<video>and here?", {"video": [videos["mkv"]]})}


class _GivenVideos:
    """Stands in for HF's (torchvision) video processor inside HF's processor: hands back the
    pixels given, so the text expansion is HF's processor's own."""

    def __init__(self, pixels):
        self.pixels = pixels

    def __call__(self, videos=None, **kwargs):
        from transformers import BatchFeature
        return BatchFeature({"pixel_values_videos": self.pixels})


def _hf_inputs(ov_dir, built, rows):
    """Per sample, the inputs HF's own processor makes (its `<video>` expansion included); a
    video's pixels are ds_omni's (HF's video processor needs torchvision; checked apart)."""
    proc = hf_processor.load_hf_processor("llava_onevision", ov_dir, built.tokenizer)
    video = built.item_processors["video"]

    def inputs(sample):
        text, media = rows[sample.sample_id]
        kwargs = {}
        if media.get("vision"):
            kwargs["images"] = media["vision"]
        if media.get("video"):
            pixels = video.process(media["video"][0]).inputs["pixel_values_videos"]
            proc.video_processor = _GivenVideos(pixels)
            kwargs["videos"] = [np.zeros((1, 2, 2, 3), np.uint8)]  # replaced by the stand-in
        tok = built.tokenizer  # (ds_omni writes a plain-text sample as bos + text + eos)
        out = proc(text=[tok.bos_token + text + tok.eos_token], return_tensors="pt", **kwargs)
        assert out["input_ids"][0].tolist() == sample.input_ids.tolist(), sample.sample_id
        return {k: v for k, v in out.items() if k != "attention_mask"}
    return inputs


def test_a_packed_video_image_and_text_row_matches_hfs_forward(built, ov_dir, videos):
    from transformers import LlavaOnevisionForConditionalGeneration
    rows = _rows(videos)
    samples = [_processor(built)(text=t, media=m, sample_id=k, source="t")
               for k, (t, m) in rows.items()]
    frames = {s.sample_id: [it.meta.get("frames") for _, it in s.items] for s in samples}
    # 3 s at 2 fps: 6 frames; the 1.5 s still: 3 -> int(1.5 x 2) = 3
    assert frames["video"] == [6] and frames["still"] == [3]
    # HF's count: 6 frames x 2x2 pooled patches (4x4 patches of 8 pixels) + one newline row
    assert samples[0].items[0][1].num_embeddings == 6 * 4 + 1
    reference = LlavaOnevisionForConditionalGeneration.from_pretrained(str(ov_dir)).eval()
    inputs = _hf_inputs(ov_dir, built, rows)
    assert_logits_match(built, reference, samples, inputs)
    assert_loss_and_grads_match(built, reference, samples, inputs)


def test_frames_are_the_files_pixels_normalized_as_the_saved_video_processor_says(built, videos):
    item = built.item_processors["video"].with_options(VideoConfig(num_frames=2)).process(
        videos["mkv"])
    written = np.random.default_rng(2).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    kept = written[[0, 1]]  # HF's sampler: arange(2) * 3 // 2
    expected = (kept.astype(np.float32) / 255 - 0.5) / 0.5  # [n, H, W, C]
    got = item.inputs["pixel_values_videos"]  # [1, n, C, H, W]
    assert got.shape == (1, 2, 3, 32, 32)
    np.testing.assert_allclose(got[0].permute(0, 2, 3, 1).numpy(), expected, rtol=0, atol=1e-6)


def test_the_cost_model_counts_a_videos_tokens_and_tower_passes(built, videos):
    rows = _rows(videos)
    size = _processor(built).measure(text=rows["video"][0], media=rows["video"][1],
                                     sample_id="video", source="t")
    sample = _processor(built)(text=rows["video"][0], media=rows["video"][1],
                               sample_id="video", source="t")
    assert size.tokens == sample.length  # measured from the header, no frame decoded
    assert size.encoder_seqs == (("vision", 16),) * 6  # the tower runs 4x4 patches per frame


def test_settings_it_does_not_repeat_are_clear_errors(ov_dir, built, tmp_path):
    with pytest.raises(ConfigError, match="remove them"):
        built.item_processors["video"].with_options(VideoConfig(max_pixels=4096))
    from ds_omni.model.families.hf_video import frame_settings
    vc = built.hf_config.vision_config
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        SIGLIP | {"size": {"height": 64, "width": 64}}))
    with pytest.raises(ModelError, match='tower takes 32x32.*"height": 32'):
        frame_settings("llava_onevision", tmp_path, vc)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        SIGLIP | {"do_center_crop": True}))
    with pytest.raises(ModelError, match="do_center_crop"):
        frame_settings("llava_onevision", tmp_path, vc)
