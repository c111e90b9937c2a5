"""The parallel section: the degrees of the LLM's plan (dp, sp, pp, per-sequence SP) and where the
encoders run; `ds_omni/parallel/plan.py` derives the plan from it and the world size."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from ds_omni.errors import ConfigError

StageSplit = Literal["cost", "parameters", "layers"]  # parallel.stage_split (parallel/stages.py)


@dataclass(kw_only=True)
class ParallelConfig:
    """Degrees of the LLM's parallel plan; their product must equal the world size."""

    dp: int | Literal["auto"] = "auto"
    """Data-parallel degree; "auto" takes what the world size leaves after sp and pp."""
    sp: int = 1
    """Ulysses sequence-parallel degree of the LLM."""
    tp: int = 1
    """Tensor-parallel degree of the LLM backbone (DeepSpeed's AutoTP training layers): each
    decoder layer's attention and MLP projections are split over tp neighbouring ranks, which
    read the same rows; the embedding, norms, head and every encoder stay whole on each rank.
    For a backbone too large for one device's memory, or to cut its per-rank time when the
    data-parallel degree is already at its useful limit. tp must divide the backbone's attention
    and key-value heads and MLP width (`ds-omni plan` names the degrees that work). With
    sp > 1 each TP rank's heads (heads / tp) are split again over its Ulysses group, so tp x sp
    must divide the query heads and tp the key-value heads. ZeRO 0-2, pp = 1 and
    max_sequence_sp = 1 in this version, and encoder_pool only without sp (each TP rank then
    pools over its own data-parallel ranks)."""
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

    ep: int = 1
    """Expert-parallel degree of an MoE LLM (DeepSpeed's AutoEP): each MoE layer's experts are
    split over groups of ep consecutive ranks of the dp x sp ranks (as DeepSpeed's MoE groups are
    drawn), tokens reach their experts by all-to-all, and HF's router (top-k, normalisation, the
    auxiliary load-balancing loss, summed over a sample's SP shards, shared experts) is kept.
    Must divide dp x sp and the experts; the LLM's family needs an AutoEP preset (`ds-omni plan`
    names them). Combines with sp (ZeRO 1 or 2) and max_sequence_sp; tp = pp = 1 in this
    version."""

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
        for name in ("sp", "tp", "pp", "max_sequence_sp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        d = self.max_sequence_sp
        if d & (d - 1):
            raise ConfigError(f"parallel.max_sequence_sp must be a power of two, got {d}")
        if d > 1 and (self.sp > 1 or self.pp > 1):
            raise ConfigError("parallel.max_sequence_sp > 1 chooses an SP degree per sequence; it "
                              f"cannot be combined with a static parallel.sp={self.sp} or "
                              f"parallel.pp={self.pp} in this version: set those to 1")
        if self.tp > 1 and (self.pp > 1 or d > 1):
            raise ConfigError(
                f"parallel.tp={self.tp} cannot be combined with parallel.pp={self.pp} or "
                f"parallel.max_sequence_sp={d} in this version (DeepSpeed's pipeline engine has "
                "no AutoTP path, and per-sequence SP blocks are runs of consecutive ranks, which "
                "tp would cut across): set those to 1, or tp to 1 (a static parallel.sp works "
                "with tp)")
        if self.tp > 1 and self.sp > 1 and self.encoder_pool != "off":
            raise ConfigError(f"parallel.encoder_pool={self.encoder_pool!r} with both parallel.tp="
                              f"{self.tp} and parallel.sp={self.sp} is not supported in this "
                              "version (the pool runs with tp or with sp): set encoder_pool to "
                              "\"off\", or tp or sp to 1")
        if self.dp != "auto" and self.dp < 1:
            raise ConfigError(f"parallel.dp must be >= 1 or \"auto\", got {self.dp}")
