"""The machine the step simulator validation predicts with (`benchmarks/sim_validation.py`),
fitted on runs apart from the validated ones: the compute profiled on other data seeds
(`calibrate_compute`: one FLOP/s rate and a cost a micro-batch per parameter, the optimizer's
cost a parameter), then DeepSpeed's engine on top (`calibrate_engine`: a cost a micro-batch per
parameter, one a step, one a Ulysses all-to-all call), from each model's dp and static-SP plans
at micro-batch sizes the validated runs do not use."""

from __future__ import annotations

import dataclasses
import time

from benchmarks.sim_validation import (CONFIGS, busy_s, config, flop_model, model_of, one_step,
                                       sample_meta, samples_of)


# what the compute calibration profiles: per model, (a plan of its workload, its mixes) and the
# samples a micro-batch; text-only and image rows of several sizes, never the validated batches
CALIBRATION = {"pipeline": (("dp2_image", "dp2_text"), (1, 2, 4, 8)),
               "longtail": (("dp4_longtail",), (1, 2, 4))}


def calibrate_compute(names: list[str], out_dir: str, sources: dict, batches: int,
                      cluster_file: str, engine_steps: int = 3, stored: dict | None = None,
                      engine: bool = True) -> dict:
    """Per world size of `names`' plans, the machine in CPU seconds: `world` processes profile
    at once (`calibration_rank`), as the ranks of the measured runs share this machine's cores
    (a rank's CPU seconds grow when its neighbours run), on batches of other data seeds than
    the validated runs' (seed 0); one FLOP/s rate and one cost a micro-batch per parameter
    fitted over all of them (`fit_rate`), and the optimizer's seconds a parameter; then the
    engine's costs on top (`calibrate_engine`; `engine=False`: not yet, `with_engine` adds
    them later). `stored`: an earlier run's result, whose profiles are kept (only the engine
    calibration runs again)."""
    from tests.harness import run_on_ranks
    out = {}
    for world in sorted({CONFIGS[n][0] for n in names}):
        group = [n for n in names if CONFIGS[n][0] == world]
        if stored:
            profiles = stored[str(world)]["profiles"]
        else:
            per_rank = run_on_ranks(calibration_rank, world,
                                    args=(group, out_dir, sources, batches), timeout=1200)
            profiles = {f"rank{r}/{k}": v for r, p in enumerate(per_rank) for k, v in p.items()}
        out[str(world)] = {"machine": with_pool(fit_machine(profiles), world),
                           "profiles": profiles}
        if engine:
            out[str(world)] = with_engine(out[str(world)], calibrate_engine(
                group, out[str(world)]["machine"], cluster_file, out_dir, sources, engine_steps))
    return out


def with_pool(machine: dict, world: int) -> dict:
    """`machine` with the encoder pool's planning cost an item (`Cluster.pool_item_s`), timed
    now by its micro-benchmark (`calibrate_comm.time_pool_planning`, ~0.1 s; pure, no process
    group) for a pool of `world` ranks, ring attention's block FLOP/s
    (`Cluster.ring_flops_per_s`, `time_ring_blocks_at_once`: `world` processes at once, as
    the runs and the compute profiles share the cores; ~5 s), and AutoEP's MoE layer beyond its
    FLOPs (`Cluster.moe_token_flops`, `expert_half_tokens`: `calibrate_moe`, ~10 s, at the MoE
    LLM's widths on random tokens), where the machine has none yet (a measurement from before
    they were calibrated: `--reuse` times them here)."""
    from ds_omni.sim.calibrate_comm import time_pool_planning, time_ring_blocks_at_once
    if "moe_token_flops" not in machine:
        machine = dict(machine, **moe_terms())
    if "pool_item_s" not in machine:
        machine = dict(machine, pool_item_s=time_pool_planning(world))
    if "ring_flops_per_s" not in machine:  # ring attention's kernel (`ring_shape`)
        machine = dict(machine, ring_flops_per_s=time_ring_blocks_at_once(world, **ring_shape()))
    return machine


