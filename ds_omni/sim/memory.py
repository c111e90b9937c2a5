"""Memory per rank: model states by ZeRO stage, and activations.

Mixed-precision Adam keeps, per trained parameter (Rajbhandari et al., ZeRO): the bf16 parameter
(2 bytes), its bf16 gradient (2) and the optimizer's fp32 master copy, momentum and variance
(12). A frozen parameter keeps its 2 bytes only. ZeRO partitions over the `dp` ranks that hold
replicas: stage 1 the optimizer state, stage 2 also the gradients, stage 3 also the parameters.
Under a pipeline a rank holds its stage's share of the parameters (`share`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_omni.errors import ConfigError

OPTIMIZER_BYTES = 12  # fp32 master + Adam's m and v


@dataclass(frozen=True)
class ModelStates:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


def model_states(params: float, trainable: float, dp: int, zero_stage: int,
                 bytes_per_param: int = 2) -> ModelStates:
    """Bytes of one rank's model states: `params` parameters of which `trainable` train,
    replicated over `dp` ranks and partitioned as `zero_stage` (0-3) says."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp < 1:
        raise ConfigError(f"the ZeRO partition needs dp >= 1, got {dp}")
    p = params * bytes_per_param / (dp if zero_stage >= 3 else 1)
    g = trainable * bytes_per_param / (dp if zero_stage >= 2 else 1)
    o = trainable * OPTIMIZER_BYTES / (dp if zero_stage >= 1 else 1)
    return ModelStates(p, g, o)


def gathered_bytes(largest_layer_params: float, zero_stage: int, bytes_per_param: int = 2,
                   prefetch_layers: int = 2) -> float:
    """ZeRO-3's working set: the layers gathered whole at once (the one running and the ones
    prefetched), on top of the rank's partition."""
    return largest_layer_params * bytes_per_param * prefetch_layers if zero_stage >= 3 else 0.0
