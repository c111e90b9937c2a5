"""Calibrate the cost model with a short profile run: time real micro-batches, fit the terms.

    ds-omni calibrate-cost --config my.json --batches 30 --out cost_scales.json

Each micro-batch the loader makes is run forward and backward on this machine (one process); its
seconds and its samples' metadata go to `CostModel.calibrate`, which fits one scale per term
(LLM quadratic and linear, each encoder's) by non-negative least squares. The fitted scales are
what `data.reorder.cost_scales` takes: the FLOP formulas keep the shape, the profile sets the
weights of the terms (so modelled cost is in seconds on this hardware).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds_omni.config import OmniConfig


@dataclass
class Measurements:
    """Per sample: tokens and its measurement; per encoder pass: owner sample, encoder, length."""

    tokens: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    encoder: list[str] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def add(self, samples, seconds: float, dummies: dict[str, int] | None = None) -> None:
        """One timed micro-batch; `dummies`: encoder -> length of the dummy pass the model ran for
        each encoder with no item in it (counted as a pass of the micro-batch's first sample)."""
        present = {enc for s in samples for enc, _ in s.items}
        for i, s in enumerate(samples):
            passes = [(enc, n) for enc, item in s.items for n in item.cost_seqs()]
            if i == 0:
                passes += [(enc, n) for enc, n in (dummies or {}).items() if enc not in present and n]
            for enc, n in passes:
                self.owner.append(len(self.tokens))
                self.encoder.append(enc)
                self.length.append(n)
            self.tokens.append(s.length)
            self.step.append(len(self.seconds))
        self.seconds.append(seconds)


def profile(cfg: OmniConfig, batches: int, clock=time.perf_counter) -> dict:
    """Time `batches` micro-batches (after one warm-up); the fitted scales and a summary.
    `clock`: `time.process_time` for CPU seconds (on a machine shared with other jobs)."""
    from ds_omni.data.build import build_loader, cost_model_for
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    loader = build_loader(cfg, built, dp_rank=0, dp_size=1, num_micro=1)
    m = Measurements()
    dummies = {name: enc.dummy_len for name, enc in loader.cost_model.dims.encoders.items()}
    for i in range(batches + 1):
        batch = loader.next_step()
        t0 = clock()
        built.model(batch.micro_batches[0]).loss_sum.backward()
        elapsed = clock() - t0
        built.model.zero_grad(set_to_none=True)
        if i:  # the first micro-batch pays for allocation and warm-up
            m.add(loader.load_samples(batch.keys), elapsed, dummies)
    fitted = cost_model_for(built, cfg.model.frozen_parts()).calibrate(
        np.array(m.tokens), np.array(m.owner, dtype=np.int64), np.array(m.encoder, dtype=str),
        np.array(m.length, dtype=np.int64), np.array(m.seconds), np.array(m.step))
    predicted = np.bincount(m.step, weights=fitted.sample_costs(
        np.array(m.tokens), np.array(m.owner, dtype=np.int64), np.array(m.encoder, dtype=str),
        np.array(m.length, dtype=np.int64)))
    error = np.abs(predicted - np.array(m.seconds)) / np.array(m.seconds)
    return {"cost_scales": fitted.scales, "micro_batches": len(m.seconds),
            "median_seconds": float(np.median(m.seconds)),
            "median_relative_error": float(np.median(error))}


def write(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.write_text(json.dumps(result, indent=1))
    return out
