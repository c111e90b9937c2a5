"""The train section: steps, batch sizes, optimizer settings, checkpoints, logging, evaluation."""

from __future__ import annotations

from dataclasses import dataclass

from ds_omni.errors import ConfigError


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
    overwrite_output_dir: bool = False
    """Start a new run (no --resume) in an output_dir that holds another run's checkpoints; they
    are kept but never resumed. Without it such a start is refused."""
    save_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""
    save_whole_moments: bool = True
    """Each save also writes Adam's moments whole (a stage's first rank holds its stage's, twice in
    fp32), so --resume on another pp/tp/ep continues exactly; False: it restarts them."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradients are NaN/inf: "stop" ends the run naming its samples; "skip"
    drops its update (weights, optimizer state untouched) and records its samples in metrics."""
    peer_timeout_s: float = 90.0
    """Seconds a rank may go silent (killed, stopped, hung outside a collective) before the job ends
    naming it; 0: off. More: docs/fault_tolerance.md#a-dead-or-hung-rank."""
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