def ring_shape() -> dict:
    """The ring kernel's timed block: the long tail's heads and a ~1,500-token row's half (a
    ring of 2)."""
    from benchmarks.per_sequence_sp import LLM
    heads = LLM["num_attention_heads"]
    return {"heads": heads, "head_dim": LLM["hidden_size"] // heads, "tokens": 768}


def moe_terms() -> dict:
    """`Cluster.moe_token_flops` and `expert_half_tokens` of the validation's MoE LLM's layer
    (`sim_validation.MOE_LLM`), and what they were fitted from ("moe_layer")."""
    from benchmarks.sim_validation import MOE_LLM
    from ds_omni.sim.calibrate_moe import fit_moe_layer, time_moe_layer
    timed = time_moe_layer(MOE_LLM["hidden_size"], MOE_LLM["num_experts"],
                           MOE_LLM["num_experts_per_tok"], MOE_LLM["moe_intermediate_size"])
    fit = fit_moe_layer(timed)
    return {"moe_token_flops": fit["moe_token_flops"],
            "expert_half_tokens": fit["expert_half_tokens"], "moe_layer": timed | fit}


# the profiled machine's compute terms, in seconds of work and in work a second: what the
# measured launch's load slows (`calibrate_engine`'s compute_scale); ring attention's rate is
# timed in the launch itself (`sim_validation.ranks`), so it is not among them
SLOWED_SECONDS = ("micro_batch_s_per_param", "optimizer_s_per_param", "pool_item_s")
SLOWED_RATES = ("flops_per_s",)


def with_engine(compute: dict, engine: dict) -> dict:
    """One world's profiled machine (`calibrate_compute`) with the engine's fitted costs on
    top: its compute terms slowed by the launch's `compute_scale`, its step cost, and its cost
    a micro-batch per parameter added to the profile's."""
    k = engine.get("compute_scale", 1.0)
    machine = dict(compute["machine"], step_s=engine["step_s"], compute_scale=k,
                   **{f: engine.get(f, 0.0) for f in ENGINE_TERMS})
    for name in SLOWED_SECONDS:
        machine[name] = machine.get(name, 0.0) * k
    for name in SLOWED_RATES:
        machine[name] = machine[name] / k
    machine["micro_batch_s_per_param"] += engine["engine_micro_batch_s_per_param"]
    return dict(compute, machine=machine, engine=engine)


def profiled_machine(compute: dict) -> dict:
    """One world's machine as its profile fitted it, before `with_engine` (what an engine
    calibration is fitted on top of)."""
    engine, k = compute.get("engine", {}), compute["machine"].get("compute_scale", 1.0)
    machine = dict(compute["machine"], step_s=0.0, **dict.fromkeys(ENGINE_TERMS, 0.0))
    machine["micro_batch_s_per_param"] -= engine.get("engine_micro_batch_s_per_param", 0.0)
    for name in SLOWED_SECONDS:
        machine[name] = machine.get(name, 0.0) / k
    for name in SLOWED_RATES:
        machine[name] = machine[name] * k
    machine.pop("compute_scale", None)
    return machine


def engine_specs(names: list[str]) -> list[tuple[str, int]]:
    """The (plan, micro-batch size) runs of the engine calibration for `names`' models."""
    return [(name, micro) for work, runs in ENGINE_CALIBRATION.items()
            if work in {model_of(n) for n in names} for name, sizes in runs for micro in sizes]


# the engine calibration: the `world` ranks train each model's data-parallel plan (dp=world,
# never a validated run: data seed 1234, micro-batches of 1 and 4 samples where the validated
# runs have 2) with DeepSpeed, the pipeline model's on both mixes (compute apart at one count
# of micro-batches: else `compute_scale` and `step_s` trade freely, and dp2_text took the
# image runs' step_s, +37 %), and each model's static-SP plan the same way, for the seconds of
# a Ulysses call, and a pipeline plan of each (its passes and p2p bytes: 16 or 4 micro-batches
# of 1 or 4 samples tell a pass's cost from a byte's)
ENGINE_CALIBRATION = {"pipeline": (("dp2_image", (1, 4)), ("dp2_text", (1, 4)),
                                   ("sp2_static_text", (1, 4)), ("pp2_stage0_text", (1, 4))),
                      "longtail": (("dp4_longtail", (1, 4)), ("sp2x2_static_longtail", (1, 4)),
                                   ("pp2_sp2_longtail", (1, 4)))}


def engine_config(name: str, micro: int, out_dir: str, sources: dict, steps: int):
    cfg = config(name, f"{out_dir}/engine_{name}_{micro}", sources, steps, seed=1234)
    data = dataclasses.replace(cfg.data, pack_tokens=cfg.data.max_seq_len * micro)
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(
        cfg.train, micro_batch_size=micro))


