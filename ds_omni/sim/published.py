"""Published runs of dense transformers under Megatron-style tp x pp x dp, priced by the step
simulator itself: `sim_inputs` builds the cluster (its GPU type's `gpus.KernelFit`, Adam's pass
over HBM), a text-only `ModelSpec`, the global batch of full-length samples and a `SimPlan` with
the run's degrees, micro-batches, recompute and ZeRO stage (1: Megatron's distributed
optimizer), and `simulate` runs it: 1F1B with its bubbles, TP all-reduces on the critical path,
the gradient reduction at the end of the step (overlapped with the pipeline's drain), the
network shared by a node's GPUs, NVLink at NCCL's share (`NVLINK_NCCL`), Megatron's even
stages, unfused attention's score bytes (`UNFUSED_SCORES`).
`calibrate` fits a GPU type's two kernel numbers to at most two runs; `reproduce` predicts the
rest. More: docs/benchmarks/sim_published.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ds_omni.data.cost import ModelDims
from ds_omni.errors import ConfigError
from ds_omni.sim.cluster import PRESETS, cluster
from ds_omni.sim.gpus import KernelFit, hbm_bandwidth, layer_seconds
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.report import StepReport
from ds_omni.sim.step import simulate
from ds_omni.sim.workload import Samples

@dataclass(frozen=True)
class Run:
    """A published run (one entry of benchmarks/published_runs.json), as plain fields."""

    gpu: str
    gpus: int
    gpus_per_node: int
    model: dict  # layers, hidden, heads, vocab, ffn, seq
    plan: dict  # tp, pp, dp, cp, vp, micro_batch, sequence_parallel, recompute, overlaps
    global_batch: int

    @classmethod
    def of(cls, entry: dict) -> "Run":
        run = cls(entry["gpu"], entry["gpus"], entry["gpus_per_node"], entry["model"],
                  entry["plan"], entry["global_batch"])
        p = run.plan
        if p["tp"] * p["pp"] * p["dp"] * p.get("cp", 1) != run.gpus:
            raise ConfigError(f"tp x pp x dp x cp = {p['tp']} x {p['pp']} x {p['dp']} x "
                              f"{p.get('cp', 1)} is not the run's {run.gpus} GPUs")
        if run.global_batch % (p["dp"] * p["micro_batch"]):
            raise ConfigError(f"global batch {run.global_batch} is not a whole number of "
                              f"micro-batches of {p['micro_batch']} over dp={p['dp']}")
        return run

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.plan["dp"] * self.plan["micro_batch"])

    @property
    def head_dim(self) -> int:
        heads = self.model.get("heads")
        return self.model["hidden"] // heads if heads else 128


def iteration_flops(run: Run, convention: str) -> float:
    """FLOPs of one iteration as the sources count them: "model" forward + backward
    (72 B s l h^2 (1 + s / 6h + V / 12 l h) for ffn = 4h), "recompute" with one forward more
    (96 B s l h^2 (1 + s / 6h + V / 16 l h), Narayanan et al. eq. 3)."""
    m = run.model
    h, s, v = m["hidden"], m["seq"], m["vocab"]
    layer = 8 * h * h + 4 * h * m["ffn"] + 4 * s * h  # forward FLOPs per token and layer
    passes = {"model": 3, "recompute": 4}[convention]
    per_token = passes * m["layers"] * layer + 3 * 2 * h * v  # the logits run once each way
    return per_token * run.global_batch * s


OPTIMIZER_BYTES = 30  # Adam per parameter: fp32 master, m, v read and written, grad, param
UNFUSED_SCORES = 20 / 3
"""fp16 bytes a head, query token and key that Megatron's unfused attention moves through HBM
between its two batched GEMMs (those are priced as GEMMs), a third a pass: forward 9 (fused
scale-mask-softmax reads, writes; dropout reads, writes, a 1-byte mask), backward 11 (dropout's
gradient reads, mask, writes; softmax's reads the gradient and its output, writes)."""


NVLINK_NCCL = 370 / 450
"""Share of NVLink's line rate NCCL's collectives reach (its protocol's ~20 %: 370 of H100's
450 GB/s a direction, the NCCL maintainer in NVIDIA/nccl-tests#212; NVLink 3 taken alike)."""


def sim_inputs(entry: dict, fit: KernelFit):
    """(cluster, model, samples, plan) of a published run for `simulate`, with kernels `fit`."""
    run = Run.of(entry)
    m, p = run.model, run.plan
    fit = replace(fit, scores=UNFUSED_SCORES if p.get("attention") == "unfused" else 0.0)
    cl = cluster(run.gpu, run.gpus, run.gpus_per_node, kernels=fit, hierarchical=True,
                 optimizer_s_per_param=OPTIMIZER_BYTES / hbm_bandwidth(run.gpu),
                 intra_bw=PRESETS[run.gpu]["intra_bw"] * NVLINK_NCCL)
    dims = ModelDims(hidden=m["hidden"], layers=m["layers"], intermediate=m["ffn"],
                     vocab=m["vocab"], mlp_matrices=2)  # GPT: a plain two-matrix MLP
    model = ModelSpec.from_dims(dims, heads=m.get("heads"))
    n = run.global_batch
    empty = np.zeros(0, dtype=np.int64)
    samples = Samples(np.full(n, m["seq"], dtype=np.int64), empty, np.zeros(0, dtype=object),
                      empty, empty)
    plan = SimPlan(name=entry["name"], tp=p["tp"], pp=p["pp"], dp=p["dp"],
                   zero_stage=1 if p.get("distributed_optimizer") else 0, global_batch=n,
                   micro_batches=run.micro_batches, pack_tokens=m["seq"] * p["micro_batch"],
                   stage_split="layers",  # Megatron: L / pp decoder layers a stage
                   checkpointing=bool(p["recompute"]), reorder="loader_order",
                   overlap_grad_sync=bool(p.get("overlap_grad_reduce")),
                   overlap_tp=bool(p.get("tp_comm_overlap")),
                   tp_splits_norms=bool(p["sequence_parallel"]), virtual_stages=p.get("vp", 1),
                   p2p_scatter=bool(p.get("scatter_gather")), vocab_parallel=True)
    return cl, model, samples, plan


def step_report(entry: dict, fit: KernelFit) -> StepReport:
    """The simulator's step of a published run."""
    return simulate(*sim_inputs(entry, fit))


def breakdown(report: StepReport) -> dict:
    """Seconds of the step and of each phase on its critical path."""
    out = {"step": report.step_time}
    for seg in report.critical_path:
        out[seg["phase"]] = out.get(seg["phase"], 0.0) + seg["seconds"]
    return out


def predicted_tflops(entry: dict, fit: KernelFit, convention: str) -> float:
    """Predicted TFLOP/s per GPU of a published run, counted by its source's `convention`."""
    run = Run.of(entry)
    return iteration_flops(run, convention) / step_report(entry, fit).step_time / run.gpus / 1e12


def _gemm_for(entry: dict, convention: str) -> float:
    """The GEMM fraction (no element-wise bytes) at which the simulator reproduces the run:
    secant steps on 1 / gemm, which the step's time follows almost linearly."""
    target = entry["measured"]["tflops_per_gpu"]

    def gap(x: float) -> float:
        return predicted_tflops(entry, KernelFit(min(1.0, 1 / x), 0.0), convention) / target - 1

    x0, x1 = 2.0, 1.5
    g0, g1 = gap(x0), gap(x1)
    for _ in range(20):
        if abs(g1) < 1e-6 or g1 == g0:
            break
        x0, x1, g0 = x1, max(1.0, x1 - g1 * (x1 - x0) / (g1 - g0)), g1
        g1 = gap(x1)
    if abs(g1) > 1e-3:
        raise ConfigError(f"no GEMM fraction <= 1 reproduces {entry['name']} "
                          f"({target} TFLOP/s per GPU): the run is faster than the simulator "
                          "at peak; check its plan and FLOP count")
    return 1 / x1


def calibrate(entries: list[dict], conventions: list[str]) -> KernelFit:
    """The GPU type's `KernelFit` that reproduces its calibration runs (one or two, same GPU
    type): with one run the GEMM fraction alone (no element-wise bytes); with two also the
    element-wise bytes. A run's LLM seconds a token are S1 / gemm + S2 x elementwise + S0
    (`gpus.layer_seconds`; S0 the bytes neither scales, which cancel): each run's GEMM-only fit
    gives its seconds, and the two runs' equations give (gemm, elementwise)."""
    if not 1 <= len(entries) <= 2 or len({e["gpu"] for e in entries}) != 1:
        raise ConfigError(f"calibrate takes one or two runs of one GPU type, got "
                          f"{[(e['gpu'], e['name']) for e in entries]}")
    alone = [_gemm_for(e, c) for e, c in zip(entries, conventions)]
    if len(entries) == 1:
        return KernelFit(alone[0], 0.0)
    rows, rhs = [], []
    for e, g in zip(entries, alone):
        s1, s2 = (_token_seconds(e, KernelFit(1.0, k), False) for k in (0.0, 1.0))
        rows.append([s1, s2 - s1])
        rhs.append(s1 / g)  # the seconds the GEMM-only fit gives
    inv_gemm, elementwise = np.linalg.solve(np.array(rows), np.array(rhs))
    if elementwise < 0 or inv_gemm < 1:
        raise ConfigError(f"the runs {[e['name'] for e in entries]} give gemm "
                          f"{1 / inv_gemm:.3f}, elementwise {elementwise:.1f}: outside the "
                          "model (0 < gemm <= 1, elementwise >= 0); calibrate on other runs")
    return KernelFit(1 / inv_gemm, elementwise)


def _token_seconds(entry: dict, fit: KernelFit, fixed: bool = True) -> float:
    """Forward seconds of one token through the run's LLM on a TP rank (`gpus.layer_seconds`),
    without the bytes neither kernel number scales (unfused attention's scores, the GEMMs'
    operands) unless `fixed`."""
    cl, model, samples, plan = sim_inputs(entry, fit)
    kernels = cl.kernels if fixed else replace(cl.kernels, scores=0.0)
    layer, head = layer_seconds(kernels, model.dims, plan.tp, float(samples.tokens.mean()), cl.flops,
                                hbm_bandwidth(cl.name), Run.of(entry).head_dim,
                                plan.tp_splits_norms, plan.gemm_rows if fixed else None)
    return model.dims.layers * layer + head


def reproduce(doc: dict, keep=lambda run: True) -> dict:
    """Calibrate each GPU type on the runs `doc["calibration"]` names (at most two a type) and
    predict every run of `doc` (benchmarks/published_runs.json's layout) that `keep` accepts.
    Returns {"fits", "runs": [{source, name, gpus, plan, measured, predicted, error, role,
    breakdown}]}."""
    runs, conventions = doc["runs"], {k: v["flops"] for k, v in doc["sources"].items()}
    by_name = {(r["source"], r["name"]): r for r in runs}
    fits = {}
    for gpu, names in doc["calibration"].items():
        if len(names) > 2:
            raise ConfigError(f"calibration of {gpu} names {len(names)} runs; at most 2 a type")
        chosen = [by_name[tuple(n)] for n in names]
        fits[gpu] = calibrate(chosen, [conventions[e["source"]] for e in chosen])
    out = []
    for r in filter(keep, runs):
        fit = fits[r["gpu"]]
        measured = r["measured"]["tflops_per_gpu"]
        report = step_report(r, fit)
        predicted = iteration_flops(Run.of(r), conventions[r["source"]]) / report.step_time / \
            r["gpus"] / 1e12
        role = "calibration" if [r["source"], r["name"]] in doc["calibration"][r["gpu"]] \
            else "validation"
        out.append(dict(source=r["source"], name=r["name"], gpus=r["gpus"], plan=r["plan"],
                        measured=measured, predicted=predicted, error=predicted / measured - 1,
                        role=role, breakdown=breakdown(report)))
    return {"fits": {g: dict(f.__dict__) for g, f in fits.items()}, "runs": out}


def misordered(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs (a, b) of one source's runs, a measured below b, that the prediction orders the
    other way (measured ties left out, as `ordered_pairs`)."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["source"] != b["source"] or a["measured"] == b["measured"]:
                continue
            lo, hi = (a, b) if a["measured"] < b["measured"] else (b, a)
            if lo["predicted"] >= hi["predicted"]:
                out.append((lo, hi))
    return out


def ordered_pairs(rows: list[dict]) -> tuple[int, int]:
    """(pairs of one source's runs the prediction orders as the measurement does, pairs the
    measurement orders): measured ties are not counted."""
    total = sum(a["source"] == b["source"] and a["measured"] != b["measured"]
                for i, a in enumerate(rows) for b in rows[i + 1:])
    return total - len(misordered(rows)), total
