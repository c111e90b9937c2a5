"""One training step of a dense transformer under Megatron-style tp x pp x dp (published runs):
per micro-batch and pipeline stage, GEMMs, attention and element-wise work priced by shape
(`gpus.KernelFit`), TP all-reduces on the critical path (or hidden behind the GEMMs where the run
overlapped them), the 1F1B schedule (interleaved: `vp` chunks a stage) with its bubble, pipeline
sends across nodes, the data-parallel gradient reduction over both link levels (`links`), hidden
behind the last backward where the run overlapped it, and the optimizer's pass over HBM.
`calibrate` fits a GPU type's two kernel numbers to at most two runs; `predict` prices the rest.
More: docs/benchmarks/sim_published.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_omni.errors import ConfigError
from ds_omni.sim import links
from ds_omni.sim.cluster import cluster
from ds_omni.sim.gpus import KernelFit, hbm_bandwidth

BYTES = 2  # 16-bit activations and parameters
GRAD_BYTES = 4  # Megatron reduces fp32 main gradients
OPTIMIZER_BYTES = 30  # Adam per parameter: fp32 master, m, v read and written, grad, param
REPLICATED = 0.2
"""Share of the element-wise bytes every TP rank moves whole without sequence parallelism (the
norms, dropouts and residuals outside the split attention and MLP)."""


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


@dataclass(frozen=True)
class Breakdown:
    """Seconds of one step and its parts (per rank on the critical path)."""

    step: float
    compute: float
    bubble: float
    tp: float
    p2p: float
    dp: float
    optimizer: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _layer_gemm_seconds(h: int, ffn: int, tp: int, fit: KernelFit) -> float:
    """Forward seconds x peak of one token through a layer's four GEMMs on one TP rank, each at
    the fraction of its narrow side (QKV and the first MLP matrix split their outputs over tp,
    the attention projection and the second MLP matrix their inputs)."""
    shapes = ((3 * h * h, min(h, 3 * h / tp)), (h * h, h / tp),  # (parameters, narrow side)
              (h * ffn, min(h, ffn / tp)), (h * ffn, min(ffn / tp, h)))
    return sum(2 * n / tp / fit.gemm_fraction(narrow) for n, narrow in shapes)


def _micro_compute(run: Run, fit: KernelFit, peak: float, hbm: float, head: bool = False
                   ) -> tuple[float, float, float]:
    """(forward, backward, GEMM-part of forward) seconds of one micro-batch on one stage (its
    layers; `head`: the last stage, which also runs the LM head and its loss)."""
    m, p = run.model, run.plan
    h, tp = m["hidden"], p["tp"]
    tokens = p["micro_batch"] * m["seq"] / p.get("cp", 1)
    layers = m["layers"] / p["pp"]
    gemm = tokens * layers * _layer_gemm_seconds(h, m["ffn"], tp, fit) / peak
    attn = tokens * layers * 4 * m["seq"] * h / tp / (peak * fit.gemm_fraction(run.head_dim))
    split = 1 / tp if p["sequence_parallel"] else REPLICATED + (1 - REPLICATED) / tp
    elem = tokens * layers * fit.elementwise * h * split / hbm
    logits = head * tokens * 2 * h * m["vocab"] / tp / (peak * fit.gemm_fraction(h / tp))
    fwd = gemm + attn + elem + logits
    bwd = 2 * (gemm + attn + logits) + 2 * elem + (fwd if p["recompute"] else 0.0)
    return fwd, bwd, gemm


def _tp_seconds(run: Run, cl, fwd_gemm: float) -> tuple[float, float]:
    """(forward, backward) exposed TP all-reduce seconds of one micro-batch on one stage: 2 a
    layer each way (+2 recomputing), hidden behind the GEMMs where the run overlapped them."""
    m, p = run.model, run.plan
    if p["tp"] < 2:
        return 0.0, 0.0
    nbytes = p["micro_batch"] * m["seq"] / p.get("cp", 1) * m["hidden"] * BYTES
    one = links.all_reduce(cl, nbytes, p["tp"], cl.gpus_per_node)
    layers = m["layers"] / p["pp"]
    fwd, bwd = 2 * layers * one, 2 * layers * one * (1 + p["recompute"])
    if p.get("tp_comm_overlap"):
        return max(0.0, fwd - fwd_gemm), max(0.0, bwd - 2 * fwd_gemm)
    return fwd, bwd


def _dp_seconds(run: Run, cl) -> tuple[float, float]:
    """(reduce, gather): the stage's gradient reduction over its data-parallel ranks (fp32),
    and under the distributed optimizer the updated parameters all-gathered back (16-bit)."""
    m, p = run.model, run.plan
    if p["dp"] < 2:
        return 0.0, 0.0
    h = m["hidden"]
    params = (m["layers"] * (4 * h * h + 2 * h * m["ffn"]) / p["pp"] + h * m["vocab"]) / p["tp"]
    per_node = max(1, cl.gpus_per_node // (p["tp"] * p.get("cp", 1)))  # dp ranks on one node
    if p.get("distributed_optimizer"):
        return (links.reduce_scatter(cl, params * GRAD_BYTES, p["dp"], per_node),
                links.reduce_scatter(cl, params * BYTES, p["dp"], per_node))
    return links.all_reduce(cl, params * GRAD_BYTES, p["dp"], per_node), 0.0


def step_time(run: Run, fit: KernelFit) -> Breakdown:
    """One iteration of `run` with the GPU type's kernels `fit`."""
    p = run.plan
    cl = cluster(run.gpu, run.gpus, run.gpus_per_node)
    hbm = hbm_bandwidth(run.gpu)
    P, M, vp = p["pp"], run.micro_batches, p.get("vp", 1)
    fwd, bwd, gemm = _micro_compute(run, fit, cl.flops, hbm)
    head_f, head_b, _ = _micro_compute(run, fit, cl.flops, hbm, head=True)  # the last stage
    tp_f, tp_b = _tp_seconds(run, cl, gemm)
    send = 0.0
    if P > 1:  # each TP rank sends its 1/tp of the activations; stages sit on other nodes
        nbytes = p["micro_batch"] * run.model["seq"] * run.model["hidden"] * BYTES / p["tp"]
        crosses = p["tp"] * p.get("cp", 1) * p["dp"] >= cl.gpus_per_node  # Megatron order
        send = 2 * vp * links.p2p(cl, nbytes / p.get("cp", 1), crosses)
    micro = fwd + bwd + tp_f + tp_b + send  # a stage's micro-batch, the last stage's below
    slowest = micro + (head_f + head_b - fwd - bwd)
    # 1F1B: the slowest stage runs every micro-batch, the others fill and drain around it
    bubble = (P - 1) / vp * (((P - 1) * micro + slowest) / P)
    reduce, gather = _dp_seconds(run, cl)
    if p.get("overlap_grad_reduce"):  # the last backward hides the gradient buckets, the
        reduce, gather = max(0.0, reduce - bwd / vp), max(0.0, gather - fwd / vp)  # next forward the gathers
    dp = reduce + gather
    h, m = run.model["hidden"], run.model
    params = (m["layers"] * (4 * h * h + 2 * h * m["ffn"]) / P + h * m["vocab"]) / p["tp"]
    shard = p["dp"] if p.get("distributed_optimizer") else 1
    optimizer = params / shard * OPTIMIZER_BYTES / hbm
    step = M * slowest + bubble + dp + optimizer
    return Breakdown(step, M * (head_f + head_b), bubble, M * (tp_f + tp_b), M * send, dp,
                     optimizer)


