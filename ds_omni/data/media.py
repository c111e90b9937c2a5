"""Raw media -> what processors consume: RGB images, mono waveforms and video frames.

Rows carry media as stored (HF `Image`/`Audio` structs of bytes and path, raw bytes, a path, or
already decoded objects). Decoding happens in the item processors, on the rank that trains on the
sample; every failure is a `DataError` that the sample processor prefixes with the sample's name.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ds_omni.config.data import PIL_MAX_IMAGE_PIXELS
from ds_omni.errors import DataError


def _media_source(value: Any, kind: str = "image"):
    """A file-like or path (for PIL or PyAV), from any stored form of an image or a video."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return io.BytesIO(value)
    if isinstance(value, (str, Path)):
        if not Path(value).is_file():
            raise DataError(f"{kind} file {str(value)!r} does not exist")
        return str(value)
    raise DataError(f"cannot read {'an' if kind == 'image' else 'a'} {kind} from a "
                    f"{type(value).__name__}; give bytes, a path, or a dict with 'bytes' or 'path'")


DEFAULT_MAX_IMAGE_PIXELS = PIL_MAX_IMAGE_PIXELS  # data.max_image_pixels' default


def _open_image(value: Any, max_pixels: int | None):
    """PIL's lazy open (header read, no pixels decoded), with the pixel limit checked here
    (PIL's own check is off: its error names neither the file nor the setting)."""
    from PIL import Image
    Image.MAX_IMAGE_PIXELS = None
    im = Image.open(_media_source(value))
    w, h = im.size
    if max_pixels is not None and w * h > max_pixels:
        im.close()
        raise DataError(f"image {media_name(value)}is {w} x {h} = {w * h} pixels, above "
                        f"data.max_image_pixels={max_pixels}; resize it, or raise "
                        "data.max_image_pixels if the memory to decode it is there")
    return im


def media_name(value: Any) -> str:
    """The file an image came from, quoted with a trailing space, or "" for bytes."""
    path = value.get("path") if isinstance(value, dict) else value
    return f"{str(path)!r} " if isinstance(path, (str, Path)) and path else ""


