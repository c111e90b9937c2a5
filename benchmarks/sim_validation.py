"""The step simulator against measured steps: 18 plans on 2 and 4 CPU ranks, predicted and timed.

    .venv/bin/python benchmarks/sim_validation.py     # 15-40 minutes on 2 shared cores

Calibration first, on runs apart from the validated ones: the links from `ds-omni
calibrate-comm`'s collectives (gloo, 2 and 4 processes, alpha-beta least squares), the compute
from `world` processes at once timing forward + backward of each model at several micro-batch
sizes on batches of other data seeds (`benchmarks/sim_calibration.py`: `train/calibrate.profile`
on the CPU clock, one FLOP/s rate and a cost a micro-batch per parameter, the optimizer's cost a
parameter). Then every plan of CONFIGS trains for real (`setup_training` / `train_step`, the engines of one world in
one launch, one step each per round in a rotating order), and with them the engine
calibration's runs (each model's dp and static-SP plans at two micro-batch sizes, other data:
the engine's costs on top of the profile, fitted under the load the validated plans met); each
validated plan is simulated on the same
global batches (the samples each step trained, their metadata read back from the loader) with
the fitted cluster. The figure per plan: the median over rounds of the busiest rank's CPU
seconds of the step (`time.process_time`; contention on a shared machine distorts it less than
the wall clock, which is recorded too) against the median predicted step time.

The workloads are the existing benchmarks': `pipeline.py`'s (a 6-layer ViT and a 4-layer LLM,
shapes images and plain text mixed 9:1 "image" or 1:9 "text", 16 samples a step) on 2 ranks and
`per_sequence_sp.py`'s long tail (an image sample in eight with ~1500 tokens of text) on 4.
Writes benchmarks/results/sim_validation.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
# name -> (world, workload, parallel section); workloads: "image" / "text" (pipeline.py's
# mixes), "longtail" (per_sequence_sp.py's)
CONFIGS = {
    "dp2_image": (2, "image", {}),
    "dp2_text": (2, "text", {}),
    "pool2_image": (2, "image", {"encoder_pool": "dp"}),
    "sp2_static_image": (2, "image", {"sp": 2, "encoder_sp": "off"}),
    "sp2_static_text": (2, "text", {"sp": 2, "encoder_sp": "off"}),
    "pp2_stage0_image": (2, "image", {"pp": 2, "encoder_placement": "stage0", "stage_tokens": 96}),
    "pp2_stage0_text": (2, "text", {"pp": 2, "encoder_placement": "stage0", "stage_tokens": 96}),
    "pp2_uniform_image": (2, "image", {"pp": 2, "encoder_placement": "uniform",
                                       "stage_tokens": 96}),
    "pp2_uniform_text": (2, "text", {"pp": 2, "encoder_placement": "uniform",
                                     "stage_tokens": 96}),
    "dp4_longtail": (4, "longtail", {}),
    "sp2x2_static_longtail": (4, "longtail", {"sp": 2, "encoder_sp": "off"}),
    # long-short: a row's one long sample's image is above half the row's encoder work: split
    "sp2x2_long_short_longtail": (4, "longtail", {"sp": 2, "encoder_sp": "auto"}),
    "per_sequence4_longtail": (4, "longtail", {"max_sequence_sp": 4}),
    "pool4_longtail": (4, "longtail", {"encoder_pool": "dp"}),
}
# the composed backbone (issue 37) and ring context parallelism (issue 38), on 4 ranks: the
# long tail's LLM ("longtail"), and an MoE LLM of the same width on the same data ("moe")
COMPOSED = {
    "pp2_tp2_longtail": (4, "longtail", {"pp": 2, "tp": 2, "encoder_placement": "stage0"}),
    "pp2_sp2_longtail": (4, "longtail", {"pp": 2, "sp": 2, "encoder_placement": "stage0",
                                         "encoder_sp": "off"}),
    "pp2_ep2_moe": (4, "moe", {"pp": 2, "ep": 2, "encoder_placement": "stage0"}),
    "ep2_tp2_moe": (4, "moe", {"ep": 2, "tp": 2}),
    "cp2_longtail": (4, "longtail", {"cp": 2, "encoder_sp": "off"}),
    "sp2_cp2_longtail": (4, "longtail", {"sp": 2, "cp": 2, "encoder_sp": "off"}),
}
CONFIGS |= COMPOSED
# a Qwen3-MoE LLM as wide as the long tail's (`per_sequence_sp.LLM`): 4 experts of half its
# MLP, top-2, HF's auxiliary loss on, 2 layers (one a stage under pp2)
MOE_LLM = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
           "moe_intermediate_size": 256, "num_experts": 4, "num_experts_per_tok": 2,
           "norm_topk_prob": True, "output_router_logits": True, "router_aux_loss_coef": 0.01,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 32, "max_position_embeddings": 4096, "tie_word_embeddings": False}
# the bubbles schedule (issue 39) beside "uniform" on 4 ranks, PP=2 x dp 2 and PP=4, the 9:1 mix:
# a list of its own, joined to CONFIGS
BUBBLE_CONFIGS = {
    f"pp{pp}_{where}_image_4ranks": (4, "image", {"pp": pp, "encoder_placement": where,
                                                  "stage_tokens": 96})
    for pp in (2, 4) for where in ("uniform", "bubbles")}
CONFIGS.update(BUBBLE_CONFIGS)
MIX = {"image": "image_heavy_9to1", "text": "text_heavy_1to9"}


def config(name: str, out_dir: str, sources: dict, steps: int, seed: int = 0):
    """The OmniConfig of plan `name` (CONFIGS), built on its benchmark's workload."""
    from benchmarks import per_sequence_sp, pipeline
    from ds_omni.config import OmniConfig, ParallelConfig, from_dict
    from ds_omni.parallel.plan import ParallelPlan
    from tests.fixtures import tiny_config_dict
    world, work, par = CONFIGS[name]
    if work in ("longtail", "moe"):
        d = tiny_config_dict(f"{out_dir}/{name}", steps=steps,
                             global_batch_size=per_sequence_sp.GLOBAL_BATCH,
                             micro_batch_size=per_sequence_sp.MICRO)
        d["model"]["llm"]["config"].update(per_sequence_sp.LLM if work == "longtail"
                                           else MOE_LLM)
        d["data"]["sources"].append(sources["long"])
        d["data"].update(max_seq_len=per_sequence_sp.MAX_LEN,
                         pack_tokens=per_sequence_sp.MAX_LEN * per_sequence_sp.MICRO)
    else:
        d = tiny_config_dict(f"{out_dir}/{name}", steps=steps,
                             global_batch_size=pipeline.GLOBAL_BATCH,
                             micro_batch_size=pipeline.MICRO)
        d["model"]["vision"]["config"].update(pipeline.VISION)
        d["model"]["llm"]["config"].update(pipeline.llm_config(2))
        d["data"]["sources"] = [{"name": "shapes", "path": "builtin:shapes",
                                 "weight": pipeline.MIXES[MIX[work]]},
                                dict(sources["text"], weight=1.0)]
        d["data"]["max_seq_len"] = 256
    dp = ParallelPlan.dp_of(ParallelConfig(**par), world)
    d["data"]["reorder"] = {"mode": "fixed", "group_size": dp}
    d["data"]["seed"] = seed
    d["parallel"] = dict(par)
    return from_dict(OmniConfig, d)


