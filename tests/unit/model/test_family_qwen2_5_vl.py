"""Qwen2.5-VL (windowed ViT, video time axis in seconds): OmniModel parity with HF on images and
videos in one packed micro-batch (logits, M-RoPE positions with second_per_grid_ts, loss and
gradients), and an exact round trip."""

import pytest
import torch

from tests.family_checks import (assert_logits_match, assert_loss_and_grads_match,
                                 assert_round_trip, load_omni)
from tests.family_dirs import make_qwen2_5_vl_dir
from tests.unit.model.test_family_qwen2_vl import (_hf_video_inputs, _video_samples, hf_processor,
                                             videos)  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2_5_vl_dir(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def built(model_dir):
    return load_omni(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir))


def test_images_and_videos_match_hf(built, reference, model_dir, videos):  # noqa: F811
    assert built.family.name == "qwen2_5_vl"
    samples, media = _video_samples(built, videos)
    base = _hf_video_inputs(hf_processor(model_dir), media, samples)
    video_id = built.hf_config.video_token_id

    def inputs(sample):  # HF's processor adds the seconds per temporal patch of each video
        out = base(sample)
        seconds = [it.meta["seconds_per_grid"] for _, it in sample.items
                   if it.meta["placeholder_id"] == video_id]
        if seconds:
            out["second_per_grid_ts"] = torch.tensor(seconds)
        return out
    # 6 of 12 frames at 4 fps: 2 fps, 1 s per temporal patch, 4 time steps per second
    assert samples[0].items[0][1].meta["time_interval"] == 4.0
    for sample in samples:
        hf = inputs(sample)
        expected, _ = reference.model.get_rope_index(
            hf["input_ids"], hf["mm_token_type_ids"], image_grid_thw=hf.get("image_grid_thw"),
            video_grid_thw=hf.get("video_grid_thw"), second_per_grid_ts=hf.get("second_per_grid_ts"))
        assert torch.equal(sample.position_ids, expected[:, 0]), sample.sample_id
    video = samples[0].input_ids == video_id
    times = samples[0].position_ids[0][video].unique()
    assert (times - times[0]).tolist() == [0, 4, 8]  # three temporal patches, 1 s apart
    assert_logits_match(built, reference, samples, inputs)
    assert_loss_and_grads_match(built, reference, samples, inputs)


def test_round_trip_is_exact_and_every_parameter_registered_once(built, reference, tmp_path):
    model = built.model
    assert model.encoders["vision"].attention_heads() is None  # no encoder-SP pieces (windows)
    assert set(model.hf_key_map()) == set(model.hf_model.state_dict())
    assert (sum(p.numel() for p in model.parameters())
            == sum(p.numel() for p in model.hf_model.parameters()))
    assert_round_trip(built, tmp_path / "export", reference)
