"""The parallel section: the degrees of the LLM's plan (dp, sp, pp, per-sequence SP) and where the
encoders run; `ds_omni/parallel/plan.py` derives the plan from it and the world size."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from ds_omni.config.composition import check_composition
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
    """Tensor-parallel degree of the LLM backbone (AutoTP): must divide its heads and MLP width.
    More: docs/parallelism.md#tensor-parallelism."""
    pp: int = 1
    """Pipeline stages of the LLM (DeepSpeed's pipeline engine; ZeRO 0/1, sp = 1); `ds-omni plan`
    prints the boundaries. More: docs/parallelism.md#pipeline-parallelism."""
    encoder_placement: Literal["stage0", "uniform", "bubbles", "auto"] = "stage0"
    """Under pp > 1, where encoders run: "stage0" (Megatron-LM), "uniform" (each stage a share),
    "bubbles" (in idle slots) or "auto" (the cost model's pick). More: docs/parallelism.md."""
    stage_tokens: int = 0
    """Under pp > 1, tokens of a typical sample the stage boundaries are planned for; 0:
    data.max_seq_len. More: docs/parallelism.md#pipeline-parallelism."""
    stage_split: StageSplit = "cost"
    """Under pp > 1, how stages are cut: "cost" (the cost model), or the baselines "parameters"
    (DeepSpeed's) and "layers" (Megatron-LM's). More: docs/parallelism.md#pipeline-parallelism."""
    max_sequence_sp: int = 1
    """Per-sequence SP (ByteScale): > 1 lets a costly sequence run on a block of up to this many
    ranks (a power of two; ring past the heads). More: docs/parallelism.md#a-per-sequence-sp."""
    encoder_sp: float | Literal["auto", "off"] = "auto"
    """Long-short SP for encoders: an item costlier than this is encoded by its SP group; "auto":
    one rank's share; "off": never. More: docs/parallelism.md#long-short-sp."""
    encoder_pool: Literal["off", "dp"] = "off"
    """"off": each row's items are encoded by its rank; "dp": each round's items are spread over all
    ranks by modelled cost (pays under ZeRO-3). More: docs/parallelism.md#encoder-pool."""

    cp: int = 1
    """Ring attention: each row split over sp x cp ranks, a ring of cp across the Ulysses groups
    (no head limit). More: docs/parallelism.md#ring-attention-parallelcp."""

    ep: int = 1
    """Expert-parallel degree of an MoE LLM (AutoEP): must divide dp x sp and the experts count.
    More: docs/parallelism.md#expert-parallelism."""

    def __post_init__(self):
        if self.encoder_pool not in ("off", "dp"):
            raise ConfigError(f"parallel.encoder_pool must be \"off\" or \"dp\", got "
                              f"{self.encoder_pool!r}")
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
        for name in ("sp", "tp", "pp", "max_sequence_sp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        d = self.max_sequence_sp
        if d & (d - 1):
            raise ConfigError(f"parallel.max_sequence_sp must be a power of two, got {d}")
        if self.dp != "auto" and self.dp < 1:
            raise ConfigError(f"parallel.dp must be >= 1 or \"auto\", got {self.dp}")
        check_composition(self, launch=False)  # the pairs: config/composition.py
