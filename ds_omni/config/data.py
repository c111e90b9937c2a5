"""The data section: the sources and their column schema, the mixing schedule, cost balancing
over data-parallel ranks (reorder), video sampling, packing and loading."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ds_omni.errors import ConfigError

PIL_MAX_IMAGE_PIXELS = 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS, the default pixel limit


@dataclass(kw_only=True)
class SchemaConfig:
    """Which columns of a source hold the text, the images and the audio."""

    layout: Literal["auto", "llava", "messages", "cauldron", "text"] = "auto"
    """How rows are laid out (docs/data.md): LLaVA turns, chat messages (string or typed-part
    contents), The Cauldron's user/assistant pairs, plain text; "auto": found from the first rows."""
    text: str = "conversations"
    """Column with the conversation (LLaVA turns, chat messages, The Cauldron's pairs) or plain
    text; where the rows have no "conversations", the column is found from them (`layout`)."""
    image: str | None = "image"
    """Column with image bytes, an HF Image, or a path relative to `root`; one or a list."""
    audio: str | None = None
    """Column with audio: {"array", "sampling_rate"}, bytes, or a path relative to `root`."""
    video: str | None = None
    """Column with video files (bytes, {"bytes"/"path"}, or a path relative to `root`; one or a
    list), decoded with PyAV and sampled as `data.video` says."""
    id: str | None = "id"
    """Column with a stable sample id (used in logs and resume checks); default: row index."""
    root: str | None = None
    """Directory that relative image/audio/video paths are resolved against; default: the folder of
    the data file the row comes from (the LLaVA convention), never the working directory."""
    image_marker: str = "<image>"
    """String in the text that marks where an image goes."""
    audio_marker: str = "<audio>"
    """String in the text that marks where an audio clip goes."""
    video_marker: str = "<video>"
    """String in the text that marks where a video goes."""
    conversation_strings: Literal["parse", "error", "text"] = "parse"
    """Text that is a string holding a JSON conversation ('[{"from": ...}]'): parse it into
    turns, stop with an error, or train on it as plain text (every token a target)."""

    def media_columns(self) -> dict[str, str | None]:
        """Kind of item (the keys of a family's item processors) -> the column holding them."""
        return {"vision": self.image, "audio": self.audio, "video": self.video}

    def markers(self) -> dict[str, str]:
        """Kind of item -> the marker string placing one in the text."""
        return {"vision": self.image_marker, "audio": self.audio_marker,
                "video": self.video_marker}


@dataclass(kw_only=True)
class SourceConfig:
    """One data source: local files read chunk by chunk."""

    name: str
    """Short name, used in metrics and error messages."""
    path: str
    """Local file, glob or directory (parquet, jsonl, arrow, webdataset .tar, save_to_disk, a hub
    dataset snapshot); "builtin:shapes" for the embedded demo data, made from a seed at first use."""
    config: str | None = None
    """A hub dataset snapshot folder (README with `configs`): the config to read; default: the
    one marked default, or the only one."""
    split: str = "train"
    """A hub dataset snapshot folder: the split of the config to read."""
    weight: float = 1.0
    """Relative mixing weight."""
    format: Literal["auto", "parquet", "json", "arrow", "webdataset", "disk"] = "auto"
    """File format; "auto" infers it from the extension."""
    schema: SchemaConfig = field(default_factory=SchemaConfig)
    """Column mapping."""
    json_field: str | None = None
    """A .json file holding one object: the key whose list holds the rows (default: the
    object's only list of objects). A top-level array needs nothing."""
    on_exhausted: Literal["repeat", "stop", "drop"] = "repeat"
    """When the source runs out: start another epoch, stop training, or leave the mix (the other
    weights are renormalised)."""
    on_bad_sample: Literal["error", "skip"] = "error"
    """"error": stop naming the bad sample (corrupt media, empty text, mismatched markers); "skip":
    log it to <output_dir>/skipped.jsonl and go on. More: docs/data.md#several-sources."""

    def __post_init__(self):
        if self.weight < 0:
            raise ConfigError(f"data.sources[{self.name}].weight must be >= 0, got {self.weight}")


@dataclass(kw_only=True)
class WeightPoint:
    """Mixing weights from a step on (a curriculum is a list of these)."""

    step: int
    """First global step (optimizer step) these weights apply to."""
    weights: dict[str, float]
    """Source name -> weight; sources left out keep their previous weight."""
    ramp: Literal["step", "linear"] = "step"
    """"linear": move linearly from the previous point's weights (at its step) to these."""


