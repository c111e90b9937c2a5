"""A ds_omni run's config as the simulator's inputs: the model (its HF configs, read from the
model built on the meta device: no weights made or read) and the plan (`plan_run`, the training's
own composition root, resolves and checks it), and a workload file.

What `ds-omni plan --simulate` and `ds-omni plan --search` run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from ds_omni.config import OmniConfig
from ds_omni.config.composition import DEGREES
from ds_omni.data.loader import pack_tokens
from ds_omni.errors import ConfigError, DsOmniError
from ds_omni.model.build import build_model
from ds_omni.parallelize.tensor_parallel import tp_beyond_kv_heads
from ds_omni.sim.baselines import as_run, compare
from ds_omni.sim.cluster import cluster
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.search import as_dict, search
from ds_omni.sim.workload import WorkloadSpec, from_check_report
from ds_omni.train.setup import plan_run

log = logging.getLogger(__name__)


def model_spec(cfg: OmniConfig) -> ModelSpec:
    with torch.device("meta"):
        built = build_model(cfg.model)
    return ModelSpec.from_hf_config(built.hf_config, frozen=tuple(cfg.model.frozen_parts()),
                                    scales=cfg.data.reorder.cost_scales)


def resolved_sim_placement(par) -> str:
    """parallel.encoder_placement as given: the simulator resolves "auto" as training does
    (`bubble_sim.resolve_auto`) and runs "bubbles" as its own schedule."""
    return par.encoder_placement


def sim_plan(cfg: OmniConfig, ds_json: dict, gpus: int) -> SimPlan:
    """The config's plan on `gpus` ranks, checked as `ds-omni train` would check it."""
    plan, ds_config = plan_run(cfg, ds_json, gpus)
    micro = ds_config["gradient_accumulation_steps"]
    batch = cfg.train.global_batch_size
    pack = pack_tokens(cfg.data, batch, plan.dp, micro)  # the loader's packing budget
    # the config's section with the resolved dp and the tokens training plans its stage
    # boundaries for (`ds_omni.parallelize.pipeline.stage_tokens`)
    par = dataclasses.replace(cfg.parallel, dp=plan.dp,
                              stage_tokens=cfg.parallel.stage_tokens or cfg.data.max_seq_len,
                              encoder_placement=resolved_sim_placement(cfg.parallel))
    return SimPlan(name="ds_omni", parallel=par, reordering=cfg.data.reorder,
                   zero_stage=int(ds_config.get("zero_optimization", {}).get("stage", 0)),
                   global_batch=batch, micro_batches=micro, pack_tokens=pack,
                   checkpointing="llm" in cfg.model.checkpointed_parts())