# ------------------------------------------------------------------------- measured run
def ranks(rank: int, world: int, names: list[str], out_dir: str, sources: dict, rounds: int,
          warmup: int, calibration: tuple = ()) -> dict:
    """Every plan of `names` (all of `world` ranks) trained `warmup + rounds` steps, rotating;
    per plan and step this rank's CPU and wall seconds and the metadata of its samples.
    `calibration`: (plan, micro-batch size) of the engine calibration (`sim_calibration.engine_config`, keyed
    "plan/micro"), trained in the same rotation: under the load the validated plans meet; with
    a cp plan among `names`, the ring kernel's FLOP/s each round (`RING_RATES`), as they meet it."""
    import torch
    from deepspeed.utils import groups as ds_groups
    from benchmarks import sim_calibration as cal
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.train.setup import setup_training
    from tests.fixtures import ds_config
    torch.set_num_threads(1)
    runs = {}
    for name in names:
        cfg = config(name, out_dir, sources, warmup + rounds)
        plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
        _, loader, engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_config(1), plan),
                                                   rank, plan)
        runs[name] = (loader, engine, groups)
    for name, micro in calibration:
        cfg = cal.engine_config(name, micro, out_dir, sources, warmup + rounds)
        plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
        _, loader, engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_config(1), plan),
                                                   rank, plan)
        runs[f"{name}/{micro}"] = (loader, engine, groups)
    order = list(runs)
    log = {name: [] for name in order}
    ring = any(CONFIGS[n][2].get("cp", 1) > 1 for n in names)
    for i in range(warmup + rounds):
        for name in order[i % len(order):] + order[:i % len(order)]:
            log[name].append(one_step(*runs[name], ds_groups))
        if ring:  # ring attention's kernel timed in the launch, under the load its plans meet
            log.setdefault(RING_RATES, []).append(ring_rate())
    for name, (loader, *_) in runs.items():  # outside the timings: what each step trained
        for record in log[name]:
            record["samples"] = sample_meta(loader, record.pop("keys"))
    return log


