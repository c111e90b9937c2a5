"""The top-level `OmniConfig`: one run's sections, the schema version, and the checks that span
sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ds_omni.config.data import DataConfig
from ds_omni.config.model import ModelConfig
from ds_omni.config.parallel import ParallelConfig
from ds_omni.config.train import TrainConfig
from ds_omni.errors import ConfigError

SCHEMA_VERSION = 1


@dataclass(kw_only=True)
class OmniConfig:
    """A whole run."""

    model: ModelConfig
    """The model: an HF MLLM directory, or encoders and an LLM to compose (the `model` table)."""
    data: DataConfig
    """The sources, their mixing, cost balancing and packing (the `data` table)."""
    train: TrainConfig
    """Steps, batch sizes, optimizer settings, checkpoints and logging (the `train` table)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The degrees of the parallel plan and where the encoders run (the `parallel` table)."""
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