def predicted_tflops(entry: dict, fit: KernelFit, convention: str) -> float:
    """Predicted TFLOP/s per GPU of a published run, counted by its source's `convention`."""
    run = Run.of(entry)
    return iteration_flops(run, convention) / step_time(run, fit).step / run.gpus / 1e12


def calibrate(entries: list[dict], conventions: list[str]) -> KernelFit:
    """The GPU type's `KernelFit` that reproduces its calibration runs (one or two, same GPU
    type): with one run the GEMM fraction alone (no element-wise bytes); with two also the
    element-wise bytes, by nested bisection (each run's prediction rises with `gemm` and
    falls with `elementwise`)."""
    if not 1 <= len(entries) <= 2 or len({e["gpu"] for e in entries}) != 1:
        raise ConfigError(f"calibrate takes one or two runs of one GPU type, got "
                          f"{[(e['gpu'], e['name']) for e in entries]}")

    def bisect(f, lo: float, hi: float) -> float:
        """The x in [lo, hi] where the increasing f crosses 0."""
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
        return (lo + hi) / 2

    def gap(entry, conv, gemm: float, elementwise: float) -> float:
        return predicted_tflops(entry, KernelFit(gemm, elementwise), conv) / \
            entry["measured"]["tflops_per_gpu"] - 1

    def gemm_for(entry, conv, elementwise: float) -> float:
        return bisect(lambda g: gap(entry, conv, g, elementwise), 1e-3, 1.0)

    if len(entries) == 1:
        return KernelFit(gemm_for(entries[0], conventions[0], 0.0), 0.0)
    (a, b), (ca, cb) = entries, conventions
    # the most element-wise bytes a's GEMMs can make up for at full peak
    top = bisect(lambda k: -gap(a, ca, 1.0, k), 0.0, 1e4)
    sign = 1 if b["model"]["hidden"] > a["model"]["hidden"] else -1
    k = bisect(lambda k: sign * gap(b, cb, gemm_for(a, ca, k), k), 0.0, top)
    return KernelFit(gemm_for(a, ca, k), k)