RING_RATES = "ring_flops_per_s"  # a rank's log: the ring kernel's FLOP/s, timed each round


def ring_rate() -> float:
    """The ring kernel's FLOP/s on this rank now (`calibrate_comm.time_ring_blocks`), every
    rank at once."""
    import torch.distributed as dist
    from benchmarks.sim_calibration import ring_shape
    from ds_omni.sim.calibrate_comm import time_ring_blocks
    dist.barrier()
    return time_ring_blocks(**ring_shape(), repeats=3)


def one_step(loader, engine, groups, ds_groups) -> dict:
    import torch.distributed as dist
    from ds_omni.train.step import train_step
    ds_groups.mpu = engine.mpu  # DeepSpeed's SP groups are a module global: each engine its own
    if getattr(engine, "grid", None) is not None and engine.grid.pipe_parallel_size > 1:
        from deepspeed.runtime.pipe import p2p  # its grid too (PP=2 and PP=4 in one launch)
        p2p.init_process_groups(engine.grid)
    batch = loader.next_step()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    result = train_step(engine, batch, groups)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return {"cpu_s": cpu, "wall_s": wall, "loss": result.loss, "keys": sorted(batch.keys)}


def sample_meta(loader, keys: list[str]) -> dict:
    """key -> (LLM tokens, [(encoder, encoder positions, LLM rows), ...]) of each sample."""
    out = {}
    for key, s in zip(keys, loader.load_samples(keys)):
        items = []
        for enc, item in s.items:
            seqs = item.cost_seqs()
            items += [(enc, int(n), int(item.num_embeddings) if j == 0 else 0)
                      for j, n in enumerate(seqs)]
        out[key] = (int(s.length), items)
    return out


def samples_of(per_rank: list[list[dict]], step: int):
    """The global batch of one step: the union of every rank's samples (ranks of an SP group,
    block or pipeline see the same ones), as the simulator's `Samples`."""
    import numpy as np
    from ds_omni.sim.workload import Samples
    meta = {}
    for log in per_rank:
        meta.update(log[step]["samples"])
    tokens, owner, enc, length, rows = [], [], [], [], []
    for i, key in enumerate(sorted(meta)):
        n, items = meta[key]
        tokens.append(n)
        for e, seq, r in items:
            owner.append(i), enc.append(e), length.append(seq), rows.append(r)
    return Samples(np.array(tokens, dtype=np.int64), np.array(owner, dtype=np.int64),
                   np.array(enc, dtype=str), np.array(length, dtype=np.int64),
                   np.array(rows, dtype=np.int64))


