"""What the two simulated paper evaluations share (`sim_megascale_omni.py`, `sim_bytescale.py`):
the papers' models as HF configs built locally (published dims, no download), and a small plan
search that gives ds_omni and every baseline its best plan over the same grid of degrees.

Throughput, not step time, is compared: budget mode may leave a few samples for the next step,
so plans of one global batch can train slightly different token counts. A plan whose peak memory
per GPU does not fit the GPUs is never "best"; a baseline with no fitting plan on the grid is
reported as `null` (the papers' "OOM").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ds_omni.errors import DsOmniError
from ds_omni.sim import baselines, memory
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import simulate
from ds_omni.sim.workload import Samples

# ViTs (CLIP-style: 2-matrix MLP, 14-pixel patches) by size. ~1B: ViT-g/14's dims (1.0 B);
# 2.4B and 10B: the same shape widened (no public ViT has exactly these sizes).
VITS = {"vit_1b": dict(hidden_size=1408, num_hidden_layers=40, intermediate_size=6144,
                       num_attention_heads=16),
        "vit_2.4b": dict(hidden_size=2048, num_hidden_layers=48, intermediate_size=8192,
                         num_attention_heads=16),
        "vit_10b": dict(hidden_size=4096, num_hidden_layers=50, intermediate_size=16384,
                        num_attention_heads=32)}
# LLMs: Mistral-Nemo-12B, Llama-3-70B, Llama-2-7B (their published configs' dims)
LLMS = {"llm_12b": ("mistral", dict(hidden_size=5120, num_hidden_layers=40,
                                    intermediate_size=14336, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=128, vocab_size=131072)),
        "llm_70b": ("llama", dict(hidden_size=8192, num_hidden_layers=80,
                                  intermediate_size=28672, num_attention_heads=64,
                                  num_key_value_heads=8, vocab_size=128256)),
        "llm_7b": ("llama", dict(hidden_size=4096, num_hidden_layers=32,
                                 intermediate_size=11008, num_attention_heads=32,
                                 num_key_value_heads=32, vocab_size=32000))}


def llm_config(name: str):
    from transformers import LlamaConfig, MistralConfig
    family, dims = LLMS[name]
    return (MistralConfig if family == "mistral" else LlamaConfig)(**dims)


def vlm_config(vit: str, llm: str):
    """A LLaVA-style composite config: the ViT's vision_config next to the LLM's text_config."""
    from transformers import CLIPVisionConfig, LlavaConfig
    vision = CLIPVisionConfig(patch_size=14, image_size=448, **VITS[vit])
    return LlavaConfig(vision_config=vision, text_config=llm_config(llm))


def model_spec(vit: str | None, llm: str) -> ModelSpec:
    return ModelSpec.from_hf_config(vlm_config(vit, llm) if vit else llm_config(llm))


def states_fit(model: ModelSpec, cluster, pp: int = 1, zero_stage: int = 1,
                room: float = 0.7) -> bool:
    """Whether the model states of one pipeline stage, ZeRO-partitioned over its ranks, take at
    most `room` of a GPU's memory (the rest for activations): plans failing it are not tried."""
    states = memory.model_states(model.total_params() / pp, model.trainable_params() / pp,
                                 cluster.gpus // pp, zero_stage, model.bytes_per_param)
    return states.total <= room * cluster.hbm_bytes


def billions(model: ModelSpec) -> dict:
    return {"total": model.total_params() / 1e9, "llm": model.llm_params() / 1e9,
            **{name: model.encoder_params(name) / 1e9 for name in model.dims.encoders}}


@dataclass
class Search:
    """Simulates plans on one cluster, model and drawn global batch; each distinct plan once."""

    cluster: object
    model: ModelSpec
    samples: Samples
    runs: dict = field(default_factory=dict)
    """{SimPlan: StepReport or DsOmniError}"""
    seconds: float = 0.0
    """Wall time spent simulating."""

    def run(self, plan: SimPlan):
        key = plan.replace(name="plan")  # baselines derived twice are one plan
        if key not in self.runs:
            start = time.perf_counter()
            try:
                self.runs[key] = simulate(self.cluster, self.model, self.samples, plan)
            except DsOmniError as e:  # a plan training refuses, or degrees not dividing the GPUs
                self.runs[key] = e
            self.seconds += time.perf_counter() - start
        return self.runs[key]

    def best(self, plans) -> tuple[SimPlan | None, object]:
        """The fitting plan of the most tokens/s and its report; if none fits, None and the
        report of least peak memory (None if every plan was refused)."""
        found = [(plan, self.run(plan)) for plan in plans]
        fitting = [(p, r) for p, r in found if not isinstance(r, DsOmniError) and r.fits]
        if not fitting:
            return None, min((r for _, r in found if not isinstance(r, DsOmniError)),
                             key=lambda r: r.peak_memory, default=None)
        return max(fitting, key=lambda pr: tokens_per_s(pr[1]))

    def baselines(self, candidates, names=baselines.BASELINES, also=None) -> dict:
        """{name: (plan, report)}: each baseline at its best over the baselines derived from
        every candidate (so each keeps its own best degrees, not ds_omni's) and the plans of
        its family `also` names ({name: [SimPlan]}: the as-run ones, so tuned >= as run)."""
        derived = {name: [] for name in names}
        for samples in self.sized_by():
            for plan in candidates:
                for name, base in baselines.baseline_plans(plan, self.cluster.gpus, self.model,
                                                           samples).items():
                    if name in derived:
                        derived[name].append(base)
        for name, plans in (also or {}).items():
            if name in derived:
                derived[name] += [p.replace(name=name) for p in plans if p is not None]
        return {name: self.best(plans) for name, plans in derived.items()}


    def sized_by(self) -> list:
        """The samples a tuned baseline's plan may be derived from (pool sizes, SP degrees)."""
        return [self.samples]


def tokens_per_s(report) -> float:
    return report.tokens / report.step_time


def brief(plan: SimPlan | None, report) -> dict | None:
    """What the results file keeps of a plan's run; no fitting plan: None, or the least peak
    memory per GPU any plan needed (`{"fits": false, ...}`)."""
    if plan is None:
        return None if report is None else {"fits": False, "tokens_per_s": None,
                                            "least_peak_memory_gib": report.peak_memory / 2 ** 30}
    keep = ("sp", "cp", "pp", "tp", "ep", "zero_stage", "micro_batches", "pack_tokens", "reorder", "reorder_group",
            "max_sequence_sp", "encoder_mode", "encoder_placement", "stage_split", "encoder_gpus")
    return {"plan": {k: getattr(plan, k) for k in keep},
            "step_time_s": report.step_time, "tokens": report.tokens, "samples": report.samples,
            "fits": True, "tokens_per_s": tokens_per_s(report), "mfu": report.mfu,
            "peak_memory_gib": report.peak_memory / 2 ** 30,
            "critical_phase": report.critical_phase, "phases_s": phases(report)}


def phases(report) -> dict:
    """{phase: seconds} of the step's critical path (what the step waited on, by phase)."""
    out: dict = {}
    for seg in report.critical_path:
        out[seg["phase"]] = out.get(seg["phase"], 0.0) + seg["seconds"]
    return {k: round(v, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def space_plans(search: Search, base: SimPlan, space, budget_s: float, top: int = 4) -> list:
    """The `top` plans of the full plan space (`ds_omni.sim.search`: dp, ZeRO stage, tp, pp with
    both encoder placements, sp, cp, per-sequence SP, the pool, ep where the model has experts)
    on the search's samples, within `budget_s` seconds of CPU (the best found when it runs out)."""
    from ds_omni.sim.search import search as full_search
    found = full_search(search.cluster, search.model, search.samples, base, top=top,
                        space=space, budget_s=budget_s, baselines=False)
    return [r.plan.replace(name=base.name) for r in found.top], found


def own_version(plan: SimPlan, ours: SimPlan) -> SimPlan | None:
    """A baseline's plan as ds_omni would run it (its degrees and batch; ds_omni's encoding and
    reordering), or None when the plan is not one training runs (encoders on their own GPUs)."""
    if plan is None or plan.encoder_gpus:
        return None
    return plan.replace(name=ours.name, encoder_mode="reshard", reorder=ours.reorder,
                        reorder_group=ours.reorder_group)


def fixed(search: Search, plan: SimPlan | None) -> dict | None:
    """An as-run baseline's fixed plan on the search's samples (None: no plan was chosen)."""
    if plan is None:
        return None
    run = search.run(plan)
    if isinstance(run, DsOmniError):
        return {"fits": False, "tokens_per_s": None, "error": str(run)}
    return brief(plan, run) if run.fits else {
        "fits": False, "tokens_per_s": None, "least_peak_memory_gib": run.peak_memory / 2 ** 30}


def speedups(ours: dict, theirs: dict) -> dict:
    """{baseline: ds_omni tokens/s over the baseline's (its step time over ours, per token)}."""
    return {name: (ours["tokens_per_s"] / base["tokens_per_s"]
                   if base and base["tokens_per_s"] else None)
            for name, base in theirs.items()}


@dataclass
class RunReport:
    """A plan's run over several steps, read as one long step: tokens and time summed (so tokens/s
    is the run's), MFU time-weighted, peak memory the steps' highest, critical paths joined."""

    tokens: float
    samples: int
    step_time: float
    mfu: float
    peak_memory: float
    fits: bool
    critical_path: list
    critical_phase: str


@dataclass
class Swing(Search):
    """A run whose steps each have their own mix (`steps`: one Search per step, their caches
    shared with the fixed-mix cases); one plan runs every step. `samples` holds the run's average
    mix, the one the as-run pools are sized for."""

    steps: list = field(default_factory=list)

    def run(self, plan: SimPlan):
        key = plan.replace(name="plan")
        if key not in self.runs:
            reports = [s.run(plan) for s in self.steps]
            failed = [r for r in reports if isinstance(r, DsOmniError)]
            self.runs[key] = failed[0] if failed else _joined(reports)
        return self.runs[key]

    def sized_by(self) -> list:
        """Every step's samples: a tuned baseline may size its plan for any of the run's mixes
        (its pool for the highest, say), then keeps it for the run."""
        return [s.samples for s in self.steps]


def _joined(reports: list) -> RunReport:
    time_s = sum(r.step_time for r in reports)
    path = [seg for r in reports for seg in r.critical_path]
    per = {}
    for seg in path:
        per[seg["phase"]] = per.get(seg["phase"], 0.0) + seg["seconds"]
    return RunReport(tokens=sum(r.tokens for r in reports), samples=sum(r.samples for r in reports),
                     step_time=time_s, mfu=sum(r.mfu * r.step_time for r in reports) / time_s,
                     peak_memory=max(r.peak_memory for r in reports),
                     fits=all(r.fits for r in reports), critical_path=path,
                     critical_phase=max(per, key=per.get) if per else "")