def engine_rank(rank: int, world: int, specs: list, out_dir: str, sources: dict,
                steps: int) -> dict:
    """One of `world` ranks training with DeepSpeed: `steps` steps of each (plan, micro-batch
    size) of `specs`, the CPU seconds of each and its samples (as `ranks` records them)."""
    import torch
    from deepspeed.utils import groups as ds_groups
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.train.setup import setup_training
    from tests.fixtures import ds_config
    torch.set_num_threads(1)
    out = {}
    for name, micro in specs:
        cfg = engine_config(name, micro, out_dir, sources, steps)
        plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
        _, loader, engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_config(1), plan),
                                                   rank, plan)
        log = [one_step(loader, engine, groups, ds_groups) for _ in range(steps)]
        for record in log:
            record["samples"] = sample_meta(loader, record.pop("keys"))
        out[f"{name}/{micro}"] = log
    return out


def calibrate_engine(names: list[str], machine: dict, cluster_file: str, out_dir: str,
                     sources: dict, steps: int = 3, logs: dict | None = None,
                     warmup: int = 1) -> dict:
    """What DeepSpeed's engine adds on this machine to the profiled model, under the measured
    runs' conditions (`world` ranks at once on the shared cores, their gradient collectives
    and hooks): the ranks train each model's dp, static-SP and pipeline plans at two micro-batch
    sizes (`ENGINE_CALIBRATION`); the busiest rank's CPU seconds above the communication seconds the
    fitted links predict for that step, fitted (non-negative least squares) as its profiled
    compute seconds times `compute_scale` (the launch's load slows every kernel: on this shared
    machine a loaded launch's compute took 2.2-2.5x the profile's CPU seconds, a cost that
    grows with the work, not a constant a step), a cost a micro-batch per parameter (the
    engine's hooks and gradient buffers), one a step, from the sp runs one a Ulysses
    all-to-all call (DeepSpeed's `_SeqAllToAll` around the wire: its Python and layout
    copies, on the CPU clock) and from the pipeline runs one a pass (PipelineEngine's
    instruction loop) and one a p2p byte (its buffers and copies): `engine_row`. `logs`: the
    runs already trained ("plan/micro" -> per rank the step records, `ranks`' calibration: in
    the measured launch), their first `warmup` steps left out (a stored launch: the runs it
    has); else they train here, `steps` steps each."""
    import numpy as np
    from ds_omni.data.cost import nnls
    from tests.harness import run_on_ranks
    world = CONFIGS[names[0]][0]
    specs = engine_specs(names)
    if logs is not None:
        specs = [(n, m) for n, m in specs if f"{n}/{m}" in logs]
    if logs is None:
        per_rank = run_on_ranks(engine_rank, world, args=(specs, out_dir, sources, steps),
                                timeout=1200)
        logs, warmup = {k: [r[k] for r in per_rank] for k in per_rank[0]}, 1
    rows, residual = [], []
    for name, micro in specs:
        cfg = engine_config(name, micro, out_dir, sources, steps)
        run = logs[f"{name}/{micro}"]
        for s in range(warmup, len(run[0])):  # the first steps warm up
            row, comm_s = engine_row(cfg, world, machine, cluster_file, samples_of(run, s))
            rows.append(row)
            residual.append(max(log[s]["cpu_s"] for log in run) - comm_s)
    a, y = np.array(rows), np.maximum(np.array(residual), 0.0)
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0  # no sp (pipeline) run: no calls (passes, bytes)
    fit = dict(zip(("compute_scale", "engine_micro_batch_s_per_param", "step_s",
                    *ENGINE_TERMS), (float(v) for v in nnls(a / scale, y) / scale)))
    return fit | {"residual_s": [float(v) for v in y - a[:, 0]],
                  "micro_batches_x_params": [r[1] for r in rows], "world": world}


