"""Calibrate the simulator and the cost model with a short profile run on this machine.

    ds-omni calibrate-cost --config my.json --batches 30 --out cost_scales.json

Micro-batches the loader makes are run forward and backward in one process, at several sizes
(`sizes`: samples a micro-batch; text-only and image rows alike, whatever the config's mix
gives), and the optimizer step is timed on the model's parameters. Two fits come out:

- the machine (`fit_rate`): seconds = FLOPs / rate + parameters x a cost a micro-batch per
  parameter, one FLOP/s rate for all work (the cost model's FLOP formulas give each term its
  weight), and the optimizer's seconds per parameter: the fields `Cluster.flops` (with
  `achievable=1`), `micro_batch_s_per_param` and `optimizer_s_per_param` the simulator charges;
- the cost model's per-term scales (`CostModel.calibrate`, non-negative least squares), what
  `data.reorder.cost_scales` takes for the loader's balancing. With few, similar micro-batches
  the terms are collinear and it may zero some of them: the simulator uses the rate instead.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds_omni.config import OmniConfig
from ds_omni.data.cost import nnls
from ds_omni.errors import ConfigError


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

    def arrays(self) -> tuple:
        """(tokens [N], owner [M], encoder [M], length [M]) as the cost model takes them."""
        return (np.array(self.tokens), np.array(self.owner, dtype=np.int64),
                np.array(self.encoder, dtype=str), np.array(self.length, dtype=np.int64))

    def flops(self, cost, quadratic: bool = False) -> np.ndarray:
        """[K] training FLOPs of each measured micro-batch under `cost` (unscaled: FLOPs); only
        its attention terms' (`*_quad`) if `quadratic`."""
        terms = cost.term_costs(*self.arrays())  # [N, T]
        keep = [t.endswith("_quad") or not quadratic for t in cost.terms]
        per_sample = terms[:, keep].sum(axis=1)
        return np.bincount(self.step, weights=per_sample, minlength=len(self.seconds))


def fit_rate(flops: np.ndarray, seconds: np.ndarray, params: np.ndarray) -> tuple[float, float]:
    """(FLOP/s, seconds a micro-batch per parameter of the model) with
    seconds ~ flops / rate + params x per_param, both >= 0, by non-negative least squares on
    relative error (a small micro-batch weighs as much as a big one). flops [K], seconds [K],
    params [K] (the parameters of the model each micro-batch ran), K >= 2 of different sizes.
    The second term is what a micro-batch costs whatever its length: every weight read, every
    gradient written (on CPU a tiny model's micro-batch is mostly that)."""
    flops, seconds = np.asarray(flops, np.float64), np.asarray(seconds, np.float64)
    params = np.broadcast_to(np.asarray(params, np.float64), flops.shape)
    if flops.size < 2 or np.ptp(flops) <= 0.05 * flops.max(initial=0.0):
        raise ConfigError(f"fit_rate needs micro-batches of different sizes to tell the FLOP "
                          f"rate from the fixed cost; got {flops.size} of FLOPs "
                          f"{flops.min(initial=0):.3g}-{flops.max(initial=0):.3g}: profile "
                          "more sizes (calibrate-cost's --sizes)")
    a = np.stack([flops, params], axis=1) / seconds[:, None]  # [K, 2]
    scale = np.linalg.norm(a, axis=0)
    inv_rate, per_param = nnls(a / scale, np.ones_like(seconds)) / scale
    if inv_rate <= 0:
        raise ConfigError("the measured seconds do not grow with the micro-batches' FLOPs; the "
                          "profile was too noisy or too small: run more batches or bigger sizes")
    return float(1.0 / inv_rate), float(per_param)