# ------------------------------------------------------------------------- calibration
def model_of(name: str) -> str:
    """The calibration a plan uses: its benchmark's (the MoE LLM's: the long tail's, its width
    and data; the fitted machine is a FLOP rate and costs a parameter, not one model's)."""
    return "longtail" if CONFIGS[name][1] in ("longtail", "moe") else "pipeline"


def busy_s(report) -> float:
    """The busiest rank's busy seconds of a simulated step (compute + communication, not the
    waits): what its CPU clock counts (a rank waiting in gloo's receive spends no CPU)."""
    return float(max(a + b for a, b in zip(report.compute, report.comm)))


def flop_model(cfg):
    """The simulator's model of `cfg`: FLOPs (the cost model unscaled), 4 bytes a parameter and
    gradient on the wire (the benchmarks train in fp32), and everything else `model_spec` read
    from the model's configs. Why not `ModelSpec.from_dims(dims)`: it drops the attention heads,
    and an encoder's heads decide whether long-short SP may split its items (Ulysses needs them
    divisible by the group): the tiny ViT (hidden 32, 4 heads) fell back to hidden // 64 = 1
    head, so the simulator never split an item that training splits."""
    from ds_omni.data.cost import CostModel
    from ds_omni.sim.from_config import model_spec
    base = model_spec(cfg)
    return dataclasses.replace(base, cost=CostModel(base.dims), bytes_per_param=4)