@dataclass(kw_only=True)
class ReorderConfig:
    """Balancing of modelled cost over data-parallel ranks (decentralized grouped reordering)."""

    mode: Literal["loader_order", "fixed", "budget"] = "fixed"
    """loader_order: no balancing; fixed: a fixed count of samples a global batch, balanced over the
    group; budget: every rank filled to one cost budget. More: docs/data.md#several-sources."""
    group_size: int = 8
    """G: consecutive data-parallel ranks that share metadata (think: one node)."""
    max_wait: int = 2
    """budget: the most steps a sample may wait in the buffer."""
    lookahead: float = 2.0
    """budget: buffer size, in global batches' worth of samples per group."""
    cost_budget: float | None = None
    """budget: modelled cost per rank per step; default: the mean cost per sample of the first
    buffer fill (over all ranks) x global_batch_size / dp."""
    cost_scales: dict[str, float] | None = None
    """Per-term scales of the cost model (llm_quad, llm_lin, vision_quad, ...), as written by
    `ds-omni calibrate-cost`; default: FLOP formulas alone."""

    def __post_init__(self):
        if self.group_size < 1 or self.max_wait < 0 or self.lookahead < 1:
            raise ConfigError(f"data.reorder: need group_size >= 1, max_wait >= 0, lookahead >= 1; "
                              f"got {self.group_size}, {self.max_wait}, {self.lookahead}")


@dataclass(kw_only=True)
class VideoConfig:
    """How videos are sampled into frames and sized (the model's video processor does the rest)."""

    fps: float = 2.0
    """Frames sampled per second of video (evenly spaced), within the video processor's
    min_frames..max_frames and rounded down to a multiple of the temporal patch size."""
    num_frames: int | None = None
    """A fixed number of evenly spaced frames per video instead of `fps` (rounded to a multiple
    of the temporal patch size); a video with fewer frames is a bad sample."""
    max_frames: int | None = None
    """The most frames sampled from one video; default: the model's video processor's."""
    min_pixels: int | None = None
    """Fewest pixels per frame after resizing; default: the model's video processor's."""
    max_pixels: int | None = None
    """Most pixels per frame after resizing; default: the model's video processor's."""

    def __post_init__(self):
        bad = {k: v for k, v in (("fps", self.fps), ("num_frames", self.num_frames),
                                 ("max_frames", self.max_frames), ("min_pixels", self.min_pixels),
                                 ("max_pixels", self.max_pixels)) if v is not None and v <= 0}
        if bad:
            raise ConfigError(f"data.video: {bad} must be > 0")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.video: min_pixels={self.min_pixels} is more than max_pixels="
                              f"{self.max_pixels}")


