"""Videos through the generic adapter (`generic.GenericFamily`): LLaVA-OneVision's `<video>`.

For a family in `VIDEO_PROCESSORS`, a video is sampled into frames (`data.video`), each frame
becomes pixels as HF's video processor makes them, all frames go through HF's
`get_video_features` in one call, and the text gets as many `<video>` tokens as HF's processor
expands it to. HF's video processors are torchvision classes, so their arithmetic is repeated on
CPU (`media.normalized_frames`: antialiased bicubic on uint8, then the fused rescale-normalize in
fp32); it may differ from HF's only in torchvision's CUDA resize and in other video decoders'
YUV rounding. Settings not repeated (a centre crop, another resample) are refused at load.
More: docs/data.md, "Video".

Dims: n sampled frames, C channels, H x W a resized frame (the tower's image size).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.data.media import (VideoInfo, normalized_frames, read_frames, uniform_frame_indices,
                                video_info)
from ds_omni.errors import ConfigError, ModelError

VIDEO_PROCESSORS = {"llava_onevision": "LlavaOnevisionVideoProcessor"}
"""HF model folder -> its (torchvision) video processor class, whose defaults and arithmetic
`GenericVideoItemProcessor` repeats; the families the generic adapter carries videos for."""
VIDEO_INPUT = "pixel_values_videos"
"""The item input that marks a video: the generic encoder hands it to `get_video_features`."""
REPEATED = {"do_resize": True, "resample": 3, "do_center_crop": False, "do_rescale": True,
            "do_normalize": True}
"""The video processor settings ds_omni repeats (resample 3: PILImageResampling.BICUBIC)."""


@dataclass(frozen=True)
class FrameSettings:
    """How one model's video frames become pixels, with `data.video`'s sampling laid over."""

    height: int
    width: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    fps: float | None = 2.0
    num_frames: int | None = None
    max_frames: int | None = None

    def frames(self, info: VideoInfo) -> list[int]:
        return uniform_frame_indices(info, fps=self.fps, num_frames=self.num_frames,
                                     max_frames=self.max_frames)


def frame_settings(folder: str, model_dir: Path | None, vision_config) -> FrameSettings:
    """The video processor saved with the model (either layout) over HF's class defaults; no saved
    size: the tower's image size (the only one `get_video_features` pools; HF's class default is
    the released checkpoints' 384). A setting ds_omni does not repeat is a `ModelError`."""
    module = importlib.import_module(f"transformers.models.{folder}.video_processing_{folder}")
    cls = getattr(module, VIDEO_PROCESSORS[folder])  # imports without torchvision; never built
    saved = saved_video_processor(model_dir)

    def get(key):
        return saved[key] if saved.get(key) is not None else getattr(cls, key, None)

    side = vision_config.image_size
    size = saved.get("size") or {"height": side, "width": side}
    where = f"{folder}'s video processor ({str(model_dir)!r})"
    unsupported = {k: get(k) for k, ok in REPEATED.items() if (get(k) or False) != ok}
    if abs(get("rescale_factor") - 1 / 255) > 1e-12:
        unsupported["rescale_factor"] = get("rescale_factor")
    if unsupported or set(size) != {"height", "width"}:
        found = unsupported or {"size": size}
        raise ModelError(f"{where} sets {found}; ds_omni repeats HF's video arithmetic "
                         "only for a bicubic resize to size {height, width}, rescale "
                         "by 1/255 and normalize, no center crop. Save the video processor with "
                         "those settings")
    if (size["height"], size["width"]) != (side, side):
        raise ModelError(f"{where} resizes frames to {size['height']}x{size['width']} but the "
                         f"tower takes {side}x{side} images (vision_config.image_size), and "
                         "get_video_features pools that grid only; set its size to "
                         f"{{\"height\": {side}, \"width\": {side}}}")
    return FrameSettings(height=side, width=side, image_mean=tuple(get("image_mean")),
                         image_std=tuple(get("image_std")))


def saved_video_processor(model_dir: Path | None) -> dict:
    """The video processor settings saved in `model_dir` (`video_preprocessor_config.json`, or
    the `video_processor` entry of `processor_config.json`), else {}."""
    if model_dir is None:
        return {}
    for name, key in (("video_preprocessor_config.json", None),
                      ("processor_config.json", "video_processor")):
        path = Path(model_dir) / name
        if path.is_file():
            found = json.loads(path.read_text())
            found = found.get(key) if key else found
            if found:
                return found
    return {}


class GenericVideoItemProcessor(ItemProcessor):
    """A video -> its frames [1, n, C, H, W] (`pixel_values_videos`) and HF's count of `<video>`
    tokens for n frames; it feeds the vision encoder, whose `get_video_features` encodes it."""

    encoder = "vision"
    modality = "video"

    def __init__(self, settings: FrameSettings, *, hf_processor, video_token_id: int,
                 tower_tokens: int):
        self.settings = settings
        self.hf_processor = hf_processor  # HF's processor: the token count is its own
        self.placeholder_id = video_token_id
        self.tower_tokens = tower_tokens  # patches the tower attends over per frame

    def with_options(self, video) -> "GenericVideoItemProcessor":
        """A copy that samples frames as `data.video` (a `VideoConfig`) says."""
        sized = {k: getattr(video, k) for k in ("min_pixels", "max_pixels")
                 if getattr(video, k) is not None}
        if sized:
            raise ConfigError(f"data.video sets {sized}, but this model resizes every frame to its "
                              f"tower's {self.settings.height}x{self.settings.width}; remove them "
                              "(they size Qwen2-VL's frames)")
        settings = replace(self.settings, fps=video.fps, num_frames=video.num_frames,
                           max_frames=video.max_frames)
        return GenericVideoItemProcessor(settings, hf_processor=self.hf_processor,
                                         video_token_id=self.placeholder_id,
                                         tower_tokens=self.tower_tokens)

    def _item(self, frames: int, inputs: dict) -> EncodedItem:
        s = self.settings
        counts = self.hf_processor._get_num_multimodal_tokens(
            video_sizes=[(frames, s.height, s.width)])
        return EncodedItem(inputs=inputs, num_embeddings=int(counts["num_video_tokens"][0]),
                           meta={"frames": frames, "placeholder_id": self.placeholder_id},
                           encoder_seqs=[self.tower_tokens] * frames)  # one tower pass a frame

    def measure(self, video):
        return self._item(len(self.settings.frames(video_info(video))), {})

    def process(self, video):
        s = self.settings
        indices = s.frames(video_info(video))
        pixels = normalized_frames(read_frames(video, indices), (s.height, s.width),
                                   s.image_mean, s.image_std)  # [n, C, H, W]
        return self._item(len(indices), {VIDEO_INPUT: pixels[None]})  # [1, n, C, H, W]

    def tokens(self, item):
        return [self.placeholder_id] * item.num_embeddings


def video_token_id(config) -> int | None:
    for attr in ("video_token_id", "video_token_index"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    return None


def video_item_processor(folder: str, hf_config, hf_processor,
                         model_dir: Path | None) -> GenericVideoItemProcessor | None:
    """The video item processor of a family in `VIDEO_PROCESSORS`, else None."""
    if folder not in VIDEO_PROCESSORS:
        return None
    vc = hf_config.vision_config
    return GenericVideoItemProcessor(
        frame_settings(folder, model_dir, vc), hf_processor=hf_processor,
        video_token_id=video_token_id(hf_config),
        tower_tokens=(vc.image_size // vc.patch_size) ** 2)
