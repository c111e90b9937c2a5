"""Non-finite loss or gradients: no NaN ever reaches the weights or the optimizer state.

A `NonFiniteGuard` watches every micro-batch's loss and every gradient as autograd makes it (a
hook per trainable parameter keeping one `torch.aminmax`, which shows NaN and inf and cannot
overflow; four small ops there cost a tiny step 7 % of its CPU). The flag stays on the device and
is all-reduced once after the step's last backward, so every rank decides the same before the
optimizer runs. `train.on_nonfinite`: "stop" ends the run naming the step's samples; "skip" drops
the update (weights, optimizer state and LR schedule unchanged; under ZeRO through DeepSpeed's own
overflow path) and records the samples. Under fp16 only the loss is watched (the loss scaler owns
inf gradients). More: docs/fault_tolerance.md.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ds_omni.errors import DsOmniError
from ds_omni.parallel import dist

POLICIES = ("stop", "skip")


class NonFiniteError(DsOmniError):
    """A step's loss or gradients were NaN/inf and train.on_nonfinite is "stop"."""


class NonFiniteGuard:
    def __init__(self, engine, policy: str = "stop"):
        if policy not in POLICIES:
            raise ValueError(f"unknown on_nonfinite policy {policy!r}; choose one of {POLICIES}")
        self.engine, self.policy = engine, policy
        self.flag = torch.zeros((), dtype=torch.bool, device=engine.device)
        self._extremes: list[torch.Tensor] = []  # gradients' (min, max) not yet checked
        self._hooks = []
        if not engine.fp16_enabled():
            self._hooks = [p.register_hook(self._watch) for p in engine.module.parameters()
                           if p.requires_grad]
        optimizer = getattr(engine, "optimizer", None)
        if policy == "skip" and hasattr(optimizer, "check_grad_overflow"):
            optimizer.check_grad_overflow = True  # ZeRO 1/2 under bf16 would apply a NaN step

    def _watch(self, grad: torch.Tensor) -> None:
        if grad.numel():
            self._extremes.extend(torch.aminmax(grad))

    def _check_gradients(self) -> None:
        """The gradients seen since the last check, folded into the flag (one stack: dtypes
        promote)."""
        if self._extremes:
            self.flag |= ~torch.isfinite(torch.stack(self._extremes)).all()
            self._extremes = []

    def watch_loss(self, loss: torch.Tensor) -> None:
        self._check_gradients()  # the previous micro-batch's: the list stays one backward long
        self.flag |= ~torch.isfinite(loss.detach()).all()

    def tripped(self) -> bool:
        """Whether any rank saw a non-finite loss or gradient this step (collective; resets)."""
        self._check_gradients()
        (bad,) = dist.all_reduce_max([float(self.flag)])
        self.flag.zero_()
        return bool(bad)

    @contextmanager
    def dropped_update(self):
        """Run the engine's boundary `step()` inside this: the update is not applied."""
        engine = self.engine
        if engine.zero_optimization_stage() > 0:
            yield  # DeepSpeed sees the non-finite gradient norm and skips the step itself
            if engine.was_step_applied():
                raise NonFiniteError("DeepSpeed applied an update the non-finite check had flagged; "
                                     "set train.on_nonfinite to \"stop\" for this setup")
            return
        if engine.fp16_enabled() or engine.bfloat16_enabled():
            raise NonFiniteError("train.on_nonfinite=\"skip\" needs ZeRO (stage >= 1) or fp32 "
                                 "training; set it to \"stop\" or use a ZeRO config")
        optimizer, scheduler = engine.optimizer, engine.lr_scheduler
        optimizer.step = lambda *args, **kwargs: None  # this instance only, for this call
        iteration = getattr(scheduler, "last_batch_iteration", None)
        try:
            yield
        finally:
            del optimizer.step
        if iteration is not None:  # as under ZeRO: a dropped update does not advance the schedule
            scheduler.step(iteration)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
