"""The one typed source of truth for a ds_omni run.

A run is described by an `OmniConfig` (model, data, parallel plan, training) read strictly from
JSON: unknown keys are an error that lists them, a value of the wrong type an error that names the
field. The DeepSpeed fields that follow from it (batch sizes, gradient accumulation, scheduler
length) are derived in `derive_ds_config`, and merged with the user's DeepSpeed JSON; a value the
user wrote that disagrees with the derived one is an error, never a silent override.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ds_omni.errors import ConfigError

SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------- model
@dataclass(kw_only=True)
class PartConfig:
    """One HuggingFace model part: loaded from a directory, or built (random init) from a config."""

    pretrained: str | None = None
    """Directory written by `save_pretrained`; weights load through safetensors."""
    config: dict[str, Any] | None = None
    """HF config fields including "model_type", for a randomly initialised part."""

    def __post_init__(self):
        if (self.pretrained is None) == (self.config is None):
            raise ConfigError("a model part needs exactly one of 'pretrained' (a directory) or "
                              f"'config' (HF config fields); got pretrained={self.pretrained!r}, "
                              f"config={'set' if self.config is not None else None}")
        if self.config is not None and "model_type" not in self.config:
            raise ConfigError("a model part's 'config' needs a 'model_type' (e.g. \"llama\", "
                              f"\"clip_vision_model\"); got keys {sorted(self.config)}")


FREEZABLE = ("vision", "audio", "projector", "llm")
CHECKPOINTABLE = ("llm", "vision", "audio")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters through peft on the linear layers of some parts; the rest of the model is
    frozen, except the parts named in `trainable` (ds_omni/model/lora.py)."""

    rank: int = 8
    """r: the adapters' inner dimension."""
    alpha: float = 16.0
    """lora_alpha: the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linear layers that get adapters, by name or name suffix ("q_proj", "mlp.down_proj"), or
    "all-linear" for every linear layer of `parts` (the LM head excepted)."""
    parts: list[str] = field(default_factory=lambda: ["llm"])
    """Parts whose layers get adapters: any of llm, projector, vision, audio."""
    trainable: list[str] = field(default_factory=list)
    """Parts trained in full next to the adapters (e.g. ["projector"]); all others are frozen."""
    export: Literal["merged", "adapter"] = "merged"
    """Final export: "merged" (adapters folded into the weights; plain transformers loads it) or
    "adapter" (the base model with the `trainable` parts, plus adapter/ for PeftModel)."""

    def __post_init__(self):
        if self.rank < 1 or not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora: need rank >= 1, alpha > 0, 0 <= dropout < 1; got "
                              f"{self.rank}, {self.alpha}, {self.dropout}")
        for name in ("parts", "trainable"):
            bad = sorted(set(getattr(self, name)) - set(FREEZABLE))
            if bad:
                raise ConfigError(f"model.lora.{name}: unknown part(s) {bad}; choose from "
                                  f"{list(FREEZABLE)}")
        if not self.parts or not self.target_modules:
            raise ConfigError("model.lora: parts and target_modules must not be empty (defaults: "
                              "[\"llm\"] and [\"all-linear\"])")
        both = sorted(set(self.parts) & set(self.trainable))
        if both:
            raise ConfigError(f"model.lora: {both} in both parts (adapters) and trainable (full "
                              "training); a part gets one or the other")


