"""Video inputs, pure parts: frame sampling (HF's rule), decoding with PyAV, the patch layout of
HF's Qwen2-VL video processor, measuring without decoding, and the errors of bad input."""

import sys

import numpy as np
import pytest
import torch

from ds_omni.config import DataConfig, from_dict
from ds_omni.data.media import VideoInfo, frame_indices, read_frames, video_info
from ds_omni.errors import ConfigError, DataError
from ds_omni.model.families.qwen2_vl_video import (Qwen2VLVideoItemProcessor, VideoSettings,
                                                   video_patches)
from tests.data_files import write_video
from tests.family_dirs import MERGE, PATCH, VIDEO_PROCESSOR, image_processor


def _settings(**kw) -> VideoSettings:
    from types import SimpleNamespace
    tower = SimpleNamespace(patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE)
    return VideoSettings.from_saved(VIDEO_PROCESSOR | kw, tower)


def _processor(**options) -> Qwen2VLVideoItemProcessor:
    from ds_omni.config import VideoConfig
    proc = Qwen2VLVideoItemProcessor(_settings(), video_token_id=7, vision_start_id=5,
                                      vision_end_id=6)
    return proc.with_options(VideoConfig(**options))


def _sample(total, rate=None, **kw):
    """Indices for a video of `total` frames at `rate` fps (None: unknown)."""
    args = dict(fps=None, num_frames=None, min_frames=4, max_frames=768, multiple=2) | kw
    return frame_indices(VideoInfo(frames=total, fps=rate, width=8, height=8), **args)


def test_frames_are_sampled_as_hfs_qwen2_vl_video_processor_samples_them():
    # fps: 12 frames at 4 fps are 3 s; 2 fps -> 6 frames, evenly spaced
    assert _sample(12, 4.0, fps=2.0) == [0, 2, 4, 6, 8, 10]
    # at least min_frames, at most max_frames, rounded down to the temporal patch size
    assert _sample(40, 4.0, fps=0.5) == [0, 10, 20, 30]
    assert _sample(40, 4.0, fps=4.0, max_frames=9) == list(range(0, 40, 5))
    assert _sample(1, 4.0, fps=2.0) == [0]  # a still: all its frames (the processor repeats it)
    # a frame count: rounded to the temporal patch size
    assert _sample(12, num_frames=5) == [0, 3, 6, 9]
    with pytest.raises(DataError, match="has 3 frames but data.video.num_frames asks for 4"):
        _sample(3, num_frames=4)
    with pytest.raises(DataError, match="frame rate is unknown.*num_frames"):
        _sample(12, fps=2.0)


def test_video_config_is_read_and_checked():
    data = {"sources": [{"name": "v", "path": "x"}], "video": {"fps": 1, "max_pixels": 4096}}
    video = from_dict(DataConfig, data).video
    assert (video.fps, video.num_frames, video.max_pixels) == (1.0, None, 4096)
    with pytest.raises(ConfigError, match="data.video.*num_frames"):
        from_dict(DataConfig, data | {"video": {"num_frames": 0}})
    with pytest.raises(ConfigError, match="unknown key.*'frames'"):
        from_dict(DataConfig, data | {"video": {"frames": 8}})


def test_decoding_reads_the_frames_asked_for_from_a_path_bytes_or_a_struct(tmp_path):
    path = write_video(tmp_path / "v.mkv", 5, 16, 8, fps=5, seed=3, codec="ffv1")  # lossless
    info = video_info(str(path))
    assert (info.frames, info.fps, info.width, info.height) == (5, 5.0, 16, 8)
    frames = read_frames(path.read_bytes(), [0, 2, 2, 4])
    assert frames.shape == (4, 8, 16, 3) and frames.dtype == np.uint8
    expected = np.random.default_rng(3).integers(0, 256, (5, 8, 16, 3), dtype=np.uint8)
    # ffv1 is lossless, but bgr0 <-> rgb24 is a plain reordering: the written pixels come back
    assert np.array_equal(frames, expected[[0, 2, 2, 4]])
    assert np.array_equal(read_frames({"bytes": None, "path": str(path)}, [1]), expected[[1]])


