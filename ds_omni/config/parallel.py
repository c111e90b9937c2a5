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
    """Tensor-parallel degree of the LLM backbone (AutoTP): must divide its heads and MLP width.
    More: docs/parallelism.md#tensor-parallelism."""
    pp: int = 1
    """Pipeline stages of the LLM (DeepSpeed's pipeline engine; ZeRO 0/1, sp = 1); `ds-omni plan`
    prints the boundaries. More: docs/parallelism.md#pipeline-parallelism."""
    encoder_placement: Literal["stage0", "uniform"] = "stage0"
    """Under pp > 1, where encoders run: "stage0" (the first stage, as Megatron-LM) or "uniform"
    (every stage, a cost-balanced share). More: docs/parallelism.md#pipeline-parallelism."""
    stage_tokens: int = 0
    """Under pp > 1, tokens of a typical sample the stage boundaries are planned for; 0:
    data.max_seq_len. More: docs/parallelism.md#pipeline-parallelism."""
    stage_split: StageSplit = "cost"
    """Under pp > 1, how stages are cut: "cost" (the cost model), or the baselines "parameters"
    (DeepSpeed's) and "layers" (Megatron-LM's). More: docs/parallelism.md#pipeline-parallelism."""
    max_sequence_sp: int = 1
    """Per-sequence SP (ByteScale): > 1 lets a costly sequence run on a Ulysses group of up to this
    many ranks (a power of two). More: docs/parallelism.md#a-per-sequence-sp."""
    encoder_sp: float | Literal["auto", "off"] = "auto"
    """Long-short SP for encoders: an item costlier than this is encoded by its SP group; "auto":
    one rank's share; "off": never. More: docs/parallelism.md#long-short-sp."""
    encoder_pool: Literal["off", "dp"] = "off"
    """"off": each row's items are encoded by its rank; "dp": each round's items are spread over all
    ranks by modelled cost (pays under ZeRO-3). More: docs/parallelism.md#encoder-pool."""

    ep: int = 1
    """Expert-parallel degree of an MoE LLM (AutoEP): must divide dp x sp and the experts count.
    More: docs/parallelism.md#expert-parallelism."""

    @property
    def tp_encodes_apart(self) -> bool:
        """Under tp the TP ranks of a row encode different items of it (and sum the encoders'
        gradients over TP), unless another plan already spreads the row's items: the SP ranks
        under sp > 1 (each TP rank then encodes its SP rank's share), the pool's ranks under
        encoder_pool (each TP rank's pool)."""
        return self.tp > 1 and self.sp == 1 and self.encoder_pool == "off"

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