@dataclass(kw_only=True)
class DataConfig:
    """Where samples come from and how they are packed."""

    sources: list[SourceConfig] = field(default_factory=list)
    """The sources to mix."""
    internvl_meta: str | None = None
    """An InternVL meta JSON ({name: {root, annotation, repeat_time, length}}): each entry is a
    source, weight length x repeat_time; a source of the same name in `sources` replaces it."""
    max_seq_len: int = 512
    """The most tokens one sample may have (images and audio expanded)."""
    pack_tokens: int | None = None
    """Token budget of one packed micro-batch; default max_seq_len x train.micro_batch_size."""
    overlong: Literal["error", "truncate"] = "error"
    """What to do with a sample longer than max_seq_len."""
    schedule: list[WeightPoint] = field(default_factory=list)
    """Mixing weights that change during training (piecewise by step, optional linear ramps)."""
    reorder: ReorderConfig = field(default_factory=ReorderConfig)
    """Cost balancing over data-parallel ranks."""
    chunk_rows: int = 1024
    """Rows per chunk: the unit a rank streams and the data state counts in."""
    seed: int = 0
    """Seed of the sample order."""
    image_aspect: Literal["crop", "pad", "resize"] = "crop"
    """Non-square images: "crop" leaves them to the processor's crop, "pad" pads to a square
    (LLaVA-1.5), "resize" stretches to a square. More: docs/data.md#chat-templates."""
    video: VideoConfig = field(default_factory=VideoConfig)
    """Frame sampling and frame size of videos (`schema.video` columns, `<video>` markers)."""
    max_image_pixels: int = PIL_MAX_IMAGE_PIXELS
    """An image of more pixels (width x height) is a bad sample, refused before it is decoded
    (default PIL's limit); raise it for huge images when the memory to decode them is there."""
    max_aspect_ratio: float = 5.0
    """`ds-omni data check` counts images whose long side is more than this times the short one."""
    max_bad_run: int = 1000
    """With on_bad_sample="skip": this many bad rows in a row from one source on one rank (or a
    whole source's worth, if fewer) is an error naming the source, not an endless search."""
    eval_sources: list[SourceConfig] = field(default_factory=list)
    """Validation data (same fields as `sources`; weight and on_exhausted unused): every row of
    every eval source, evaluated at each `train.eval_every` (ds_omni/train/evaluate.py)."""
    template: str = "auto"
    """Chat template: "model" (the tokenizer's), "plain" (USER: ... ASSISTANT: ...), a Jinja file's
    path, or "auto" ("model" when the tokenizer has one). More: docs/data.md#chat-templates."""
    prefetch_steps: int = 1
    """Steps loaded ahead while the current one trains (same samples, same order); 0 loads each step
    when due. More: docs/data.md#loading-ahead."""
    workers: int | Literal["auto"] = "auto"
    """Loader processes per rank: N >= 1 loads in a loader process plus N - 1 pack workers; 0 in the
    training process; "auto": 2 on a GPU host, else 0. More: docs/data.md#loading-ahead."""
    pin_cores: bool | Literal["auto"] = "auto"
    """Pin each rank's trainer, loader process and workers to cores of their own: "auto"/true when
    data.workers >= 1 and cores suffice; false: never. More: docs/data.md#loading-ahead."""
    shared_reading: bool = True
    """Under sp or tp > 1, one rank of each sp x tp group reads the rows and sends its peers
    their shards; false: every rank reads. More: docs/parallelism.md#sequence-parallelism."""

    def __post_init__(self):
        if self.internvl_meta:
            names = {s.name for s in self.sources}
            self.sources += [s for s in internvl_sources(self.internvl_meta) if s.name not in names]
        eval_names = [s.name for s in self.eval_sources]
        if len(set(eval_names)) != len(eval_names):
            raise ConfigError(f"data.eval_sources: names must be unique, got {eval_names}")
        if not self.sources:
            raise ConfigError("data.sources is empty: add at least one source (or an "
                              "internvl_meta file)")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.sources: names must be unique, got {names}")
        if self.max_seq_len < 8:
            raise ConfigError(f"data.max_seq_len must be >= 8, got {self.max_seq_len}")
        if self.chunk_rows < 1:
            raise ConfigError(f"data.chunk_rows must be >= 1, got {self.chunk_rows}")
        check_template_spec(self.template)
        if self.prefetch_steps < 0:
            raise ConfigError(f"data.prefetch_steps must be >= 0 (0: no prefetch), got "
                              f"{self.prefetch_steps}")
        if self.workers != "auto" and self.workers < 0:
            raise ConfigError(f"data.workers must be >= 0 (0: load in the training process), got "
                              f"{self.workers}")
        if self.max_aspect_ratio < 1 or self.max_bad_run < 1:
            raise ConfigError(f"data: need max_aspect_ratio >= 1 and max_bad_run >= 1; got "
                              f"{self.max_aspect_ratio}, {self.max_bad_run}")
        last = -1
        for i, point in enumerate(self.schedule):
            unknown = sorted(set(point.weights) - set(names))
            if unknown:
                raise ConfigError(f"data.schedule[{i}] names unknown source(s) {unknown}; sources "
                                  f"are {names}")
            if point.step <= last:
                raise ConfigError(f"data.schedule steps must increase; [{i}].step={point.step} "
                                  f"follows {last}")
            if any(w < 0 for w in point.weights.values()):
                raise ConfigError(f"data.schedule[{i}]: weights must be >= 0")
            last = point.step


TEMPLATE_KEYWORDS = ("auto", "model", "plain")


def check_template_spec(spec: str) -> None:
    """`data.template` is a keyword or an existing file."""
    if spec not in TEMPLATE_KEYWORDS and not Path(spec).is_file():
        raise ConfigError(f"data.template={spec!r} is neither one of {list(TEMPLATE_KEYWORDS)} nor "
                          "an existing Jinja file; give the path of a chat template file (e.g. a "
                          "model's chat_template.jinja), or \"model\" for the tokenizer's own")


def internvl_sources(path: str) -> list[SourceConfig]:
    """The sources of an InternVL meta JSON: per entry, its annotation file (LLaVA rows) with its
    `root` as the media root and weight length x repeat_time; relative paths are relative to the
    meta file's folder."""
    import json
    meta_path = Path(path)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.internvl_meta={path!r} cannot be read as JSON ({e})") from None
    if not isinstance(meta, dict) or not meta:
        raise ConfigError(f"data.internvl_meta={path!r} is not a JSON object of named datasets")
    out = []
    for name, entry in meta.items():
        where = f"data.internvl_meta {path!r} entry {name!r}"
        if not isinstance(entry, dict) or "annotation" not in entry:
            raise ConfigError(f"{where}: needs an 'annotation' file (and 'root', 'length', "
                              f"'repeat_time'); got {entry!r}")
        length, repeat = entry.get("length"), entry.get("repeat_time", 1)
        if not isinstance(length, (int, float)) or not isinstance(repeat, (int, float)):
            raise ConfigError(f"{where}: 'length' (rows of the annotation) and 'repeat_time' must "
                              f"be numbers, got {length!r}, {repeat!r}; the weight is their product")
        root = entry.get("root")
        out.append(SourceConfig(
            name=name, path=str(meta_path.parent / entry["annotation"]),
            weight=float(length) * float(repeat),
            schema=SchemaConfig(root=str(meta_path.parent / root) if root else None)))
    return out
