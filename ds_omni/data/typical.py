"""The items a typical sample carries: what the data's mix gives, read from the config's sources.

`items_per_sample` weighs each source by its mixing weight as training starts (`data.schedule`
at step 0) and counts the media items (images, audio clips, videos) of the first `PEEK_ROWS`
rows of its first file, undecoded: cheap and the same on every rank and every run. The
pipeline's `encoder_placement: "auto"` plans its typical step with it. A source that cannot be
read counts as one item of each kind a sample (the planner's old assumption), said in the log.

Dims: S sources, K kinds of item.
"""

from __future__ import annotations

import logging

from ds_omni.config import DataConfig, SourceConfig
from ds_omni.data.mixer import MixSchedule
from ds_omni.errors import DataError

PEEK_ROWS = 64  # rows of a source's first file its items a sample are counted from
KINDS = ("vision", "audio", "video")
log = logging.getLogger(__name__)


def items_per_sample(cfg: DataConfig) -> dict[str, float]:
    """Kind of item -> the mean items of that kind a sample, over the sources as the mix starts."""
    weights = MixSchedule({s.name: s.weight for s in cfg.sources}, cfg.schedule).weights_at(0)
    total = sum(weights.values())
    out = {kind: 0.0 for kind in KINDS}
    for src in cfg.sources:
        share = weights[src.name] / total if total else 1.0 / len(cfg.sources)
        if share:
            for kind, mean in source_items(src, cfg.chunk_rows).items():
                out[kind] += share * mean
    return out


def source_items(src: SourceConfig, chunk_rows: int = 1024) -> dict[str, float]:
    """Kind -> mean items a row over the source's first `PEEK_ROWS` rows (bad rows left out)."""
    from ds_omni.data.sources import Source
    try:
        source = Source(src, chunk_rows)
        counts = {kind: 0 for kind in KINDS}
        rows = 0
        for loc, row in source.stream(source.chunks[0], 0):
            if rows >= PEEK_ROWS:
                break
            try:
                _, media, _ = source.parts(row, loc)
            except DataError:
                continue
            rows += 1
            for kind, items in media.items():
                counts[kind] = counts.get(kind, 0) + len(items or [])
    except (DataError, OSError) as e:
        log.warning("ds-omni: data source '%s' could not be peeked (%s): its samples are "
                    "taken to carry one item of each kind", src.name, e)
        return {kind: 1.0 for kind in KINDS}
    return {kind: counts[kind] / rows if rows else 0.0 for kind in counts}


def encoder_items_per_sample(cfg: DataConfig, encoders: list[str]) -> dict[str, float]:
    """Encoder name -> its items a sample (`items_per_sample`): a kind goes to the encoder of its
    name; videos to "vision" where there is no "video" encoder (a video's frames are counted as
    one item of the encoder's dummy size, an underestimate)."""
    kinds = items_per_sample(cfg)
    out = {name: kinds.get(name, 0.0) for name in encoders}
    if "video" not in encoders and "vision" in out:
        out["vision"] += kinds.get("video", 0.0)
    return out
