"""ds_omni's part of a checkpoint, with a stand-in for DeepSpeed's engine (its files are DeepSpeed's)."""

import random

import numpy as np
import torch

from ds_omni.train import checkpoint
from tests.fake_engine import FakeEngine


def _draws():
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)],
            float(np.random.randn()), random.gauss(0, 1))


def test_every_rng_resumes_where_it_was(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.randn(), random.gauss(0, 1)  # leave a cached gaussian behind in both
    checkpoint.save(FakeEngine(), tmp_path, 5, {"step": 5}, rank=0)
    expected = _draws()
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    step, state = checkpoint.load(FakeEngine(), tmp_path, rank=0)
    assert (step, state) == (5, {"step": 5})
    assert _draws() == expected
    saved = torch.load(tmp_path / "checkpoints" / "step00000005" / "rng_rank0.pt", weights_only=True)
    assert {"torch", "numpy", "python"} <= set(saved)
