"""A cluster, as the simulator sees it: GPU count and per-node count, dense bf16 FLOP/s and the
fraction of it a training kernel achieves, HBM size, and the two links (inside a node, between
nodes) as latency + bandwidth.

Bandwidths are per GPU and per direction, as a collective sees them (NVLink's bus bandwidth
inside a node; the GPU's share of the node's network adapters between nodes). The presets are
vendor peak numbers with achievable fractions typical of published training runs; "cpu" is a
placeholder for this project's CPU machines, to be fitted by the calibration runs (the cost
model's `calibrate` gives seconds per FLOP; a measured collective gives the links).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ds_omni.errors import ConfigError
from ds_omni.sim.gpus import KernelFit

GIB = 1024 ** 3


@dataclass(frozen=True, kw_only=True)
class Cluster:
    gpus: int
    """GPUs (ranks) in all."""
    gpus_per_node: int
    """GPUs of one node (they share the fast intra-node link)."""
    flops: float
    """Peak dense bf16 FLOP/s of one GPU."""
    achievable: float = 0.5
    """Fraction of `flops` a training step's kernels reach (matmul-heavy transformer work)."""
    hbm_bytes: float
    """Memory of one GPU."""
    intra_bw: float
    """Bytes/s per GPU and direction between GPUs of one node."""
    intra_latency: float = 3e-6
    """Seconds of one message between GPUs of one node (launch + link latency)."""
    inter_bw: float
    """Bytes/s per GPU and direction between nodes."""
    inter_latency: float = 10e-6
    """Seconds of one message between nodes."""
    micro_batch_s_per_param: float = 0.0
    """Seconds of a micro-batch's forward + backward per held parameter beyond FLOPs / rate
    (weights read, gradients accumulated): `ds-omni calibrate-cost --sizes`; 0 on GPU presets."""
    optimizer_s_per_param: float = 0.0
    """Seconds of the optimizer step per parameter a rank updates (its ZeRO shard): `ds-omni
    calibrate-cost`; 0 on the GPU presets (a fused kernel, ~1 % of a step)."""
    step_s: float = 0.0
    """Seconds a rank spends once a step outside micro-batches and the optimizer (the
    engine's bookkeeping)."""
    a2a_call_s: float = 0.0
    """Seconds per blocking collective call of a layer (Ulysses' all-to-alls, TP's all-reduces)
    beyond latency and bytes: fitted on CPU from the calibration's sp runs; 0 on GPU presets."""
    pipe_pass_s: float = 0.0
    """Seconds a pipeline stage spends a pass (forward or backward of a micro-batch) in the
    engine's instruction loop beyond its work (DeepSpeed's PipelineEngine on CPU); 0: presets."""
    p2p_byte_s: float = 0.0
    """CPU seconds a byte of activations or gradients a stage sends or receives beyond the link
    (the engine's buffers and copies): fitted from pipeline runs on CPU; 0 on GPU presets."""
    pool_item_s: float = 0.0
    """Seconds a pool rank spends a step per pooled item on planning (metadata all-gathered, every
    round planned): `calibrate_comm.time_pool_planning`; 0 on the GPU presets."""
    hierarchical: bool = False
    """A group with k ranks a node spanning nodes gets min(intra_bw, k x inter_bw) (NCCL on NVLink
    nodes; the GPU presets); False: `inter_bw` (docs/simulator.md, "Against clusters")."""
    kernels: KernelFit | None = None
    """The GPU type's kernels by shape (`gpus.KernelFit`, `sim.published.calibrate`) for the
    LLM's passes; None: all work at `achievable`."""
    ring_flops_per_s: float = 0.0
    """FLOP/s of ring attention's dense masked blocks (`model/ring_kernels.TorchBlock`, pure
    torch): `calibrate_comm.time_ring_blocks` on CPU; 0: a fused varlen kernel (presets)."""
    moe_token_flops: float = 0.0
    """Work of an AutoEP MoE layer a token-expert assignment beyond its experts' matmuls (router,
    sort, permutation, combine), training FLOPs at the LLM's rate: `calibrate_moe`; 0: presets."""
    expert_half_tokens: float = 0.0
    """Tokens an expert needs for its matmuls to reach half the LLM's rate (n / (n + this)):
    `calibrate_moe` on CPU; 0: the LLM's rate at any count (the GPU presets)."""
    name: str = "custom"

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"a cluster needs gpus >= 1 and gpus_per_node >= 1, got gpus="
                              f"{self.gpus}, gpus_per_node={self.gpus_per_node}")
        if self.gpus_per_node > self.gpus:
            raise ConfigError(f"gpus_per_node={self.gpus_per_node} is more than the cluster's "
                              f"gpus={self.gpus}; give --gpus-per-node <= --gpus (one partial "
                              "node: set both to the GPU count)")
        if self.gpus % self.gpus_per_node:
            raise ConfigError(f"gpus={self.gpus} is not a whole number of nodes of "
                              f"{self.gpus_per_node}; use a multiple of gpus_per_node")
        for field in ("flops", "hbm_bytes", "intra_bw", "inter_bw"):
            if not getattr(self, field) > 0:
                raise ConfigError(f"Cluster.{field} must be > 0, got {getattr(self, field)}")
        for field in ("micro_batch_s_per_param", "optimizer_s_per_param", "step_s",
                      "a2a_call_s", "pipe_pass_s", "p2p_byte_s", "pool_item_s",
                      "ring_flops_per_s", "moe_token_flops",
                      "expert_half_tokens"):
            if not getattr(self, field) >= 0:
                raise ConfigError(f"Cluster.{field} (a calibrated cost) must be >= 0, got "
                                  f"{getattr(self, field)}")
        if not 0 < self.achievable <= 1:
            raise ConfigError(f"Cluster.achievable is a fraction of peak in (0, 1], got "
                              f"{self.achievable}")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def flops_per_s(self) -> float:
        """What one GPU achieves on training work."""
        return self.flops * self.achievable

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def resized(self, gpus: int) -> "Cluster":
        """The same machines, `gpus` of them (a pool of a larger cluster)."""
        return dataclasses.replace(self, gpus=gpus, gpus_per_node=min(self.gpus_per_node, gpus))