def predict(name: str, per_rank: list[list[dict]], warmup: int, cluster_file: str,
            machine: dict, out_dir: str, sources: dict) -> dict:
    from ds_omni.sim.cluster import cluster
    from ds_omni.sim.from_config import sim_plan
    from ds_omni.sim.step import simulate
    from ds_omni.train.calibrate import machine_fields
    from tests.fixtures import ds_config
    world = CONFIGS[name][0]
    cfg = config(name, out_dir, sources, 1)
    model = flop_model(cfg)
    # the fitted machine: its FLOP/s all achieved, its per-micro-batch and optimizer seconds
    machines = cluster(cluster_file, world, world, **machine_fields(machine))
    # TP's collectives as training issues them (AutoTP's per-matrix backward all-reduces, the
    # encoder gradients a tensor a call: `SimPlan.autotp_calls`)
    plan = sim_plan(cfg, ds_config(1), world).replace(autotp_calls=True)
    reports = [simulate(machines, model, samples_of(per_rank, s), plan)
               for s in range(warmup, len(per_rank[0]))]
    phases = {}
    for r in reports:
        for k, v in r.summary()["critical_path"]["by_phase"].items():
            phases.setdefault(k, []).append(v)
    # the figure: the busiest rank's busy seconds, what the measured CPU clock counts (the
    # step time adds the waits, a pipeline's bubble: no CPU spent); the mean over the rounds,
    # as `measured` (the same steps)
    busy = [busy_s(r) for r in reports]
    return {"predicted_s": statistics.mean(busy), "predicted_median_s": statistics.median(busy),
            "predicted_per_round": busy,
            "predicted_step_s": statistics.mean(r.step_time for r in reports),
            "predicted_phases_s": {k: statistics.median(v) for k, v in phases.items()},
            "predicted_critical_phase": reports[len(reports) // 2].critical_phase}


def measured(per_rank: list[list[dict]], warmup: int) -> dict:
    steps = range(warmup, len(per_rank[0]))
    cpu = [max(log[s]["cpu_s"] for log in per_rank) for s in steps]
    wall = [max(log[s]["wall_s"] for log in per_rank) for s in steps]
    # the mean over the rounds: the long-tail steps are bimodal (a step with a ~1,500-token
    # sample takes ~1.1 s, one without ~0.2 s), and the median of 4 such rounds is the midpoint
    # of whichever two lie in the middle; the mean is the run's time a step, on the same steps
    # the simulator is given
    # which global batch each round trained (plans of one data-parallel size draw the same)
    batches = [hashlib.sha1(" ".join(sorted({k for log in per_rank for k in log[s]["samples"]}))
                            .encode()).hexdigest()[:12] for s in steps]
    return {"measured_s": statistics.mean(cpu), "measured_median_s": statistics.median(cpu),
            "measured_wall_s": statistics.mean(wall), "measured_cpu_per_round": cpu,
            "measured_wall_per_round": wall, "measured_batch_per_round": batches}


def pairwise_agreement(rows: list[dict]) -> tuple[float, list]:
    """Share of plan pairs the simulator orders as the measurement's means do (ties count as
    agreed within 2 % measured), and the pairs it orders the other way."""
    agree, wrong = 0, []
    pairs = list(itertools.combinations(rows, 2))
    for a, b in pairs:
        m = a["measured_s"] - b["measured_s"]
        p = a["predicted_s"] - b["predicted_s"]
        tie = abs(m) <= 0.02 * max(a["measured_s"], b["measured_s"])
        if tie or m * p > 0:
            agree += 1
        else:
            wrong.append((a["name"], b["name"]))
    return agree / max(1, len(pairs)), wrong


def measured_apart(a: dict, b: dict) -> int:
    """-1: plan a was faster than b in every measured round; 1: slower in every round; 0: the
    measurement does not order them. Where the two trained the same global batch in each
    round (`measured_batch_per_round`: plans of one data-parallel size draw the same), the
    rounds are paired, so a round's difference is the plans' and not the batch's (the long-tail
    steps alone move 0.2-1.1 s with their samples), and a sign that holds in all n rounds is a
    sign test at p = 2^(1-n) (5 rounds: 0.06); otherwise every round of one must lie below
    every round of the other (as tests/dist/test_search_measured.py asks)."""
    xs, ys = a["measured_cpu_per_round"], b["measured_cpu_per_round"]
    if a.get("measured_batch_per_round") and \
            a["measured_batch_per_round"] == b.get("measured_batch_per_round"):
        diffs = [x - y for x, y in zip(xs, ys)]
        return -1 if all(d < 0 for d in diffs) else 1 if all(d > 0 for d in diffs) else 0
    return -1 if max(xs) < min(ys) else 1 if min(xs) > max(ys) else 0


def order_of_measured_pairs(rows: list[dict]) -> tuple[float, list, int]:
    """The issue's target: of the pairs the measurement orders (`measured_apart`), the share the
    simulator orders the same way; the pairs it orders the other way; how many pairs there are.
    A pair the measurement does not order has no order to agree with (`pairwise_agreement`
    still counts it, by its means)."""
    apart = [(a, b, s) for a, b in itertools.combinations(rows, 2)
             if (s := measured_apart(a, b))]
    wrong = [(a["name"], b["name"]) for a, b, s in apart
             if (a["predicted_s"] - b["predicted_s"]) * s <= 0]
    return 1 - len(wrong) / max(1, len(apart)), wrong, len(apart)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 6))
    xs, ys = [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]
    lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], alpha=0.15,
                    label="+-10 %")
    for r in rows:
        ax.scatter(r["measured_s"], r["predicted_s"], c="C0" if r["world"] == 2 else "C1")
        ax.annotate(r["name"], (r["measured_s"], r["predicted_s"]), fontsize=6)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="measured: busiest rank's CPU s a step (mean)",
           ylabel="simulated busy s, busiest rank (fitted cluster)",
           title="ds_omni.sim against measured CPU steps (blue 2 ranks, orange 4)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measure_all(names: list[str], rounds: int, warmup: int, batches: int, comm_repeats: int,
                out: Path, tmp: str, sources: dict) -> dict:
    """The calibration runs and the measured runs: everything `predict_all` needs."""
    from benchmarks import sim_calibration as cal
    from ds_omni.sim.calibrate_comm import calibrate as calibrate_comm
    from tests.harness import run_on_ranks
    worlds = sorted({CONFIGS[n][0] for n in names})
    comm = calibrate_comm(tuple(worlds), repeats=comm_repeats, clock=time.process_time)
    (out / "sim_validation_cluster.json").write_text(json.dumps(comm["cluster"], indent=1))
    cluster_file = str(out / "sim_validation_cluster.json")
    # the profiles first; the engine's runs train in the measured launch, rotating with the
    # validated plans (the same load on the shared cores: the engine terms absorb it)
    compute = cal.calibrate_compute(names, tmp, sources, batches, cluster_file,
                                    engine=False)
    load = os.getloadavg()  # (1, 5, 15 minutes) after the calibration: the machine is shared
    logs, engine_logs = {}, {}
    for world in worlds:
        group = [n for n in names if CONFIGS[n][0] == world]
        specs = cal.engine_specs(group)
        per_rank = run_on_ranks(ranks, world, args=(group, tmp, sources, rounds, warmup,
                                                    specs), timeout=3000)
        logs |= {name: [r[name] for r in per_rank] for name in group}
        engine_logs[str(world)] = {f"{n}/{m}": [r[f"{n}/{m}"] for r in per_rank]
                                   for n, m in specs}
        rates = [v for r in per_rank for v in r.get(RING_RATES, [])[warmup:]]
        if rates:  # the ring's rate as its plans met it, not the calibration's
            compute[str(world)]["machine"][RING_RATES] = statistics.median(rates)
            compute[str(world)]["ring_rates_in_launch"] = rates
        compute[str(world)] = cal.with_engine(compute[str(world)], cal.calibrate_engine(
            group, compute[str(world)]["machine"], cluster_file, tmp, sources,
            logs=engine_logs[str(world)], warmup=warmup))
    return {"comm": comm, "compute": compute, "logs": logs, "engine_logs": engine_logs,
            "rounds": rounds, "warmup": warmup,
            "load_average_calibration": load, "load_average_measured": os.getloadavg()}