def optimizer_seconds_per_param(model, clock=time.perf_counter, repeats: int = 3) -> float:
    """Seconds of one AdamW step (torch's, what DeepSpeed's `torch_adam` runs on CPU) per
    trained parameter of `model`, the median of `repeats` after a warm-up; gradients are set."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    opt = torch.optim.AdamW(params, lr=1e-6)
    times = []
    for i in range(repeats + 1):
        t0 = clock()
        opt.step()
        if i:
            times.append(clock() - t0)
    model.zero_grad(set_to_none=True)
    return float(np.median(times)) / sum(p.numel() for p in params)


def _with_batch(cfg: OmniConfig, size: int) -> OmniConfig:
    train = dataclasses.replace(cfg.train, global_batch_size=size, micro_batch_size=size)
    return dataclasses.replace(cfg, train=train)


def profile(cfg: OmniConfig, batches: int, clock=time.perf_counter,
            sizes: tuple[int, ...] | None = None) -> dict:
    """Time `batches` micro-batches of each size in `sizes` (samples; default: the config's
    global batch alone), after one warm-up each, and the optimizer step; the fitted machine
    (`fit_rate`, when the sizes differ), the cost model's scales and a summary.
    `clock`: `time.process_time` for CPU seconds (on a machine shared with other jobs)."""
    from ds_omni.data.build import build_loader, cost_model_for
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    m = Measurements()
    for size in sizes or (cfg.train.global_batch_size,):
        loader = build_loader(_with_batch(cfg, size), built, num_micro=1)
        dummies = {name: enc.dummy_len for name, enc in loader.cost_model.dims.encoders.items()}
        for i in range(batches + 1):
            batch = loader.next_step()
            t0 = clock()
            built.model(batch.micro_batches[0]).loss_sum.backward()
            elapsed = clock() - t0
            built.model.zero_grad(set_to_none=True)
            if i:  # the first micro-batch pays for allocation and warm-up
                m.add(loader.load_samples(batch.keys), elapsed, dummies)
    flops_model = cost_model_for(built, cfg.model.frozen_parts())
    fitted = flops_model.calibrate(*m.arrays(), np.array(m.seconds), np.array(m.step))
    predicted = np.bincount(m.step, weights=fitted.sample_costs(*m.arrays()))
    seconds = np.array(m.seconds)
    out = {"cost_scales": fitted.scales, "micro_batches": len(m.seconds),
           "median_seconds": float(np.median(seconds)),
           "median_relative_error": float(np.median(np.abs(predicted - seconds) / seconds)),
           "optimizer_s_per_param": optimizer_seconds_per_param(built.model, clock)}
    flops = m.flops(flops_model)
    params = float(sum(p.numel() for p in built.model.parameters()))
    if sizes and len(set(sizes)) > 1:
        rate, per_param = fit_rate(flops, seconds, params)
        fit = flops / rate + params * per_param
        out |= {"flops_per_s": rate, "micro_batch_s_per_param": per_param,
                "rate_median_relative_error": float(np.median(np.abs(fit - seconds) / seconds))}
    out["measured"] = {"flops": flops.tolist(), "seconds": seconds.tolist(), "params": params,
                       "attention_flops": m.flops(flops_model, quadratic=True).tolist()}
    return out


def machine_fields(result: dict) -> dict:
    """The `Cluster` fields a profile fitted: a cluster of them (`cluster("cpu", n, **...)`)
    prices FLOPs in this machine's seconds."""
    return {"flops": result["flops_per_s"], "achievable": 1.0,
            "micro_batch_s_per_param": result["micro_batch_s_per_param"],
            "optimizer_s_per_param": result["optimizer_s_per_param"],
            # the engine's fixed cost a step, where an engine calibration fitted one (a profile
            # alone has none: 0)
            "step_s": result.get("step_s", 0.0),
            # the seconds of each Ulysses all-to-all call beyond the wire, where an engine
            # calibration with sp runs fitted one
            "a2a_call_s": result.get("a2a_call_s", 0.0),
            # a pipeline pass's engine seconds and its p2p bytes' CPU seconds, where an engine
            # calibration with pipeline runs fitted them
            "pipe_pass_s": result.get("pipe_pass_s", 0.0),
            "p2p_byte_s": result.get("p2p_byte_s", 0.0),
            # the encoder pool's planning a step per item, where a micro-benchmark timed it
            "pool_item_s": result.get("pool_item_s", 0.0),
            # ring attention's dense blocks' FLOP/s, where a micro-benchmark timed it
            "ring_flops_per_s": result.get("ring_flops_per_s", 0.0),
            # AutoEP's MoE layer beyond its active MLP's FLOPs, where `sim.calibrate_moe` timed it
            "moe_token_flops": result.get("moe_token_flops", 0.0),
            "expert_half_tokens": result.get("expert_half_tokens", 0.0)}


def write(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.write_text(json.dumps(result, indent=1))
    return out