def load_workload(path: str | None, model: ModelSpec, max_seq_len: int) -> WorkloadSpec:
    """A workload file: a `ds-omni data check --json` report (it has "sources"), or the fields
    of a `WorkloadSpec`; none: the default mix within `max_seq_len` tokens a sample (two images
    at most, together at most half of it), without a modality the model has no encoder for."""
    if path is None:
        patches = max(16, min(4096, int(max_seq_len / 4 / WorkloadSpec.llm_tokens_per_patch)))
        return WorkloadSpec(audio_fraction=0.1 if "audio" in model.dims.encoders else 0.0,
                            image_fraction=0.5 if "vision" in model.dims.encoders else 0.0,
                            max_tokens=max_seq_len, max_images=2,
                            patches_range=(max(4, patches // 16), patches),
                            audio_seconds=(1.0, min(30.0, max_seq_len / 2 / 25.0)))
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the workload file {path}: {e}") from None
    if "sources" in data:
        return from_check_report(data, max_tokens=max_seq_len)
    unknown = sorted(set(data) - set(WorkloadSpec.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"the workload file {path} has unknown fields {unknown}; it takes "
                          f"{sorted(WorkloadSpec.__dataclass_fields__)} or a data-check report")
    return WorkloadSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def simulate_config(cfg: OmniConfig, ds_json: dict, *, gpus: int, gpus_per_node: int = 8,
                    gpu: str = "h100", workload: str | None = None, seed: int = 0) -> dict:
    """`ds-omni plan --simulate`: the config's plan and the five baselines on one cluster, the
    same samples for all; plain data (the plan's report in full, the baselines' step times and
    the plan's speed-up over each)."""
    c = cluster(gpu, gpus, gpus_per_node)
    model = model_spec(cfg)
    work = load_workload(workload, model, cfg.data.max_seq_len)
    plan = sim_plan(cfg, ds_json, gpus)
    say_tp_warnings(model, [plan.tp])
    reports = compare(c, model, work, plan, seed)
    ours = reports.pop("ds_omni")
    out = {"cluster": {"gpu": gpu, "gpus": gpus, "gpus_per_node": gpus_per_node},
           "plan": ours.summary(), "baselines": {}}
    for name, r in reports.items():
        out["baselines"][name] = ({"error": str(r)} if isinstance(r, Exception) else
                                  {"step_time": r.step_time, "mfu": r.mfu, "fits": r.fits,
                                   "speedup_of_plan": r.step_time / ours.step_time,
                                   "critical_phase": r.critical_phase})
    return out


UNSHOWN = ("sp", "pp", "tp", "ep", "max_sequence_sp")
"""Degrees the summary line shows always (sp, pp) or never (as it always has); any other degree
of the composition table is shown where it is > 1 (`format_simulation`)."""


def format_simulation(out: dict) -> str:
    """The simulation for people: the plan's step, then a line per baseline."""
    p = out["plan"]
    gib = 2 ** 30
    lines = [f"cluster: {out['cluster']['gpus']} x {out['cluster']['gpu']} "
             f"({out['cluster']['gpus_per_node']} per node)",
             f"plan: dp={p['plan']['dp']} sp={p['plan']['sp']} "
             + "".join(f"{d}={p['plan'][d]} " for d in DEGREES  # cp, a new axis: where > 1
                       if d not in UNSHOWN and p['plan'].get(d, 1) > 1) +
             f"pp={p['plan']['pp']} "
             f"zero={p['plan']['zero_stage']} reorder={p['plan']['reorder']} "
             f"encoders={p['plan']['encoder_mode']}",
             f"  step time {p['step_time']:.4f} s, MFU {p['mfu']:.1%}, "
             f"{p['samples']} samples / {p['tokens']} tokens",
             f"  critical path: rank {p['critical_rank']}, mostly {p['critical_phase']}; "
             + ", ".join(f"{k} {v:.4f} s" for k, v in p["critical_path"]["by_phase"].items()),
             f"  per rank (max/mean/min s): compute {_mmm(p['compute_s'])}, comm "
             f"{_mmm(p['comm_s'])}, idle {_mmm(p['idle_s'])}",
             f"  peak memory {p['peak_memory'] / gib:.1f} GiB on rank {p['peak_memory_rank']} "
             f"({'fits' if p['fits'] else 'DOES NOT FIT'}): "
             + ", ".join(f"{k} {v / gib:.1f}" for k, v in p["memory"].items()),
             "  all-to-all bytes: " + ", ".join(f"{k} {v / 1e9:.3f} GB"
                                                for k, v in p["all_to_all_bytes"].items()),
             "baselines (same model, same samples):"]
    for name, b in out["baselines"].items():
        lines.append(f"  {name:10s} " + (f"error: {b['error']}" if "error" in b else
                     f"step {b['step_time']:.4f} s, MFU {b['mfu']:.1%}, the plan's speed-up "
                     f"{b['speedup_of_plan']:.2f}x, mostly {b['critical_phase']}"
                     + ("" if b["fits"] else ", DOES NOT FIT")))
    return "\n".join(lines)


def say_tp_warnings(model: ModelSpec, tps: list[int]) -> None:
    """Log `tp_beyond_kv_heads` once for each distinct tp of `tps` (the plans reported)."""
    if model.text_config is None:
        return
    for tp in sorted(set(tps)):
        if tp > 1 and (note := tp_beyond_kv_heads(model.text_config, tp)):
            log.warning(note)


def _mmm(d: dict) -> str:
    return f"{d['max']:.4f}/{d['mean']:.4f}/{d['min']:.4f}"


def training_check(cfg: OmniConfig, ds_json: dict, gpus: int):
    """`check(plan)` for the search: training's `plan_run` on the config with the plan's
    degrees, ZeRO stage and encoder placement (its family, heads, experts, batch and pipeline
    checks), once per distinct combination."""
    seen: dict = {}

    def check(plan: SimPlan) -> None:
        par = dataclasses.replace(plan.parallel, dp="auto", encoder_pool="off")
        key = (tuple(vars(par).values()), plan.zero_stage)
        if key not in seen:
            zero = dict(ds_json.get("zero_optimization", {}), stage=plan.zero_stage)
            try:
                plan_run(dataclasses.replace(cfg, parallel=par),
                         dict(ds_json, zero_optimization=zero), gpus)
                seen[key] = None
            except DsOmniError as e:
                seen[key] = e
        if seen[key] is not None:
            raise seen[key]
        if plan.pp > 1:  # what the model's layers refuse as stages: plan_run builds no model
            if "stages" not in seen:
                seen["stages"] = pipeline_refusal(cfg)
            if seen["stages"] is not None:
                raise seen["stages"]
    return check


def pipeline_refusal(cfg: OmniConfig) -> DsOmniError | None:
    """Why the model's layers cannot be pipeline stages (`pipeline_layers`' checks: a tied head,
    per-token layer inputs, a two-way mask) on the meta-device model, or None. Without it the
    search would rank pp plans that training then refuses (ERNIE-4.5-VL's)."""
    from ds_omni.parallelize.pipeline import StepInputs, pipeline_layers
    with torch.device("meta"):
        built = build_model(cfg.model)
    try:
        pipeline_layers(built.model, StepInputs())
    except DsOmniError as e:
        return e
    return None


def search_config(cfg: OmniConfig, ds_json: dict, *, gpus: int, gpus_per_node: int = 8,
                  gpu: str = "h100", workload: str | None = None, seed: int = 0, top: int = 5,
                  budget_s: float | None = None) -> dict:
    """`ds-omni plan --search`: the config's plan space on one cluster, ranked on one draw of
    the workload (plain data, `search.as_dict`)."""
    c = cluster(gpu, gpus, gpus_per_node)
    model = model_spec(cfg)
    base = sim_plan(cfg, ds_json, gpus)
    samples = load_workload(workload, model, cfg.data.max_seq_len).draw(
        base.global_batch, seed, tuple(model.dims.encoders))
    result = search(c, model, samples, base, top=top, check=training_check(cfg, ds_json, gpus),
                    budget_s=budget_s)
    say_tp_warnings(model, [r.plan.tp for r in result.top])  # once, not per candidate
    if result.top:
        result.baselines_as_run = as_run(c, model, samples, result.top[0].plan,
                                         cfg.data.max_seq_len, result.cache)
    return {"cluster": {"gpu": gpu, "gpus": gpus, "gpus_per_node": gpus_per_node},
            **as_dict(result)}