def reproduce(doc: dict) -> dict:
    """Calibrate each GPU type on the runs `doc["calibration"]` names (at most two a type) and
    predict every run of `doc` (benchmarks/published_runs.json's layout). Returns
    {"fits", "runs": [{source, name, gpus, plan, measured, predicted, error, role, breakdown}]}."""
    runs, conventions = doc["runs"], {k: v["flops"] for k, v in doc["sources"].items()}
    by_name = {(r["source"], r["name"]): r for r in runs}
    fits = {}
    for gpu, names in doc["calibration"].items():
        if len(names) > 2:
            raise ConfigError(f"calibration of {gpu} names {len(names)} runs; at most 2 a type")
        chosen = [by_name[tuple(n)] for n in names]
        fits[gpu] = calibrate(chosen, [conventions[e["source"]] for e in chosen])
    out = []
    for r in runs:
        fit = fits[r["gpu"]]
        measured = r["measured"]["tflops_per_gpu"]
        predicted = predicted_tflops(r, fit, conventions[r["source"]])
        role = "calibration" if [r["source"], r["name"]] in doc["calibration"][r["gpu"]] \
            else "validation"
        out.append(dict(source=r["source"], name=r["name"], gpus=r["gpus"], plan=r["plan"],
                        measured=measured, predicted=predicted, error=predicted / measured - 1,
                        role=role, breakdown=step_time(Run.of(r), fit).as_dict()))
    return {"fits": {g: dict(f.__dict__) for g, f in fits.items()}, "runs": out}


def ordered_pairs(rows: list[dict]) -> tuple[int, int]:
    """(pairs of one source's runs the prediction orders as the measurement does, pairs the
    measurement orders): measured ties are not counted."""
    agree = total = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["source"] != b["source"] or a["measured"] == b["measured"]:
                continue
            total += 1
            agree += (a["measured"] < b["measured"]) == (a["predicted"] < b["predicted"])
    return agree, total
