"""Encoder work in the pipeline's bubbles: step time of "bubbles" against "uniform" and stage 0.

    .venv/bin/python benchmarks/pipeline_bubbles.py   # benchmarks/results/pipeline_bubbles.json

PP=2 (2 ranks, 4 decoder layers) and then PP=4 (4 ranks, 8 decoder layers), dp=1, ZeRO-1, fp32,
the model and data of `benchmarks/pipeline.py` (a CLIP tower of 6 layers of width 256 on 64x64
images next to an LLM of width 256; image : text-only samples 9:1, 1:1 and 1:9), 8 samples a step
in micro-batches of 2 (4 micro-batches: the 1F1B schedule idles 1/5 of a step at PP=2, 3/7 at
PP=4). Three variants, each split by the cost model for 96-token samples: "stage0" (encoders on
the first stage, as Megatron-LM), "uniform" (every stage encodes a cost-balanced share before the
schedule) and "bubbles" (`encoder_placement: "bubbles"`: each item's forward in an idle warm-up
slot of its stage, streamed to stage 0, its backward in the cool-down). All nine engines of a
depth live in one launch and take one step each per round, the order rotating. The wall time of a
step is the slower rank's (gloo's blocking receive idles a stage as a GPU would); the figures
are medians over rounds of the paired ratios uniform / bubbles and stage0 / bubbles (above 1:
"bubbles" is faster), and each stage's median `bubble_fraction` (the step's share it idled, from
the schedule's own timestamps, as metrics.jsonl logs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import pipeline as base  # noqa: E402  (benchmarks/pipeline.py: its model, data and mixes)

RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
VARIANTS = {"stage0": ("stage0", 96, "cost"), "uniform": ("uniform", 96, "cost"),
            "bubbles": ("bubbles", 96, "cost")}
GLOBAL_BATCH, MICRO = 8, 2


def config(mix: str, variant: str, out_dir: str, text: dict, steps: int, pp: int):
    from ds_omni.config import OmniConfig, from_dict
    from tests.fixtures import tiny_config_dict
    d = tiny_config_dict(f"{out_dir}/pp{pp}_{mix}_{variant}", steps=steps,
                         global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO)
    d["model"]["vision"]["config"].update(base.VISION)
    d["model"]["llm"]["config"].update(base.llm_config(pp))
    d["data"]["sources"] = [{"name": "shapes", "path": "builtin:shapes",
                             "weight": base.MIXES[mix]}, dict(text, weight=1.0)]
    d["data"]["max_seq_len"] = 256
    where, tokens, split = VARIANTS[variant]
    d["parallel"] = {"pp": pp, "encoder_placement": where, "stage_tokens": tokens,
                     "stage_split": split}
    return from_dict(OmniConfig, d)


def ranks(rank: int, world: int, out_dir: str, text: dict, rounds: int, warmup: int,
          mixes: list[str]) -> dict:
    import torch
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.train.setup import setup_training
    from tests.fixtures import ds_config
    torch.set_num_threads(1)
    runs = {}
    for mix in mixes:
        for variant in VARIANTS:
            cfg = config(mix, variant, out_dir, text, warmup + rounds, world)
            plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
            _, loader, engine, groups = setup_training(
                cfg, derive_ds_config(cfg, ds_config(1), plan), rank, plan)
            runs[(mix, variant)] = (loader, engine, groups)
    labels, log = list(runs), {f"{m}/{v}": [] for m, v in runs}
    for i in range(warmup + rounds):
        for mix, variant in labels[i % len(labels):] + labels[:i % len(labels)]:
            log[f"{mix}/{variant}"].append(one_step(*runs[(mix, variant)]))
    hidden = {f"{m}/{v}": getattr(e.module.joint, "hidden_share", None)
              for (m, v), (_, e, _) in runs.items()}
    return {"log": log, "hidden_share": hidden}


def one_step(loader, engine, groups) -> dict:
    import torch.distributed as dist
    from ds_omni.train.step import train_step
    batch = loader.next_step()
    dist.barrier()
    t0 = time.perf_counter()
    train_step(engine, batch, groups)
    wall = time.perf_counter() - t0
    clock = engine.module.clock  # its spans from the step's start; the ranks left the barrier
    offset = clock.start - t0  # together, so `offset` puts them on one time axis
    return {"step_s": wall, "bubble_fraction": clock.last_fraction,
            "spans": [(what, a + offset, b + offset) for what, a, b in clock.spans],
            "images": sum(len(mb.items.get("vision", [])) for mb in batch.micro_batches)}


def summarise(per_rank: list[dict], warmup: int, mixes: list[str]) -> dict:
    logs = [r["log"] for r in per_rank]
    out = {}
    for mix in mixes:
        steps = {v: [max(log[f"{mix}/{v}"][i]["step_s"] for log in logs)
                     for i in range(warmup, len(logs[0][f"{mix}/{v}"]))] for v in VARIANTS}
        entry = {f"{v}_step_s_median": statistics.median(steps[v]) for v in VARIANTS}
        for other in ("uniform", "stage0"):
            entry[f"{other}_over_bubbles_median_of_paired_ratios"] = statistics.median(
                a / b for a, b in zip(steps[other], steps["bubbles"]))
        entry["bubble_fraction_median_per_stage"] = {v: [round(statistics.median(
            s["bubble_fraction"] for s in log[f"{mix}/{v}"][warmup:]), 4) for log in logs]
            for v in VARIANTS}
        entry["bubbles_hidden_share_last_step"] = per_rank[0]["hidden_share"][f"{mix}/bubbles"]
        entry["images_per_step"] = statistics.mean(
            s["images"] for s in logs[0][f"{mix}/bubbles"][warmup:])
        out[mix] = entry
    return out


COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "encode_fwd": "tab:green",
           "encode_bwd": "tab:red"}


def plot_timeline(per_rank: list[dict], mix: str, path: Path) -> None:
    """One step's timeline per stage, "uniform" above "bubbles": each stage's timed pieces
    (`StageClock.spans`: forward, backward, encoder forward and backward) of the round whose
    step time is the median of "bubbles"'s (the same round for "uniform"); white is idle."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    logs = [r["log"] for r in per_rank]
    rounds = [max(log[f"{mix}/bubbles"][i]["step_s"] for log in logs)
              for i in range(len(logs[0][f"{mix}/bubbles"]))]
    pick = sorted(range(len(rounds)), key=rounds.__getitem__)[len(rounds) // 2]
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.2 + 0.6 * len(logs) * 2), sharex=True)
    for ax, variant in zip(axes, ("uniform", "bubbles")):
        steps = [log[f"{mix}/{variant}"][pick] for log in logs]
        for stage, rec in enumerate(steps):
            for what, a, b in rec["spans"]:
                ax.barh(stage, b - a, left=a, color=COLOURS.get(what, "grey"), height=0.7)
        span = max(rec["step_s"] for rec in steps)
        ax.set_yticks(range(len(logs)), [f"stage {s}" for s in range(len(logs))])
        ax.invert_yaxis()
        ax.set_title(f"{variant}: step {span:.2f} s, idle share per stage "
                     + ", ".join(f"{rec['bubble_fraction']:.2f}" for rec in steps), fontsize=9)
    axes[-1].set_xlabel("seconds from the step's start (each rank's own clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, list(COLOURS), loc="upper right", fontsize=8, ncol=4)
    fig.suptitle(f"PP={len(logs)}, {mix}: one step per stage", fontsize=10, x=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    from tests.fixtures import text_source
    from tests.harness import run_on_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], choices=(2, 4))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--mixes", nargs="+", default=list(base.MIXES), choices=list(base.MIXES))
    ap.add_argument("--timeline-mix", default="image_heavy_9to1", choices=list(base.MIXES),
                    help="the mix of the PP=4 timeline picture (pipeline_bubbles_timeline.png)")
    args = ap.parse_args(argv)
    t0, load_before = time.perf_counter(), os.getloadavg()
    report = {"command": " ".join([".venv/bin/python benchmarks/pipeline_bubbles.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "variants": VARIANTS, "zero_stage": 1, "vision": base.VISION,
              "mixes_image_to_text": base.MIXES, "global_batch_size": GLOBAL_BATCH,
              "micro_batch_size": MICRO, "rounds": args.rounds, "warmup": args.warmup,
              "load_average_before": load_before}
    for pp in args.pp:
        with tempfile.TemporaryDirectory(prefix="ds_omni_bubbles_") as tmp:
            text = text_source(Path(tmp))
            per_rank = run_on_ranks(ranks, pp, args=(tmp, text, args.rounds, args.warmup,
                                                     args.mixes), timeout=3000)
        report[f"pp{pp}"] = {"llm": base.llm_config(pp), **summarise(per_rank, args.warmup, args.mixes)}
        if pp == 4 and args.timeline_mix in args.mixes:  # docs/benchmarks/pipeline_bubbles.md
            args.out.mkdir(parents=True, exist_ok=True)
            plot_timeline(per_rank, args.timeline_mix, args.out / "pipeline_bubbles_timeline.png")
    report["runtime_s"] = round(time.perf_counter() - t0, 1)
    report["load_average_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_bubbles.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({f"pp{pp} {m} {o}/bubbles": report[f"pp{pp}"][m][
        f"{o}_over_bubbles_median_of_paired_ratios"] for pp in args.pp for m in args.mixes
        for o in ("uniform", "stage0")}, indent=1))


if __name__ == "__main__":
    main()
