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

    text: str = "conversations"
    """Column with a LLaVA-style conversation (list of {"from", "value"}) or plain text."""
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
    """Local file, glob or directory (parquet, jsonl, arrow, webdataset .tar, save_to_disk);
    "builtin:shapes" for the embedded demo data, made from a seed at first use."""
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
    """A corrupt or missing image, unreadable audio, empty text or mismatched markers: stop with a
    message naming the sample, or skip it (its id and the reason go to
    <output_dir>/skipped.jsonl, the count per source to the console, metrics and report)."""

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
    """loader_order: no balancing; fixed: a fixed number of samples per global batch, moved
    between the ranks and micro-batches of a group; budget: every rank fills its micro-batches to
    the same cost budget from a lookahead buffer its group shares."""
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

    sources: list[SourceConfig]
    """The sources to mix."""
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
    """Images that are not square: "crop" leaves them to the model's processor (CLIP centre-crops
    to a square, losing the ends of a wide image), "pad" pads them to a square with the
    processor's mean colour first (LLaVA-1.5), "resize" stretches them to a square of the same
    area."""
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
    """Chat template conversations are rendered with: "model" (the tokenizer's own chat_template,
    as apply_chat_template renders it; assistant turns and their end-of-turn token are trained
    on), "plain" (USER: ... ASSISTANT: ..., for tokenizers without a template), the path of a
    Jinja file, or "auto": "model" when the tokenizer has a template, else "plain". Checkpoints
    and HF exports carry the template used."""
    prefetch_steps: int = 1
    """Steps whose batches are read, processed and packed while the current step trains (a
    background thread, or the loader process with `workers` >= 1, which also sends the next one
    before it is asked for; same samples, same order); 0 loads each step when it is due."""
    workers: int | Literal["auto"] = "auto"
    """Processes per rank that load: N >= 1 runs the whole loader (reading, balancing with its
    all-gathers, the state, the step-ahead loop) in one loader process per rank, plus N - 1
    that decode, process (HF processors) and pack for it (`ds_omni/data/loader_process.py`);
    the training process only receives finished micro-batches, the same as with 0. 0: the
    training process (or its prefetch thread) loads, sharing the interpreter's lock with the
    training step. "auto": 0 without a GPU, else 2 per rank (the shipped processors feed one
    H200 with at most 1.5 cores: docs/benchmarks/feed_rate.md), at most the host's cores per
    rank minus one."""
    pin_cores: bool | Literal["auto"] = "auto"
    """Hold each process of a rank to cores of its own (`ds_omni/data/cores.py`): each local rank
    (LOCAL_RANK of LOCAL_WORLD_SIZE, or the deepspeed launcher's LOCAL_SIZE) takes its slice of
    the cores the process may use; in it the loader process gets one core, each pack worker one
    and the trainer the rest, torch's threads set to match. "auto" and true: pin when
    data.workers >= 1 and every process gets a core (else nothing is pinned and the log says why;
    a warning with true); false: never. Nothing is pinned on a platform without
    os.sched_setaffinity (macOS, Windows), nor where the launcher did not say how many ranks
    share the node. A launcher that already binds each rank to its own cores (deepspeed
    --bind_cores_to_rank) leaves a rank too few to slice again: set false there."""
    shared_reading: bool = True
    """Under parallel.sp or parallel.tp > 1: the first of the ranks that train on the same rows
    (the sp x tp ranks of a data-parallel rank) reads, decodes and packs them once and sends each
    peer its token shard (a TP rank: its SP rank's) and the inputs of only the items it encodes
    (over a gloo group of the loader's own, `ds_omni/data/shared_read.py`); false: every rank
    reads and processes every row itself. The batches, the samples and the loader state are the
    same either way."""

    def __post_init__(self):
        eval_names = [s.name for s in self.eval_sources]
        if len(set(eval_names)) != len(eval_names):
            raise ConfigError(f"data.eval_sources: names must be unique, got {eval_names}")
        if not self.sources:
            raise ConfigError("data.sources is empty: add at least one source")
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
