"""Qwen2-VL's videos: frames sampled from the file, resized and cut into the tower's patch grid.

A video is the same for the tower as an image: frames sampled from the file (`data.video`), every
temporal_patch_size consecutive frames one temporal patch, so a t x h x w grid with t > 1, in the
layout of HF's `Qwen2VLVideoProcessor` (which needs torchvision, no ds_omni dependency: its
arithmetic is followed here). Its settings come from the video processor saved with the model
(`video_processor_entry`), with `data.video` laid over them. Qwen2.5-VL's video time axis in
seconds rides along as each item's `time_interval` (`qwen2_vl.mrope_position_ids`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.data.media import VideoInfo, frame_indices, normalized_frames, read_frames, video_info
from ds_omni.errors import DataError


VIDEO_DEFAULTS = {"min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28, "min_frames": 4,
                  "max_frames": 768}
"""HF's `Qwen2VLVideoProcessor` class defaults (that module needs torchvision, so they are
written down here; mean and std are CLIP's); a video processor saved with the model overrides
them."""


@dataclass(frozen=True)
class VideoSettings:
    """How one model's videos become patches: HF's video processor settings, with the frame
    sampling and sizes of `data.video` laid over them."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    min_frames: int
    max_frames: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    fps: float | None = 2.0
    num_frames: int | None = None

    @classmethod
    def from_saved(cls, saved: dict, vision_config) -> "VideoSettings":
        """From a saved video processor entry (`video_processor_entry`) and the tower's patching."""
        from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        size = saved.get("size") or {}
        pixels = {k: size.get(edge) or saved.get(k) or VIDEO_DEFAULTS[k]
                  for k, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge"))}
        frames = {k: saved.get(k) or VIDEO_DEFAULTS[k] for k in ("min_frames", "max_frames")}
        return cls(patch_size=vision_config.patch_size,
                   temporal_patch_size=vision_config.temporal_patch_size,
                   merge_size=vision_config.spatial_merge_size,
                   **{k: int(v) for k, v in (pixels | frames).items()},
                   image_mean=tuple(saved.get("image_mean") or OPENAI_CLIP_MEAN),
                   image_std=tuple(saved.get("image_std") or OPENAI_CLIP_STD))

    def with_options(self, video) -> "VideoSettings":
        """`data.video` (a `VideoConfig`) laid over these settings: what it leaves None stays."""
        overrides = {k: getattr(video, k) for k in ("max_frames", "min_pixels", "max_pixels")
                     if getattr(video, k) is not None}
        return replace(self, fps=video.fps, num_frames=video.num_frames, **overrides)

    def frame_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) a frame is resized to: multiples of patch x merge, aspect kept."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        try:
            return smart_resize(height, width, factor=self.patch_size * self.merge_size,
                                min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as e:  # an aspect ratio over 200
            raise DataError(f"video frames of {width}x{height}: {e}") from None


class Qwen2VLVideoItemProcessor(ItemProcessor):
    """A video -> its patches [p, C*T*p*p] and grid [3], for the same tower as images.

    Frames are sampled (`media.frame_indices`), resized to multiples of patch x merge, normalised,
    and every `temporal_patch_size` consecutive frames form one temporal patch (the last frame is
    repeated to fill the last one), in the layout of HF's `Qwen2VLVideoProcessor`. The tower
    treats the grid's t slices as it treats images (attention within each slice), so video items
    share the image encoder and its micro-batch inputs; only the placeholder token differs.
    Dims: n sampled frames, t = ceil(n / T) temporal patches, h x w patches per frame.
    """

    encoder = "vision"
    modality = "video"

    def __init__(self, settings: VideoSettings, *, video_token_id: int, vision_start_id: int,
                 vision_end_id: int, tokens_per_second: int | None = None):
        self.settings = settings
        self.placeholder_id = video_token_id
        self.vision_start_id = vision_start_id
        self.vision_end_id = vision_end_id
        self.tokens_per_second = tokens_per_second  # Qwen2.5-VL's time axis; None: Qwen2-VL's

    def with_options(self, video) -> "Qwen2VLVideoItemProcessor":
        """A copy that samples and sizes frames as `data.video` says."""
        return Qwen2VLVideoItemProcessor(
            self.settings.with_options(video), video_token_id=self.placeholder_id,
            vision_start_id=self.vision_start_id, vision_end_id=self.vision_end_id,
            tokens_per_second=self.tokens_per_second)

    def _plan(self, info: VideoInfo) -> tuple[list[int], tuple[int, int, int], tuple[int, int]]:
        """(frame indices, grid (t, h, w) in patches, resized (height, width)) of a video."""
        s = self.settings
        indices = frame_indices(info, fps=s.fps, num_frames=s.num_frames, min_frames=s.min_frames,
                                max_frames=s.max_frames, multiple=s.temporal_patch_size)
        height, width = s.frame_size(info.height, info.width)
        t = -(-len(indices) // s.temporal_patch_size)
        return indices, (t, height // s.patch_size, width // s.patch_size), (height, width)

    def _item(self, grid: tuple[int, int, int], info: VideoInfo, frames: int,
              inputs: dict) -> EncodedItem:
        t, h, w = grid
        m = self.settings.merge_size
        # HF's `second_per_grid_ts` (Qwen2.5-VL's M-RoPE time axis): seconds per temporal patch
        # at the rate frames were kept (VideoMetadata.sampled_fps: 24 when the rate is unknown)
        sampled_fps = frames / info.frames * info.fps if info.fps else 24.0
        seconds = self.settings.temporal_patch_size / sampled_fps
        # HF multiplies in fp32 (the processor's second_per_grid_ts is a float32 tensor)
        interval = 1.0 if self.tokens_per_second is None else float(
            torch.tensor(seconds, dtype=torch.float32) * self.tokens_per_second)
        return EncodedItem(inputs=inputs, num_embeddings=t * h * w // m ** 2,
                           meta={"grid_thw": grid, "patches": t * h * w, "frames": frames,
                                 "placeholder_id": self.placeholder_id, "merge_size": m,
                                 "seconds_per_grid": seconds, "time_interval": interval},
                           encoder_seqs=[h * w] * t)  # the tower attends within each slice

    def measure(self, video):
        info = video_info(video)
        indices, grid, _ = self._plan(info)
        return self._item(grid, info, len(indices), {})

    def process(self, video):
        info = video_info(video)
        indices, grid, size = self._plan(info)
        frames = read_frames(video, indices)  # [n, H, W, 3] uint8
        patches = video_patches(self.settings, frames, size)
        return self._item(grid, info, len(indices), {"pixel_values": patches,
                                                     "image_grid_thw": torch.tensor(grid)})

    def tokens(self, item):
        return [self.vision_start_id, *[self.placeholder_id] * item.num_embeddings,
                self.vision_end_id]


def video_patches(s: VideoSettings, frames, size: tuple[int, int]) -> torch.Tensor:
    """RGB frames [n, H, W, 3] uint8 -> patches [t*h*w, C*T*p*p] (HF's video patch layout).

    Arithmetic of HF's torchvision-based `Qwen2VLVideoProcessor` on CPU: a uint8 bicubic resize
    with antialias (torchvision's native uint8 kernel, which is torch's), then (x - 255 mean) /
    (255 std) in fp32.
    """
    video = normalized_frames(frames, size, s.image_mean, s.image_std)  # [n, C, H', W']
    tp, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
    if pad := -video.shape[0] % tp:  # repeat the last frame to fill the last temporal patch
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    n, c, height, width = video.shape
    t, h, w = n // tp, height // p, width // p
    patches = video.reshape(t, tp, c, h // m, m, p, w // m, m, p)
    # [t, T, C, h/m, m, p, w/m, m, p] -> [t, h/m, w/m, m, m, C, T, p, p]: merge blocks contiguous
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, c * tp * p * p).contiguous()


def video_processor_entry(vision_config, model_dir: Path | None) -> dict:
    """The video processor settings saved with the model (either layout), else the tower's
    patching; HF fills in the class's other defaults when it loads them."""
    saved = {}
    if model_dir is not None:
        saved = (_read_json(Path(model_dir) / "processor_config.json").get("video_processor")
                 or _read_json(Path(model_dir) / "video_preprocessor_config.json"))
    return saved or {"video_processor_type": "Qwen2VLVideoProcessor",
                     "patch_size": vision_config.patch_size,
                     "temporal_patch_size": vision_config.temporal_patch_size,
                     "merge_size": vision_config.spatial_merge_size}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