def test_video_patches_have_the_layout_of_hfs_video_processor():
    """A still video (one frame twice) is what HF's image processor makes of the frame, which
    repeats it over the temporal patch; with two frames, temporal slot k holds frame k."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, (2, 16, 24, 3), dtype=np.uint8)  # 16x24: no resize
    settings = _settings()
    image = image_processor()

    def image_patches(frame):
        from PIL import Image
        return image(images=[Image.fromarray(frame)], return_tensors="pt")["pixel_values"]
    still = video_patches(settings, np.stack([a, a]), (16, 24))
    torch.testing.assert_close(still, image_patches(a), rtol=0, atol=1e-6)
    moving = video_patches(settings, np.stack([a, b]), (16, 24))
    slots = moving.reshape(-1, 3, 2, PATCH, PATCH)  # [P, C, T, p, p]
    for k, frame in enumerate((a, b)):
        torch.testing.assert_close(slots[:, :, k], image_patches(frame).reshape(-1, 3, 2, PATCH,
                                                                               PATCH)[:, :, 0],
                                   rtol=0, atol=1e-6)


def test_measuring_a_video_reads_only_its_header_and_agrees_with_processing(tmp_path,
                                                                            monkeypatch):
    path = str(write_video(tmp_path / "v.mp4", 12, 40, 24, fps=4, seed=1))
    proc = _processor(num_frames=4, max_pixels=16 * 16)  # 40x24 -> 16x8 (at most 256 pixels)
    item = proc.process(path)
    assert item.meta["grid_thw"] == (2, 2, 4) and item.meta["frames"] == 4
    assert item.inputs["pixel_values"].shape == (16, 3 * 2 * PATCH * PATCH)
    assert item.num_embeddings == 4 and item.encoder_seqs == [8, 8]  # attention per time slice
    assert proc.tokens(item) == [5, 7, 7, 7, 7, 6]

    def no_decoding(*a):
        raise AssertionError("measure decoded frames")
    monkeypatch.setattr("ds_omni.model.families.qwen2_vl_video.read_frames", no_decoding)
    measured = proc.measure(path)
    assert (measured.num_embeddings, measured.encoder_seqs, measured.meta) == \
        (item.num_embeddings, item.encoder_seqs, item.meta)


def test_bad_videos_are_data_errors_naming_the_problem(tmp_path):
    proc = _processor()
    with pytest.raises(DataError, match="video file .*nope.mp4' does not exist"):
        proc.measure(str(tmp_path / "nope.mp4"))
    with pytest.raises(DataError, match="unreadable video"):
        proc.process(b"not a video at all" * 10)
    with pytest.raises(DataError, match="cannot read a video from a int"):
        proc.measure(3)


def test_video_without_a_decoder_is_a_config_error_naming_the_package(monkeypatch, tmp_path):
    """Not a DataError: under on_bad_sample="skip" it would silently drop every video."""
    from ds_omni.data.build import item_processors
    from ds_omni.config import SourceConfig, SchemaConfig
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(ConfigError, match=r"no video decoder is installed; pip install av"):
        _processor().measure(str(tmp_path / "v.mp4"))
    from types import SimpleNamespace
    cfg = SimpleNamespace(data=DataConfig(sources=[SourceConfig(name="v", path="x")]))
    built = SimpleNamespace(item_processors={"video": _processor()},
                            family=SimpleNamespace(name="llava"))
    item_processors(cfg, built, cfg.data.sources)  # no video column: no decoder needed
    videos = [SourceConfig(name="v", path="x", schema=SchemaConfig(video="clip"))]
    with pytest.raises(ConfigError, match="pip install av"):  # at start-up, not at the first video
        item_processors(cfg, built, videos)
    built.item_processors = {}
    with pytest.raises(ConfigError, match=r"\['v'\] have a schema.video column but this model "
                                          r"\(llava\) takes no videos"):
        item_processors(cfg, built, videos)