def predict_all(raw: dict, out: Path, tmp: str, sources: dict) -> list[dict]:
    from benchmarks.sim_calibration import with_pool
    files = {int(w): out / f"sim_validation_cluster_w{w}.json"  # `merged`: each world's links
             for w in raw.get("comm_by_world", {})}
    for w, f in files.items():
        f.write_text(json.dumps(raw["comm_by_world"][str(w)]["cluster"], indent=1))
    refit_engines(raw, files, out, tmp, sources)
    # the pool's planning cost, timed now where the stored machine has none (with_pool)
    machines = {int(w): with_pool(c["machine"], int(w)) for w, c in raw["compute"].items()}
    for w, m in machines.items():
        raw["compute"][str(w)]["machine"] = m  # the report's calibration says what was used
    rows = []
    for name, logs in raw["logs"].items():
        world = CONFIGS[name][0]
        cluster_file = files.get(world, out / "sim_validation_cluster.json")
        row = {"name": name, "world": world, "workload": CONFIGS[name][1],
               "parallel": CONFIGS[name][2], **measured(logs, raw["warmup"]),
               **predict(name, logs, raw["warmup"], str(cluster_file), machines[world], tmp,
                         sources)}
        row["error"] = (row["predicted_s"] - row["measured_s"]) / row["measured_s"]
        rows.append(row)
    return rows


def refit_engines(raw: dict, files: dict, out: Path, tmp: str, sources: dict) -> None:
    """A stored world whose engine calibration predates `compute_scale` or its links
    (`cpu_links`) fitted again from its stored engine runs, on its profiled machine: every
    world's machine fitted the same way."""
    from benchmarks import sim_calibration as cal
    for w, compute in raw["compute"].items():
        if "compute_scale" in compute.get("engine", {"compute_scale": None}):
            continue
        group = [n for n in raw["logs"] if CONFIGS[n][0] == int(w)]
        machine = cal.profiled_machine(compute)
        cluster_file = files.get(int(w), out / "sim_validation_cluster.json")
        raw["compute"][w] = cal.with_engine(dict(compute, machine=machine), cal.calibrate_engine(
            group, machine, str(cluster_file), tmp, sources, logs=raw["engine_logs"][w],
            warmup=raw["warmup"]))