# Per GPU: peak dense bf16, HBM, NVLink bus bandwidth per direction, network per GPU; GPU
# nodes' links hierarchical (a node's adapters shared by its ranks in a group, as NCCL runs)
PRESETS: dict[str, dict] = {
    "h100": dict(flops=989e12, achievable=0.5, hbm_bytes=80 * GIB, intra_bw=450e9,
                 inter_bw=50e9, hierarchical=True),  # SXM, NVLink 4, 8 x 400 Gb/s per node
    "h200": dict(flops=989e12, achievable=0.5, hbm_bytes=141 * GIB, intra_bw=450e9,
                 inter_bw=50e9, hierarchical=True),  # H100's compute and links, more HBM
    "a100": dict(flops=312e12, achievable=0.5, hbm_bytes=80 * GIB, intra_bw=300e9,
                 inter_bw=25e9, hierarchical=True),  # SXM 80 GB, NVLink 3, 8 x 200 Gb/s a node
    "cpu": dict(flops=1e11, achievable=0.5, hbm_bytes=8 * GIB, intra_bw=5e9, inter_bw=1e9,
                intra_latency=20e-6, inter_latency=50e-6),  # placeholder until fitted
}


def cluster(preset: str, gpus: int, gpus_per_node: int = 8, **overrides) -> Cluster:
    """A preset's machines, `gpus` of them in nodes of `gpus_per_node`; `overrides` replace
    preset fields (e.g. achievable=0.4). `preset` may be a fitted cluster file (`*.json`, from
    `ds-omni calibrate-comm`): its "preset" and the fields it fitted."""
    if preset.endswith(".json"):
        fitted = load_fitted(preset)
        return cluster(fitted.pop("preset"), gpus, gpus_per_node, **(fitted | overrides))
    if preset not in PRESETS:
        raise ConfigError(f"unknown GPU preset {preset!r}; choose one of {sorted(PRESETS)} or "
                          "build a Cluster(...) by hand")
    return Cluster(gpus=gpus, gpus_per_node=gpus_per_node, name=preset,
                   **(PRESETS[preset] | overrides))


def load_fitted(path: str) -> dict:
    """A cluster file's fields: {"preset": name, field: value, ...} (or that under "cluster",
    as `ds-omni calibrate-comm` writes it)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the cluster file {path}: {e}; write one with "
                          "`ds-omni calibrate-comm --out FILE.json`") from None
    data = dict(data.get("cluster", data))
    unknown = sorted(set(data) - set(Cluster.__dataclass_fields__) - {"preset", "gpus",
                                                                      "gpus_per_node"})
    if unknown or data.get("preset") not in PRESETS:
        raise ConfigError(f"the cluster file {path} needs a \"preset\" of {sorted(PRESETS)} "
                          f"(got {data.get('preset')!r}) and only Cluster fields (unknown: "
                          f"{unknown})")
    data.pop("gpus", None), data.pop("gpus_per_node", None)
    return data
