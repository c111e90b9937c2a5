"""A workload: the metadata of training samples (LLM tokens, encoder items), drawn from a seeded
distribution (`WorkloadSpec`) or from a real dataset's `ds-omni data check --json` report
(`from_check_report`: its modality counts, token-length histogram and items per sample).

Only metadata, never pixels: what the loader's planners see of a sample (`data/sample_reader`).
The synthetic mix (also `benchmarks/balance.py`'s): image samples with 1 + Geometric images of
log-uniform patch counts, audio clips of uniform length, text of lognormal length.

Dims: N samples, M encoder items (all encoders).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ds_omni.errors import DataError


@dataclass(frozen=True)
class Samples:
    """N samples' metadata; items carry their owning sample."""

    tokens: np.ndarray
    """[N] LLM positions of each sample (text + image / audio placeholders)."""
    item_sample: np.ndarray
    """[M] owning sample of each item."""
    item_encoder: np.ndarray
    """[M] encoder name of each item ("vision", "audio")."""
    item_len: np.ndarray
    """[M] encoder positions (patches, frames) of each item: its encoder sequence."""
    item_rows: np.ndarray
    """[M] LLM positions (embedding rows) each item yields."""

    def __len__(self) -> int:
        return int(self.tokens.size)

    def take(self, idx: np.ndarray) -> "Samples":
        """The samples `idx` (renumbered 0..len(idx)-1, in that order), with their items."""
        idx = np.asarray(idx, dtype=np.int64)
        new = np.full(len(self), -1, dtype=np.int64)
        new[idx] = np.arange(idx.size)
        keep = new[self.item_sample] >= 0
        return Samples(self.tokens[idx], new[self.item_sample[keep]], self.item_encoder[keep],
                       self.item_len[keep], self.item_rows[keep])


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    image_fraction: float = 0.5
    """Share of image samples among non-audio samples."""
    audio_fraction: float = 0.0
    """Share of audio samples (one clip each)."""
    text_median: float = 700.0
    """Median tokens of a text-only sample (lognormal)."""
    text_sigma: float = 1.1
    """Lognormal sigma of text-only lengths."""
    caption_median: float = 200.0
    """Median text tokens of an image sample, and of an audio one unless `prompt_median`
    (lognormal, sigma 1)."""
    prompt_median: float | None = None
    """Median text tokens of an audio sample, if not `caption_median`."""
    images_geometric_p: float = 0.5
    """Images per image sample: Geometric(p) (P(1) = p), capped at `max_images`."""
    max_images: int = 8
    patches_range: tuple[float, float] = (64, 4096)
    """ViT patches per image, log-uniform in this range."""
    llm_tokens_per_patch: float = 0.25
    """LLM tokens per patch (a 2 x 2 merge, Qwen2-VL / LLaVA-OneVision)."""
    audio_seconds: tuple[float, float] = (1.0, 30.0)
    """Clip length, uniform."""
    encoder_frames_per_second: float = 50.0
    """Encoder positions per audio second (Whisper)."""
    llm_tokens_per_second: float = 25.0
    """LLM tokens per audio second (Qwen2-Audio)."""
    max_tokens: int = 32768
    """A sample's LLM tokens are clipped here (its text trimmed)."""
    token_buckets: tuple[tuple[float, float, float], ...] = ()
    """(share, shortest, longest) bands of text-only lengths, log-uniform in each; () uses the
    lognormal (`from_check_report` fills it from a real histogram)."""

    def __post_init__(self):
        for name in ("image_fraction", "audio_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise DataError(f"WorkloadSpec.{name} must be in [0, 1], got {getattr(self, name)}")

    def draw(self, n: int, seed: int | np.random.Generator,
             encoders: tuple[str, ...] = ("vision", "audio")) -> Samples:
        """n samples from a generator seeded with `seed` (the same n and seed: the same samples;
        a Generator: drawn from it, where it stands). `encoders`: the model's; a modality it has
        no encoder for is an error."""
        if n < 1:
            raise DataError(f"a workload needs at least one sample, got n={n}")
        self._check_encoders(encoders)
        rng = np.random.default_rng(seed)
        image = (1 - self.audio_fraction) * self.image_fraction
        kind = rng.choice(3, size=n, p=[1 - image - self.audio_fraction, image,
                                        self.audio_fraction])  # 0 text, 1 image, 2 audio
        caption = math.log(self.caption_median)
        prompt = caption if self.prompt_median is None else math.log(self.prompt_median)
        text = np.where(kind == 0, self._text(rng, n),
                        rng.lognormal(np.where(kind == 2, prompt, caption), 1.0, n))
        img_owner, patches = self._images(rng, kind == 1)
        audio_owner = np.flatnonzero(kind == 2)
        seconds = rng.uniform(*self.audio_seconds, audio_owner.size)
        frames = np.round(seconds * self.encoder_frames_per_second).astype(np.int64)
        img_rows = np.maximum(1, np.round(patches * self.llm_tokens_per_patch)).astype(np.int64)
        audio_rows = np.maximum(1, np.round(seconds * self.llm_tokens_per_second)).astype(np.int64)
        owner = np.concatenate([img_owner, audio_owner]).astype(np.int64)
        rows = np.concatenate([img_rows, audio_rows])
        media = np.bincount(owner, weights=rows, minlength=n)
        tokens = np.minimum(np.maximum(text, 8) + media, max(self.max_tokens, media.max(initial=0)))
        return Samples(tokens.astype(np.int64), owner,
                       np.array(["vision"] * img_owner.size + ["audio"] * audio_owner.size),
                       np.concatenate([patches, frames]).astype(np.int64), rows)

    def _check_encoders(self, encoders) -> None:
        need = {"vision": self.image_fraction > 0 and self.audio_fraction < 1,
                "audio": self.audio_fraction > 0}
        missing = [e for e, wanted in need.items() if wanted and e not in encoders]
        if missing:
            raise DataError(f"the workload has {missing} samples but the model has no such encoder "
                            f"(it has {list(encoders)}); set the workload's image_fraction / "
                            "audio_fraction to 0 or add the encoder")

    def _text(self, rng, n: int) -> np.ndarray:
        if not self.token_buckets:
            return rng.lognormal(math.log(self.text_median), self.text_sigma, n)
        share, lo, hi = (np.array(x, dtype=np.float64) for x in zip(*self.token_buckets))
        band = rng.choice(share.size, size=n, p=share / share.sum())
        return np.exp(rng.uniform(np.log(lo[band]), np.log(hi[band])))

    def _images(self, rng, has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        count = np.where(has, np.minimum(rng.geometric(self.images_geometric_p, has.size),
                                         self.max_images), 0)
        owner = np.repeat(np.arange(has.size), count)
        lo, hi = np.log(self.patches_range[0]), np.log(self.patches_range[1])
        return owner, np.round(np.exp(rng.uniform(lo, hi, owner.size))).astype(np.int64)


def from_check_report(report: dict, **overrides) -> WorkloadSpec:
    """A workload shaped like a dataset's `ds-omni data check --json` report, all sources
    together: the image and audio shares from `modalities`, images per sample from
    `items_per_sample`, text lengths from the `tokens` histogram's power-of-two buckets
    (log-uniform inside each). Image sizes are not in the report: the spec's defaults (or
    `overrides`) give them."""
    sources = list(report.get("sources", {}).values())
    rows = sum(s.get("checked", 0) for s in sources)
    if not sources or rows == 0:
        raise DataError("the data-check report has no checked samples; run `ds-omni data check "
                        "--json` on a config whose sources hold rows")
    mods = {k: sum(s.get("modalities", {}).get(k, 0) for s in sources)
            for k in ("image", "audio", "text_only")}
    audio = mods["audio"] / rows
    image = mods["image"] / max(rows - mods["audio"], 1)
    fields = dict(image_fraction=min(image, 1.0), audio_fraction=min(audio, 1.0),
                  token_buckets=_buckets(sources))
    per_image_sample = _mean_items(sources)
    if per_image_sample:
        fields["images_geometric_p"] = min(1.0, 1.0 / per_image_sample)
    return dataclasses.replace(WorkloadSpec(), **(fields | overrides))


def _buckets(sources: list[dict]) -> tuple[tuple[float, float, float], ...]:
    counts: dict[int, int] = {}
    for s in sources:
        for label, n in s.get("tokens", {}).get("buckets", {}).items():
            edge = int(label.removeprefix("<="))
            counts[edge] = counts.get(edge, 0) + int(n)
    total = sum(counts.values())
    return tuple((n / total, max(edge / 2, 8), edge) for edge, n in sorted(counts.items()) if n)


def _mean_items(sources: list[dict]) -> float:
    """Mean items of the samples that have any (`items_per_sample`: "k" -> samples)."""
    hist: dict[int, int] = {}
    for s in sources:
        for k, n in s.get("items_per_sample", {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(n)
    with_items = {k: n for k, n in hist.items() if k > 0}
    total = sum(with_items.values())
    return sum(k * n for k, n in with_items.items()) / total if total else 0.0