def cpu_links(raw: dict, repeats: int) -> dict:
    """`raw` with every world's links timed again on the CPU clock (`calibrate_comm(...,
    clock=time.process_time)`: what a rank spends in a collective, as the measured CPU clock
    counts it; the wall clock adds its waits, which a loaded machine stretches: alpha 0.78
    and 2.29 ms in two sessions' calibrations, 0.14 ms of CPU), its engines fitted again."""
    from benchmarks.sim_calibration import profiled_machine
    from ds_omni.sim.calibrate_comm import calibrate as calibrate_comm
    by_world = {w: calibrate_comm((int(w),), repeats=repeats, clock=time.process_time)
                for w in raw["compute"]}
    compute = {w: dict(c, machine=profiled_machine(c), engine={})  # fitted on the old links
               for w, c in raw["compute"].items()}
    return dict(raw, comm_by_world=by_world, comm=by_world[max(by_world, key=int)],
                compute=compute)


def merged(raw: dict, other: dict) -> dict:
    """`raw` with the worlds it did not measure taken from `other` (an earlier session's raw
    file, `--merge`): their plans' runs, calibrations and links (`comm_by_world`), so that one
    session may re-measure the 4-rank plans and keep the 2-rank ones."""
    out = dict(raw, logs=dict(raw["logs"]), compute=dict(raw["compute"]),
               engine_logs=dict(raw["engine_logs"]))
    comm = out.setdefault("comm_by_world", {w: raw["comm"] for w in raw["compute"]})
    for w in sorted(set(other["compute"]) - set(raw["compute"])):
        out["logs"] |= {n: v for n, v in other["logs"].items() if CONFIGS[n][0] == int(w)}
        out["compute"][w], out["engine_logs"][w] = other["compute"][w], other["engine_logs"][w]
        # `other` may itself be merged: its world's own links and rounds, not its session's
        comm[w] = other.get("comm_by_world", {}).get(w, other["comm"])
        out.setdefault("merged_rounds", {})[w] = other.get("merged_rounds", {}).get(
            w, other["rounds"])
    return out


def run(args) -> dict:
    """Measure (or, --reuse, read the last measurement back) and predict."""
    from benchmarks import sim_calibration as cal
    from tests.fixtures import long_source, text_source
    t0 = time.perf_counter()
    raw_file = args.out / "sim_validation_raw.json"  # the measured runs, to re-predict from
    with tempfile.TemporaryDirectory(prefix="ds_omni_simval_") as tmp:
        sources = {"text": text_source(Path(tmp)),
                   "long": long_source(Path(tmp), weight=0.14, words=1200)}
        if args.reuse:
            raw = json.loads(raw_file.read_text())
            if args.merge:
                raw = merged(raw, json.loads(args.merge.read_text()))
                raw_file.write_text(json.dumps(raw))
            if args.recalibrate_comm:  # the links on the CPU clock, each world's
                raw = cpu_links(raw, args.comm_repeats)
                raw_file.write_text(json.dumps(raw))
            if args.recalibrate or args.recalibrate_engine:  # the measured runs kept
                raw["compute"] = cal.calibrate_compute(
                    list(raw["logs"]), tmp, sources, args.batches,
                    str(args.out / "sim_validation_cluster.json"),
                    stored=raw["compute"] if args.recalibrate_engine else None)
                raw["load_average_calibration"] = os.getloadavg()
                raw_file.write_text(json.dumps(raw))
        else:
            raw = measure_all(args.configs, args.rounds, args.warmup, args.batches,
                              args.comm_repeats, args.out, tmp, sources)
            raw_file.write_text(json.dumps(raw))
        rows = predict_all(raw, args.out, tmp, sources)
    result = report(rows, raw["comm"], raw["compute"], raw["rounds"], raw["warmup"],
                    time.perf_counter() - t0, command(args))
    return result | {"load_average": {"calibration": raw.get("load_average_calibration"),
                                      "measured": raw.get("load_average_measured"),
                                      "after": os.getloadavg()}}


