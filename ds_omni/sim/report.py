"""The simulator's answer for one plan: step time, its critical path, per-rank compute /
communication / idle, MFU, peak memory per rank (model states by ZeRO stage + activations),
and the bytes the all-to-alls move."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds_omni.sim import memory, model_parallel
from ds_omni.sim.pipeline_sim import held_params
from ds_omni.sim.separate import encoder_states_params


@dataclass
class StepReport:
    name: str
    step_time: float
    """Seconds of one optimizer step."""
    critical_path: list[dict]
    """[{rank, phase, seconds}] what the step waited on, first to last."""
    critical_rank: int
    """The rank with the most time on the critical path."""
    critical_phase: str
    """The phase with the most time on the critical path."""
    compute: list[float]
    """[W] seconds each rank computes."""
    comm: list[float]
    """[W] seconds each rank communicates."""
    idle: list[float]
    """[W] seconds each rank waits for others."""
    mfu: float
    """Model FLOPs (the step's samples, forward + backward, no recompute) / (step time x GPUs x
    peak FLOP/s)."""
    peak_memory: float
    """Bytes of the fullest rank at its fullest."""
    peak_memory_rank: int
    memory: dict
    """The fullest rank's bytes by kind: params, grads, optimizer, gathered, activations."""
    fits: bool
    """peak_memory <= the GPUs' memory."""
    all_to_all_bytes: dict
    """Bytes crossing ranks in the step, by exchange (forward + backward)."""
    samples: int
    """Samples the step trains."""
    tokens: int
    plan: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """The report without its per-rank lists (those: `as_dict`)."""
        out = self.as_dict()
        for k in ("compute", "comm", "idle"):
            v = np.asarray(out.pop(k))
            out[f"{k}_s"] = {"max": float(v.max()), "mean": float(v.mean()), "min": float(v.min())}
        phases: dict = {}
        for seg in self.critical_path:
            phases[seg["phase"]] = phases.get(seg["phase"], 0.0) + seg["seconds"]
        out["critical_path"] = {"by_phase": phases, "segments": len(self.critical_path)}
        return out

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def build_report(step) -> StepReport:
    tl, c, m = step.timeline, step.cluster, step.model
    path = tl.critical_path()
    by_rank, by_phase = {}, {}
    for seg in path:
        by_rank[seg["rank"]] = by_rank.get(seg["rank"], 0.0) + seg["seconds"]
        by_phase[seg["phase"]] = by_phase.get(seg["phase"], 0.0) + seg["seconds"]
    planned = step.assignment.planned
    flops = float(step.sample_cost[planned].sum())
    t = tl.step_time
    mem = rank_memory(step)
    worst = int(np.argmax(mem["total"]))
    return StepReport(
        name=step.plan.name, step_time=t, critical_path=path,
        critical_rank=max(by_rank, key=by_rank.get) if by_rank else 0,
        critical_phase=max(by_phase, key=by_phase.get) if by_phase else "",
        compute=tl.compute.tolist(), comm=tl.comm.tolist(), idle=tl.idle.tolist(),
        mfu=flops / (t * c.gpus * c.flops) if t > 0 else 0.0,
        peak_memory=float(mem["total"][worst]), peak_memory_rank=worst,
        memory={k: float(v[worst]) for k, v in mem.items() if k != "total"},
        fits=bool(mem["total"][worst] <= c.hbm_bytes),
        all_to_all_bytes={k: float(v) for k, v in step.a2a_bytes.items()},
        samples=int(planned.size), tokens=int(step.samples.tokens[planned].sum()),
        plan=step.plan.as_dict())


def rank_memory(step) -> dict[str, np.ndarray]:
    """[W] bytes per rank by kind, and their total."""
    p, m, plan = step.pplan, step.model, step.plan
    w = step.cluster.gpus
    kinds = {k: np.zeros(w) for k in ("params", "grads", "optimizer", "gathered", "activations")}
    for s in range(p.pp):
        ranks = step.ranks_of(0, p.dp, s)
        for shard in model_parallel.state_shards(step, s, held_params(step, s)):
            _states_into(kinds, ranks, (shard.params, shard.trainable), shard.group_size,
                         plan.zero_stage, m)
        kinds["gathered"][ranks] = memory.gathered_bytes(m.llm_layer_params(p.tp, p.ep),
                                                         plan.zero_stage, m.bytes_per_param)
    if plan.encoder_gpus:
        enc = np.arange(p.world_size, w)
        _states_into(kinds, enc, encoder_states_params(step), plan.encoder_gpus, 1, m)
        kinds["gathered"][enc] = memory.gathered_bytes(m.llm_layer_params(), 1,
                                                       m.bytes_per_param)
    kinds["activations"] = step.act_peak.copy()
    kinds["total"] = sum(kinds.values())
    return kinds


def _states_into(kinds, ranks, held, dp: int, zero: int, m) -> None:
    st = memory.model_states(held[0], held[1], dp, zero, m.bytes_per_param)
    for k, v in st.as_dict().items():
        kinds[k][ranks] += v
