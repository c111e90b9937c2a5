"""A stand-in for DeepSpeed's engine where a test needs the trainer's logic, not the model's math."""

from __future__ import annotations

from pathlib import Path

import torch

from ds_omni.model.omni import LossOutput


class FakeEngine:
    """What `train_step`, the training loop and `checkpoint.save` / `load` call on an engine.

    The loss of a micro-batch is `loss_per_target` x its targets; `trained` lists the sample ids of
    every micro-batch a step ran forward on.
    """

    device = "cpu"
    lr_scheduler = None

    def __init__(self, loss_per_target: float = 1.0):
        self.loss_per_target = loss_per_target
        self.module = torch.nn.Linear(1, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.trained: list[list[str]] = []
        self.steps = 0

    def __call__(self, mb) -> LossOutput:
        self.trained.append(list(mb.sample_ids))
        return LossOutput(torch.tensor(self.loss_per_target * mb.num_targets), mb.num_targets)

    def backward(self, loss, scale_wrt_gas=True):
        pass

    def step(self):
        self.steps += 1

    def get_lr(self):
        return [1e-3]

    def zero_optimization_stage(self) -> int:
        return 0

    def fp16_enabled(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return False

    def save_checkpoint(self, root, tag, save_latest=True):
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)
        (Path(root) / tag / "mp_rank_00_model_states.pt").write_bytes(b"weights" * 100)
        if save_latest:
            (Path(root) / "latest").write_text(tag)

    def load_checkpoint(self, root, tag, **_):
        return str(Path(root) / tag), {}