# the engine's terms priced by the simulator itself, each fitted from the seconds one unit of
# it adds to the busiest rank (`engine_row`): a Ulysses (or TP) call's, a pipeline pass's and a
# p2p byte's (the pipeline runs); the unit each is probed at
ENGINE_TERMS = {"a2a_call_s": 1.0, "pipe_pass_s": 1.0, "p2p_byte_s": 1e-9}


def engine_row(cfg, world: int, machine: dict, cluster_file: str, samples) -> tuple:
    """One engine-calibration step of `cfg` simulated on the profiled `machine`: the fit's row
    (the busiest rank's compute seconds, its micro-batches x held parameters, 1 for the step,
    then what one unit of each `ENGINE_TERMS` adds to its busy seconds, as the simulator
    prices it) and its communication seconds. The plan as `sim_validation.predict` simulates
    it (AutoTP's calls)."""
    import numpy as np
    from ds_omni.sim.cluster import cluster
    from ds_omni.sim.from_config import sim_plan
    from ds_omni.sim.step import simulate
    from ds_omni.train.calibrate import machine_fields
    from tests.fixtures import ds_config
    model, fields = flop_model(cfg), machine_fields(machine)
    plan = sim_plan(cfg, ds_config(1), world).replace(autotp_calls=True)

    def busy(**extra):
        report = simulate(cluster(cluster_file, world, world, **(fields | extra)), model,
                          samples, plan)
        return report, np.add(report.compute, report.comm)
    report, base = busy()
    b = int(np.argmax(base))

    def unit(field: str, step: float) -> float:
        return float(busy(**{field: fields[field] + step})[1][b] - base[b]) / step
    per_param = unit("micro_batch_s_per_param", 1e-9)
    return ([report.compute[b], per_param, 1.0, *(unit(f, u) for f, u in ENGINE_TERMS.items())],
            report.comm[b])


def calibration_rank(rank: int, world: int, names: list[str], out_dir: str, sources: dict,
                     batches: int) -> dict:
    """One calibration process: `train/calibrate.profile` of each model of `names` at its
    CALIBRATION sizes and mixes, on data seed 1234 + rank, one thread (as the ranks train)."""
    import torch
    import torch.distributed as dist
    from ds_omni.train.calibrate import profile
    torch.set_num_threads(1)
    dist.barrier()  # start together: the contention of the measured runs
    out = {}
    for work, (plans, sizes) in CALIBRATION.items():
        if work not in {model_of(n) for n in names}:
            continue
        for name in plans:
            cfg = config(name, f"{out_dir}/calib{rank}", sources, batches + 1, seed=1234 + rank)
            # room for `size` samples in one packed row (the longest are ~1,500 tokens)
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(
                cfg.data, pack_tokens=cfg.data.max_seq_len * max(sizes)))
            out[f"{work}/{name}"] = profile(cfg, batches, clock=time.process_time, sizes=sizes)
    return out


def fit_machine(profiles: dict) -> dict:
    """One FLOP/s rate and one cost a micro-batch per parameter over every profiled
    micro-batch of `profiles` (`fit_rate`), the median optimizer seconds a parameter."""
    import numpy as np
    from ds_omni.train.calibrate import fit_rate
    measured = [p["measured"] for p in profiles.values()]
    flops = np.concatenate([m["flops"] for m in measured])
    seconds = np.concatenate([m["seconds"] for m in measured])
    params = np.concatenate([np.full(len(m["seconds"]), m["params"]) for m in measured])
    rate, per_param = fit_rate(flops, seconds, params)
    error = np.abs(flops / rate + params * per_param - seconds) / seconds
    return {"flops_per_s": rate, "micro_batch_s_per_param": per_param,
            "optimizer_s_per_param": float(np.median(
                [p["optimizer_s_per_param"] for p in profiles.values()])),
            "median_relative_error": float(np.median(error)),
            "max_relative_error": float(np.max(error)), "micro_batches": int(flops.size)}
