"""GPU kernels as the simulator prices them by shape: a GEMM reaches a fitted fraction of peak
that falls as its narrow side shrinks toward a few tiles; attention is priced as GEMMs of the
head dimension; the element-wise work around them (norms, activations, dropout, residuals) is
bytes through HBM. Two numbers a GPU type, fitted from at most two published runs
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

    def __post_init__(self):
        if not 0 < self.gemm <= 1 or self.elementwise < 0:
            raise ConfigError(f"KernelFit needs 0 < gemm <= 1 and elementwise >= 0, got "
                              f"gemm={self.gemm}, elementwise={self.elementwise}")

    def gemm_fraction(self, narrow: float) -> float:
        """Fraction of peak of a GEMM whose narrowest side is `narrow` columns."""
        return self.gemm * narrow / (narrow + GEMM_HALF)


def hbm_bandwidth(gpu: str) -> float:
    if gpu not in HBM_BW:
        raise ConfigError(f"no HBM bandwidth known for GPU type {gpu!r}; known: {sorted(HBM_BW)}")
    return HBM_BW[gpu]