@dataclass(kw_only=True)
class ModelConfig:
    """The multimodal model: an HF MLLM directory, or a composition of encoders and an LLM."""

    pretrained: str | None = None
    """An HF MLLM directory (LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2-Audio, or a ds_omni export)."""
    llm: PartConfig | None = None
    """Composition: the causal LM backbone (Llama, Qwen2, ...)."""
    vision: PartConfig | None = None
    """Composition: the vision encoder (CLIP or SigLIP vision model)."""
    audio: PartConfig | None = None
    """Composition: the audio encoder (a Whisper encoder)."""
    projector: Literal["mlp2x_gelu", "linear"] = "mlp2x_gelu"
    """Composition: the projector from encoder width to LLM width."""
    image_token: str = "<image>"
    """Composition: the tokenizer token whose embedding slots take image embeddings."""
    audio_token: str = "<audio>"
    """Composition: the tokenizer token whose embedding slots take audio embeddings."""
    tokenizer: str | None = None
    """Tokenizer directory, or "builtin:shapes" for the demo tokenizer; default: the model's."""
    freeze: list[str] = field(default_factory=list)
    """Parts that get no gradient and no optimizer state: any of vision, audio, projector, llm."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype as built; DeepSpeed's bf16 section decides the training precision."""
    attn_implementation: Literal["auto", "varlen", "sdpa", "flash_attention_2", "eager"] = "auto"
    """Attention kernel of the LLM over packed rows. auto: torch's varlen flash kernel on CUDA when
    torch has it, else SDPA per sample; varlen: torch's (CUDA only); flash_attention_2: the
    flash-attn package (the `gpu` extra); sdpa / eager: one SDPA call per sample (same numbers)."""
    activation_checkpointing: bool | list[Literal["llm", "encoders", "vision", "audio"]] = False
    """Recompute transformer layers in backward instead of keeping their activations (memory for
    long rows and many images, at about a third more compute of the parts named): true for every
    part, or a list of "llm" (the decoder layers), "encoders" (every encoder's layers), "vision",
    "audio". Non-reentrant, so it works under ZeRO-3; the numbers are the same as without it."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model directory. Off unless you trust the directory."""
    seed: int = 0
    """Seed for random initialisation of parts built from configs (and of LoRA adapters)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (peft) instead of the whole model; see `LoraConfig`."""

    def __post_init__(self):
        if (self.pretrained is None) == (self.llm is None):
            raise ConfigError("model: set exactly one of 'pretrained' (an HF MLLM directory) or 'llm' "
                              "(compose a model from an LLM and encoders)")
        if self.pretrained is not None and (self.vision or self.audio):
            raise ConfigError("model: 'vision'/'audio' compose a new model; with 'pretrained' the "
                              "encoders come from the directory. Remove one of them.")
        bad = sorted(set(self.freeze) - set(FREEZABLE))
        if bad:
            raise ConfigError(f"model.freeze: unknown part(s) {bad}; choose from {list(FREEZABLE)}")
        if self.lora and self.freeze:
            raise ConfigError(f"model.freeze={self.freeze} with model.lora: under LoRA every part "
                              "outside model.lora.trainable is frozen already; remove model.freeze")

    def frozen_parts(self) -> list[str]:
        """Parts without gradients: `freeze`, or under LoRA those with neither adapters nor
        full training."""
        if self.lora is None:
            return list(self.freeze)
        return [p for p in FREEZABLE if p not in self.lora.parts + self.lora.trainable]

    def checkpointed_parts(self) -> set[str]:
        """The parts whose layers `activation_checkpointing` recomputes: of llm, vision, audio."""
        asked = self.activation_checkpointing
        if isinstance(asked, bool):
            return set(CHECKPOINTABLE) if asked else set()
        parts = set(asked) - {"encoders"}
        return parts | ({"vision", "audio"} if "encoders" in asked else set())


# ---------------------------------------------------------------------------------------- data
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
    """Steps whose batches a background thread reads, processes and packs while the current step
    trains (same samples, same order); 0 loads each step when it is due."""
    workers: int = 0
    """Processes per rank that decode, process (HF processors) and pack the micro-batches
    (`ds_omni/data/workers.py`); reading, balancing and the loader state stay in the training
    process, so the batches are the same. 0: the training process (or its prefetch thread) does
    it, sharing the interpreter's lock with the training step. On a GPU host, 1-4 per rank keep
    the step's host thread free."""

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
        if self.workers < 0:
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


# ------------------------------------------------------------------------------------ parallel
StageSplit = Literal["cost", "parameters", "layers"]  # parallel.stage_split (parallel/stages.py)