def load_image(value: Any, max_pixels: int | None = None):
    """An RGB PIL image from a PIL image, an HF Image struct, raw bytes or a path (`to_rgb`);
    one of more than `max_pixels` pixels is a `DataError` before its pixels are decoded."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(value, Image.Image):
        return to_rgb(value)
    try:
        with _open_image(value, max_pixels) as im:
            return to_rgb(im)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"unreadable image {media_name(value)}({e})") from None


def to_rgb(image):
    """RGB as HF's processors make it (`convert_to_rgb`), for every PIL mode: 16- and 32-bit
    integer and float pixels scaled to 0..255 (not clipped: a 16-bit PNG is not all white),
    transparency (alpha, a palette's) composited on white, the rest by PIL's conversion."""
    from PIL import Image
    if image.mode == "RGB":
        return image.copy()
    if image.mode.startswith(("I", "F")):
        return Image.fromarray(_scaled_to_8bit(image), "L").convert("RGB")
    if image.mode in ("La", "RGBa"):  # premultiplied alpha: PIL un-multiplies on the way to RGBA
        image = image.convert("RGBA" if image.mode == "RGBa" else "LA")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _scaled_to_8bit(image) -> np.ndarray:
    """A one-channel 16-bit, 32-bit integer or float image as uint8 [H, W]: 16-bit by its full
    range (65535 -> 255); 32-bit integers that fit 16 bits (how PIL may open a 16-bit PNG) the
    same, wider ones by their own min..max; floats in 0..1 times 255, others by min..max."""
    a = np.asarray(image, dtype=np.float64)  # [H, W]
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if image.mode.startswith("I;16") or (image.mode == "I" and lo >= 0 and hi <= 65535):
        a = a * (255.0 / 65535.0)
    elif image.mode == "F" and lo >= 0 and hi <= 1:
        a = a * 255.0
    elif hi > lo:
        a = (a - lo) * (255.0 / (hi - lo))
    else:
        a = np.full_like(a, min(max(lo, 0.0), 255.0))
    return np.rint(a).clip(0, 255).astype(np.uint8)


def image_size(value: Any, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) from the image header alone (no pixel decode); one over `max_pixels` is
    a `DataError` that names it and data.max_image_pixels."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(value, Image.Image):
        return value.size
    try:
        with _open_image(value, max_pixels) as im:
            return im.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"unreadable image {media_name(value)}({e})") from None


def is_constant(image) -> bool:
    """Whether every pixel of an RGB image has one value (blank, or a conversion gone wrong)."""
    lo, hi = zip(*image.getextrema())
    return lo == hi


def read_clip(clip: Any, sampling_rate: int) -> np.ndarray:
    """A mono float32 waveform [samples] from any accepted form; it must be at `sampling_rate`.

    Accepted: {"array", "sampling_rate"} (HF datasets' Audio feature, also its decoder object), a
    bare 1-D array (taken to be at `sampling_rate`), {"bytes"} / {"path"} / raw bytes / a path of
    an audio file (decoded with soundfile, channels averaged).
    """
    array, rate = _waveform_and_rate(clip)
    return _check_waveform(np.asarray(array), sampling_rate if rate is None else rate, sampling_rate)


def _waveform_and_rate(clip: Any) -> tuple[Any, int | None]:
    """(samples, rate or None when the form carries none)."""
    if isinstance(clip, np.ndarray):
        return clip, None
    if isinstance(clip, (bytes, bytearray, str, Path)):
        return _decode(clip)
    if isinstance(clip, dict):
        if clip.get("array") is not None:
            return clip["array"], clip.get("sampling_rate")
        source = clip.get("bytes") or clip.get("path")
        if source is None:
            raise DataError(f"audio dict has neither 'array' nor 'bytes' nor 'path' (keys "
                            f"{sorted(clip)}); give one of them")
        return _decode(source)
    try:  # datasets' AudioDecoder answers the same two keys as its dicts
        return clip["array"], clip["sampling_rate"]
    except (TypeError, KeyError, IndexError):
        raise DataError(f"cannot read audio from a {type(clip).__name__}; give a dict with 'array' "
                        "and 'sampling_rate', a 1-D numpy array, bytes or a path") from None


def _decode(source) -> tuple[np.ndarray, int]:
    """Audio file bytes or path -> (waveform [samples], rate); stereo is averaged to mono."""
    import soundfile as sf
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise DataError(f"audio file {str(source)!r} does not exist")
    try:
        data, rate = sf.read(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else
                             str(source), dtype="float32", always_2d=True)  # [samples, channels]
    except (sf.SoundFileError, RuntimeError, OSError, TypeError) as e:
        raise DataError(f"unreadable audio ({e}); give a file soundfile can decode (wav, flac, ogg, "
                        "mp3) or an array with its sampling_rate") from None
    return data.mean(axis=1), rate


def _check_waveform(array: np.ndarray, rate: int, expected_rate: int) -> np.ndarray:
    if int(rate) != expected_rate:
        raise DataError(f"audio sampled at {rate} Hz but the model's feature extractor expects "
                        f"{expected_rate} Hz; resample the data (e.g. cast the column to "
                        f"datasets.Audio(sampling_rate={expected_rate}))")
    if array.ndim != 1:
        raise DataError(f"audio array has shape {array.shape}; expected mono [samples] (average "
                        "the channels first)")
    if array.size == 0:
        raise DataError("audio clip is empty")
    if not np.issubdtype(array.dtype, np.number):
        raise DataError(f"audio array has dtype {array.dtype}; expected numbers (float samples)")
    array = array.astype(np.float32, copy=False)
    if not np.isfinite(array).all():
        raise DataError("audio array holds NaN or infinite samples")
    return array


def square_image(value: Any, mode: str, fill: tuple[int, int, int]):
    """An RGB image made square before the model's processor sees it.

    "pad": centred on a square of its long side filled with `fill` (LLaVA-1.5's expand2square:
    nothing is lost, the short side gets more padding than content for a very wide image);
    "resize": stretched to a square of the same area (nothing lost, shapes distorted).
    """
    from PIL import Image
    image = load_image(value)
    w, h = image.size
    if w == h:
        return image
    if mode == "resize":
        side = max(1, round((w * h) ** 0.5))
        return image.resize((side, side), Image.Resampling.BICUBIC)
    side = max(w, h)
    out = Image.new("RGB", (side, side), fill)
    out.paste(image, ((side - w) // 2, (side - h) // 2))
    return out


# ------------------------------------------------------------------------------------- video
VIDEO_FIX = "pip install av (PyAV: FFmpeg in a wheel, no system libraries), or pip install 'ds_omni[video]'"


def video_decoder():
    """PyAV, imported on first use; missing, it is a `ConfigError` (not a bad sample: skipping
    would drop every video) that names the package to install."""
    try:
        import av
    except ImportError:
        from ds_omni.errors import ConfigError
        raise ConfigError(f"the data has videos but no video decoder is installed; {VIDEO_FIX}") \
            from None
    return av


@dataclass(frozen=True)
class VideoInfo:
    """What a video's header says: frame count, frame rate (None if unknown) and frame size."""

    frames: int
    fps: float | None
    width: int
    height: int


def _open_video(value: Any):
    """(container, its first video stream); an unreadable file is a `DataError`."""
    av = video_decoder()
    try:
        container = av.open(_media_source(value, "video"))
    except (av.FFmpegError, OSError, ValueError) as e:
        raise DataError(f"unreadable video ({e})") from None
    if not container.streams.video:
        container.close()
        raise DataError("the file has no video stream")
    return container, container.streams.video[0]


def video_info(value: Any) -> VideoInfo:
    """Frame count, rate and size from the container alone (no frame decoded; a container that
    does not store its frame count has its packets counted)."""
    av = video_decoder()
    container, stream = _open_video(value)
    with container:
        rate = stream.average_rate or stream.guessed_rate
        frames = stream.frames
        try:
            if not frames:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
        except av.FFmpegError as e:
            raise DataError(f"unreadable video ({e})") from None
        info = VideoInfo(frames=int(frames), fps=float(rate) if rate else None,
                         width=stream.codec_context.width, height=stream.codec_context.height)
    if info.frames < 1:
        raise DataError("the video has no frames")
    return info


def read_frames(value: Any, indices: list[int]) -> np.ndarray:
    """Frames `indices` (ascending, repeats allowed) as RGB uint8 [n, H, W, 3], decoded in order
    up to the last one asked for."""
    av = video_decoder()
    wanted, last = set(indices), max(indices)
    got: dict[int, np.ndarray] = {}
    container, stream = _open_video(value)
    with container:
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    got[i] = frame.to_ndarray(format="rgb24")  # [H, W, 3]
                if i >= last:
                    break
        except av.FFmpegError as e:
            raise DataError(f"unreadable video ({e})") from None
    if len(got) != len(wanted):
        raise DataError(f"the video decodes to fewer frames than its header says: frame "
                        f"{max(set(wanted) - set(got))} is missing")
    return np.stack([got[i] for i in indices])  # [n, H, W, 3]


def frame_indices(info: VideoInfo, *, fps: float | None, num_frames: int | None,
                  min_frames: int, max_frames: int, multiple: int) -> list[int]:
    """Evenly spaced frames to keep, as HF's Qwen2-VL video processor samples them
    (`sample_frames`): `num_frames` rounded to a multiple of `multiple` (the temporal patch
    size), or `fps` frames per second of video kept within min_frames..max_frames and the video's
    own frames, rounded down to a multiple. A clip shorter than `multiple` frames keeps them all
    (the processor repeats the last one)."""
    total = info.frames
    if num_frames is not None:
        n = max(multiple, round(num_frames / multiple) * multiple)
        if n > total:
            raise DataError(f"the video has {total} frames but data.video.num_frames asks for {n}; "
                            "lower num_frames, or sample by data.video.fps instead")
    else:
        if info.fps is None:
            raise DataError("the video's frame rate is unknown, so it cannot be sampled by fps; set "
                            "data.video.num_frames instead")
        cap = min(max_frames, total) // multiple * multiple
        n = min(max(total / info.fps * fps, min_frames), cap, total) // multiple * multiple
    if n < 1:
        return list(range(total))
    import torch  # HF's exact arithmetic (a float step), so frames are the ones HF would pick
    return torch.arange(0, total, total / int(n)).int().tolist()


def uniform_frame_indices(info: VideoInfo, *, fps: float | None, num_frames: int | None,
                          max_frames: int | None) -> list[int]:
    """Evenly spaced frames to keep, as HF's default sampler (`default_sample_indices_fn`, what
    LLaVA-OneVision's video processor samples with) picks them: `num_frames`, or
    max(1, int(seconds x fps)); at most `max_frames` (ds_omni's cap, None: none)."""
    total = info.frames
    if num_frames is None:
        if info.fps is None:
            raise DataError("the video's frame rate is unknown, so it cannot be sampled by fps; set "
                            "data.video.num_frames instead")
        num_frames = max(1, int(total / info.fps * fps))
    elif num_frames > total:
        raise DataError(f"the video has {total} frames but data.video.num_frames asks for "
                        f"{num_frames}; lower num_frames, or sample by data.video.fps instead")
    n = min(num_frames, max_frames or num_frames, total)
    return (np.arange(n, dtype=int) * total // n).tolist()


def normalized_frames(frames: np.ndarray, size: tuple[int, int], mean, std):
    """RGB frames [n, H, W, 3] uint8 -> [n, C, height, width] fp32, as HF's torchvision video
    processors make them on CPU: a uint8 bicubic resize with antialias (torchvision's native uint8
    kernel, which is torch's `interpolate`), then their fused rescale-and-normalize,
    (x - 255 mean) / (255 std) in fp32."""
    import torch
    import torch.nn.functional as F
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)  # [n, H, W, C] -> [n, C, H, W]
    if tuple(video.shape[-2:]) != tuple(size):
        video = F.interpolate(video.contiguous(), size=tuple(size), mode="bicubic",
                              align_corners=False, antialias=True)  # uint8 in, uint8 out
    scale = 1.0 / (1 / 255)
    mean = (torch.tensor(mean) * scale).view(1, -1, 1, 1)
    std = (torch.tensor(std) * scale).view(1, -1, 1, 1)
    return (video.float() - mean) / std  # [n, C, height, width]
