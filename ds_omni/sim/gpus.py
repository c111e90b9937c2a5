"""GPU kernels as the simulator prices them by shape: a GEMM reaches a fitted fraction of peak
that falls as its narrow side shrinks toward a few tiles; attention is priced as GEMMs of the
head dimension; each GEMM's own operands and output, the element-wise work around them (norms,
activations, dropout, residuals) and unfused attention's scores (`scores`) are bytes through
HBM. Two numbers a GPU type, fitted from at most two published runs
(`ds_omni.sim.published.calibrate`); the peaks and bandwidths are the vendors' (`cluster.PRESETS`
plus HBM bandwidth here). More: docs/benchmarks/sim_published.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_omni.errors import ConfigError

# HBM bandwidth per GPU, bytes/s (vendor figures: A100 SXM 80 GB 2.0 TB/s, H100 SXM 3.35 TB/s)
HBM_BW = {"a100": 2.0e12, "h100": 3.35e12, "h200": 4.8e12}
GEMM_HALF = 128
"""A GEMM whose narrow side is this many columns (one tile of a 16-bit tensor-core kernel)
runs at half its large-shape fraction: fraction(n) = gemm * n / (n + GEMM_HALF)."""


@dataclass(frozen=True)
class KernelFit:
    """What a GPU type's kernels reach, fitted per type (never per run)."""

    gemm: float
    """Fraction of peak 16-bit FLOP/s a large GEMM reaches."""
    elementwise: float
    """Bytes moved through HBM per token, layer and unit of hidden size by the non-GEMM work of
    a forward pass (a backward moves twice that)."""
    scores: float = 0.0
    """Bytes through HBM per head, query token and key of a pass where attention materialises
    its scores (unfused, before flash attention); 0: fused (flash) attention."""

    def __post_init__(self):
        if not 0 < self.gemm <= 1 or self.elementwise < 0 or self.scores < 0:
            raise ConfigError(f"KernelFit needs 0 < gemm <= 1, elementwise >= 0 and scores >= "
                              f"0, got gemm={self.gemm}, elementwise={self.elementwise}, "
                              f"scores={self.scores}")

    def gemm_fraction(self, narrow: float) -> float:
        """Fraction of peak of a GEMM whose narrowest side is `narrow` columns."""
        return self.gemm * narrow / (narrow + GEMM_HALF)


REPLICATED = 0.2
"""Share of the element-wise bytes every TP rank moves whole (the norms, dropouts and residuals
outside the split attention and MLP: AutoTP's and Megatron's without sequence parallelism)."""


def layer_seconds(fit: KernelFit, dims, tp: int, seq: float, peak: float, hbm: float,
                  head_dim: int = 128, split_norms: bool = False,
                  rows: float | None = None) -> tuple[float, float]:
    """(one decoder layer, the LM head) forward seconds of one token on one of `tp` ranks:
    each GEMM at the fraction of its narrow side (QKV and all MLP matrices but the last split
    their outputs over tp, the attention projection and the last MLP matrix their inputs),
    causal attention (2 h s FLOPs a token, as `CostModel` counts it) at the head dimension's,
    the element-wise bytes through HBM (all of them / tp where `split_norms`), and under unfused
    attention its score matrices' bytes (`fit.scores` a head, token and key). `dims`: a
    `ModelDims`; `rows`: a micro-batch's tokens, its GEMMs' traffic (`gemm_seconds`; None: none)."""
    h, ffn, k = dims.hidden, dims.intermediate, dims.mlp_matrices
    kv = dims.kv_hidden or h
    shapes = [(h, (h + 2 * kv) / tp), (h / tp, h)] + [(h, ffn / tp)] * (k - 1) + [(ffn / tp, h)]
    gemm = sum(gemm_seconds(fit, d, n, min(d, n), rows, peak, hbm) for d, n in shapes)
    attn = 2 * h * seq / tp / (peak * fit.gemm_fraction(head_dim))
    replicated = 0.0 if split_norms else REPLICATED
    elem = fit.elementwise * h * (replicated + (1 - replicated) / tp) / hbm
    elem += fit.scores * h / head_dim / tp * seq / hbm
    head = gemm_seconds(fit, h, dims.vocab / tp, h / tp, rows, peak, hbm)
    return gemm + attn + elem, head


def gemm_seconds(fit: KernelFit, depth: float, width: float, narrow: float, rows: float | None,
                 peak: float, hbm: float) -> float:
    """Seconds a token of a [rows, depth] x [depth, width] GEMM: its FLOPs at the fraction of its
    `narrow` side, plus (where `rows`, the micro-batch's tokens, is given) its compulsory 16-bit
    traffic, both operands read and the output written once, through HBM beside the math (the
    roofline's sum: a larger GEMM's higher FLOPs a byte is what makes it run nearer peak)."""
    seconds = 2 * depth * width / (peak * fit.gemm_fraction(narrow))
    if rows:
        seconds += 2 * (depth + width + depth * width / rows) / hbm
    return seconds


def llm_rate(fit: KernelFit, cost, tp: int, seq: float, peak: float, hbm: float,
             head_dim: int = 128, split_norms: bool = False, rows: float | None = None) -> float:
    """FLOP/s the LLM's work reaches on a TP rank for samples of `seq` tokens: the `CostModel`'s
    forward FLOPs of a token / tp over `layer_seconds` of its layers and head (the
    simulator prices the LLM's passes at this rate where a cluster has `kernels`)."""
    d = cost.dims
    layer, head = layer_seconds(fit, d, tp, seq, peak, hbm, head_dim, split_norms, rows)
    flops = float(cost.llm_cost([seq])[0]) / seq / cost.train_factor
    return flops / tp / (d.layers * layer + head)


def cluster_llm_rate(cluster, model, tp: int, seq: float, split_norms: bool = False,
                     rows: float | None = None) -> float:
    """FLOP/s of the LLM's passes on a rank of `cluster` (a `Cluster`) for `model` (a
    `ModelSpec`): its kernels by shape (`llm_rate`, samples of `seq` tokens, micro-batches of
    `rows`) where it has them, else `Cluster.flops_per_s`."""
    if cluster.kernels is None:
        return cluster.flops_per_s
    heads = model.llm_heads
    return llm_rate(cluster.kernels, model.cost, tp, seq, cluster.flops,
                    hbm_bandwidth(cluster.name), model.dims.hidden // heads if heads else 128,
                    split_norms, rows)


def hbm_bandwidth(gpu: str) -> float:
    if gpu not in HBM_BW:
        raise ConfigError(f"no HBM bandwidth known for GPU type {gpu!r}; known: {sorted(HBM_BW)}")
    return HBM_BW[gpu]