@dataclass(kw_only=True)
class ParallelConfig:
    """Degrees of the LLM's parallel plan; their product must equal the world size."""

    dp: int | Literal["auto"] = "auto"
    """Data-parallel degree; "auto" takes what the world size leaves after sp and pp."""
    sp: int = 1
    """Ulysses sequence-parallel degree of the LLM."""
    pp: int = 1
    """Pipeline stages of the LLM (DeepSpeed's pipeline engine; ZeRO 0/1 only, sp = 1). Stage
    boundaries come from the cost model unless stage_split says otherwise (`ds-omni plan` prints
    them and each stage's time)."""
    encoder_placement: Literal["stage0", "uniform"] = "stage0"
    """Under pp > 1, where the encoders run: "stage0" on the first stage's ranks (as Megatron-LM
    and NeMo do); "uniform" on every stage's ranks, each encoding a share of the step's items
    balanced by modelled cost (MegaScale-Omni's joint pipeline)."""
    stage_tokens: int = 0
    """Under pp > 1, the tokens of a typical sample (one item per encoder) that the stage
    boundaries are planned for; 0: data.max_seq_len. Full-length samples weigh the LLM most, so
    for short samples (image captions) "stage0" would keep too many decoder layers on stage 0:
    give their typical length (e.g. the mean `tokens` per sample of a few logged steps)."""
    stage_split: StageSplit = "cost"
    """Under pp > 1, how the stage boundaries are chosen: "cost", by the cost model, for the
    smallest slowest-stage time (encoder work included); "parameters", DeepSpeed's default
    (`partition_method="parameters"`: trainable parameter counts balanced, the encoders counted
    on the first stage under "stage0"); "layers", Megatron-LM's (decoder layers split evenly,
    embedding on the first stage, head on the last). The last two are baselines: `ds-omni plan`
    prints each stage's predicted time under the split chosen, to compare them."""
    max_sequence_sp: int = 1
    """Per-sequence SP degree (ByteScale's hybrid data parallelism): > 1 lets a sequence that
    costs more than one rank's share of the step, or is longer than a micro-batch, run on a
    Ulysses group of 2, 4, ... up to this many ranks (a power of two, inside a reorder group),
    while every other sequence runs whole on one rank. Needs sp = 1, pp = 1 and reordering."""
    encoder_sp: float | Literal["auto", "off"] = "auto"
    """Long-short SP for encoders, inside every group of ranks that shares one row (parallel.sp, or a
    per-sequence block): an image or audio item whose modelled encoder cost is above this threshold
    is encoded by the whole group, with Ulysses attention inside the encoder; the others run whole,
    one rank each. "auto": above one rank's share of the row's encoder work; a number: a cost in
    the cost model's units (an item's modelled training FLOPs, rescaled by
    data.reorder.cost_scales when calibrated); "off": never split."""
    encoder_pool: Literal["off", "dp"] = "off"
    """Where each micro-batch round's images and clips are encoded: "off", by the rank whose row
    holds them; "dp", spread over all data-parallel ranks by modelled cost (LPT; an item stays
    home unless moving it evens the round), its inputs sent to the encoding rank and its
    embeddings sent back (two all-to-alls a round). Pays under ZeRO-3, whose parameter gathers
    make every round wait for the busiest rank's encoder; ZeRO 0-2 ranks meet once a step, where
    data.reorder already evens the whole cost. Under sp > 1 the pool is every rank (dp x sp):
    each row's long items stay split over its SP group (encoder_sp), its short items go to any
    rank, their rows to the shards holding their placeholders; under max_sequence_sp > 1 the
    same over each round's groups (a long sequence's block, the other ranks alone; ranks idle in
    a round take short items of busy ones). Needs pp = 1."""

    def __post_init__(self):
        if self.encoder_pool not in ("off", "dp"):
            raise ConfigError(f"parallel.encoder_pool must be \"off\" or \"dp\", got "
                              f"{self.encoder_pool!r}")
        if self.encoder_pool == "dp" and self.pp > 1:
            raise ConfigError(
                "parallel.encoder_pool=\"dp\" spreads the items of rows held by one rank or by "
                "an SP group; it cannot be combined with pipeline stages in this version "
                f"(pp={self.pp}): set encoder_pool to \"off\" (encoder_placement \"uniform\" "
                "balances encoders over the stages there) or pp to 1")
        if isinstance(self.encoder_sp, str) and self.encoder_sp not in ("auto", "off"):
            raise ConfigError(f"parallel.encoder_sp must be \"auto\", \"off\" or a cost threshold "
                              f"(a number >= 0), got {self.encoder_sp!r}")
        if not isinstance(self.encoder_sp, str) and not self.encoder_sp >= 0:
            raise ConfigError(f"parallel.encoder_sp must be a cost threshold >= 0, \"auto\" or "
                              f"\"off\", got {self.encoder_sp}")
        if self.stage_split not in typing.get_args(StageSplit):
            raise ConfigError(f"parallel.stage_split must be one of "
                              f"{list(typing.get_args(StageSplit))} (\"cost\": "
                              f"ds_omni's cost model; \"parameters\": DeepSpeed's default; "
                              f"\"layers\": Megatron-LM's), got {self.stage_split!r}")
        if self.stage_tokens < 0:
            raise ConfigError(f"parallel.stage_tokens must be >= 0 (0: data.max_seq_len), got "
                              f"{self.stage_tokens}")
        for name in ("sp", "pp", "max_sequence_sp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        d = self.max_sequence_sp
        if d & (d - 1):
            raise ConfigError(f"parallel.max_sequence_sp must be a power of two, got {d}")
        if d > 1 and (self.sp > 1 or self.pp > 1):
            raise ConfigError("parallel.max_sequence_sp > 1 chooses an SP degree per sequence; it "
                              f"cannot be combined with a static parallel.sp={self.sp} or "
                              f"parallel.pp={self.pp} in this version: set those to 1")
        if self.dp != "auto" and self.dp < 1:
            raise ConfigError(f"parallel.dp must be >= 1 or \"auto\", got {self.dp}")


# --------------------------------------------------------------------------------------- train
@dataclass(kw_only=True)
class TrainConfig:
    """The training loop."""

    steps: int
    """Optimizer steps."""
    global_batch_size: int
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 1
    """Samples per micro-batch on one rank (packed into one sequence)."""
    lr: float = 1e-4
    """Peak learning rate (fills "auto" in the DeepSpeed optimizer and scheduler)."""
    weight_decay: float = 0.0
    """AdamW weight decay (fills "auto" in the DeepSpeed optimizer)."""
    warmup_steps: int = 0
    """Linear warm-up steps of the scheduler."""
    seed: int = 0
    """Seed for dropout and other randomness during training."""
    output_dir: str = "outputs/run"
    """Checkpoints, metrics, report and the exported model go here."""
    save_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradients are NaN/inf: "stop" ends the run naming its samples; "skip"
    drops its update (weights, optimizer state untouched) and records its samples in metrics."""
    peer_timeout_s: float = 90.0
    """A rank that stops sending heartbeats (killed, stopped, node lost) or hangs outside any
    collective while the others wait for it this long ends the whole job, naming it (0: off)."""
    log_every: int = 1
    """Write metrics every N steps."""
    export_hf: bool = True
    """Export the final model as a HuggingFace directory."""
    log_samples: bool = False
    """Write the keys of every trained sample into metrics.jsonl (for audits and tests)."""
    eval_every: int = 0
    """Evaluate data.eval_sources every N steps and after the last (0: after the last only)."""

    def __post_init__(self):
        for name in ("steps", "global_batch_size", "micro_batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "keep_checkpoints", "warmup_steps", "weight_decay",
                     "eval_every", "peer_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"train.on_nonfinite must be \"stop\" or \"skip\", got "
                              f"{self.on_nonfinite!r}")


@dataclass(kw_only=True)
class OmniConfig:
    """A whole run."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    version: int = SCHEMA_VERSION
    """Config schema version."""

    def __post_init__(self):
        if self.version != SCHEMA_VERSION:
            raise ConfigError(f"config version {self.version} is not supported; this ds_omni reads "
                              f"version {SCHEMA_VERSION}")
        data, longest = self.data, self.parallel.max_sequence_sp
        if data.pack_tokens is not None and data.pack_tokens * longest < data.max_seq_len:
            hint = "" if longest > 1 else " (or let long ones run on several ranks: " \
                "parallel.max_sequence_sp)"
            raise ConfigError(f"data.pack_tokens={data.pack_tokens} x parallel.max_sequence_sp="
                              f"{longest} is below data.max_seq_len={data.max_seq_len}: a long "
                              f"sample would fit no micro-batch; raise pack_tokens{hint}")
        if self.train.eval_every and not self.data.eval_sources:
            raise ConfigError(f"train.eval_every={self.train.eval_every} but data.eval_sources is "
                              "empty: add the validation data there (same fields as data.sources), "
                              "or set train.eval_every to 0")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------ strict loading
def load_config(path: str | Path, overrides: list[str] | None = None) -> OmniConfig:
    """Read an `OmniConfig` from a JSON file; `overrides` are "a.b.c=value" strings (JSON values)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass --config with a JSON file "
                          "such as examples/tiny_llava.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    for item in overrides or []:
        _apply_override(data, item)
    return from_dict(OmniConfig, data)


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass `cls` from plain data, rejecting unknown keys and wrongly typed values."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where or 'config'}; "
                          f"valid keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, _join(where, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        raise ConfigError(f"{where or 'config'} is missing required key(s) {missing}") from e


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _coerce(tp: Any, value: Any, where: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(typing.get_args(tp), value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where} must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be an object, got {value!r}")
        return value
    if tp is Any:
        return value
    return _coerce_scalar(tp, value, where)


def _coerce_union(options: tuple, value: Any, where: str):
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{where} must not be null")
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _coerce(option, value, where)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(" or ".join(errors))


def _coerce_scalar(tp: type, value: Any, where: str):
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{where} must be {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value