def command(args) -> str:
    """The command line that produced this result (what `--reuse` re-predicted from)."""
    flags = [f for f, on in (("--reuse", args.reuse), (f"--merge {args.merge}", args.merge),
                             ("--recalibrate", args.recalibrate),
                             ("--recalibrate-engine", args.recalibrate_engine),
                             ("--recalibrate-comm", args.recalibrate_comm)) if on]
    if not args.reuse:  # the measured run's own settings
        flags += [f"--rounds {args.rounds}", f"--warmup {args.warmup}",
                  f"--comm-repeats {args.comm_repeats}"]
    if not args.reuse or args.recalibrate:
        flags.append(f"--batches {args.batches}")
    if args.configs != list(CONFIGS):
        flags.append("--configs " + " ".join(args.configs))
    return " ".join([".venv/bin/python benchmarks/sim_validation.py", *flags])


def report(rows, comm, compute, rounds, warmup, runtime, cmd: str) -> dict:
    errors = [abs(r["error"]) for r in rows]
    agreement, wrong = pairwise_agreement(rows)
    apart_agreement, apart_wrong, apart = order_of_measured_pairs(rows)
    return {"command": cmd, "rounds": rounds,
            "warmup": warmup, "configs": rows,
            "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "order_of_measured_pairs": apart_agreement, "measured_pairs": apart,
            "measured_pairs_ordered_wrong": apart_wrong,
            "pairwise_order_agreement": agreement, "pairs_ordered_wrong": wrong,
            "target": {"median_abs_error": 0.10, "max_abs_error": 0.25,
                       "order_of_measured_pairs": 1.0},
            "calibration": {"comm": comm, "compute": compute}, "runtime_s": round(runtime, 1)}


def table(result: dict) -> str:
    """The Markdown table of docs/benchmarks/sim_validation.md."""
    lines = ["| plan | ranks | workload | measured CPU s (busiest rank) | wall s | predicted s | "
             "error | simulator's critical phase |", "|---|---|---|---|---|---|---|---|"]
    for r in result["configs"]:
        lines.append(f"| {r['name']} | {r['world']} | {r['workload']} | {r['measured_s']:.3f} | "
                     f"{r['measured_wall_s']:.3f} | {r['predicted_s']:.3f} | "
                     f"{r['error']:+.0%} | {r['predicted_critical_phase']} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batches", type=int, default=12, help="calibration micro-batches a model")
    ap.add_argument("--comm-repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--reuse", action="store_true",
                    help="predict again from the last run's measurements (sim_validation_raw.json)")
    ap.add_argument("--merge", type=Path,
                    help="with --reuse: an earlier raw file whose other worlds' plans to keep")
    ap.add_argument("--recalibrate", action="store_true",
                    help="with --reuse: run the compute calibration again")
    ap.add_argument("--recalibrate-engine", action="store_true",
                    help="with --reuse: run the engine calibration again, the stored profiles "
                         "kept")
    ap.add_argument("--recalibrate-comm", action="store_true",
                    help="with --reuse: time the links again on the CPU clock, refit the engine")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "sim_validation.json").write_text(json.dumps(result, indent=1))
    plot(result["configs"], args.out / "sim_validation.png")
    print(json.dumps({r["name"]: [round(r["measured_s"], 4), round(r["predicted_s"], 4),
                                  round(r["error"], 3)] for r in result["configs"]}, indent=1))
    print({k: result[k] for k in ("median_abs_error", "max_abs_error", "order_of_measured_pairs",
                                  "measured_pairs", "pairwise_order_agreement")})
    print(table(result))
    return result


if __name__ == "__main__":
    main()
