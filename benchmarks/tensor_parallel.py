"""Tensor parallelism: memory per rank and step time at tp 1 / 2 / 4 on 4 ranks, against ZeRO-3.

    .venv/bin/python benchmarks/tensor_parallel.py [--layers 6] [--hidden 512] [--steps 3]
    # about 10 minutes on a 2-core machine at load 35 (the first plan's start-up 2 of them)

Four CPU ranks over gloo train the demo composition (CLIP tower, builtin:shapes data) with a
Llama backbone large beside everything else (default 6 layers, width 512, MLP 2048, 8 query
and 4 key-value heads: 23.6M backbone parameters, 94 MB in fp32), through the real
`setup_training` / `train_step`, the plans one after another in one launch:
- tp1_zero2 (the baseline): dp 4, ZeRO-2, every rank holding the whole backbone;
- tp2_zero2: tp 2 x dp 2; tp4_zero2: tp 4 x dp 1 (ZeRO-2 has one rank to partition over);
- tp1_zero3: dp 4, ZeRO-3 (the parameters partitioned instead of split).
Each plan trains the same global batch (8 samples, micro-batches of 2) for `steps` steps and
reports per rank (`benchmarks/model_memory.py`): parameter bytes, optimizer-state bytes (Adam's
moments and the fp32 master copies), the activation peak of one micro-batch (saved-tensor
hooks), live tensor bytes and RSS, and the busiest rank's step CPU time. The figures are ratios
of each plan's largest rank against tp1_zero2's, all measured in this run.

"Does not fit one rank": the memory cap `--cap-mb` (default 256 MiB a rank for live tensors
plus the activation peak) stands for a GPU too small for the whole backbone's training state;
the JSON says which plans fit under it.
Writes benchmarks/results/tensor_parallel.json and tensor_parallel.png.

    .venv/bin/python benchmarks/tensor_parallel.py --encoders

The encoders' split over the TP ranks (`ds_omni.parallelize.tp_encoders`) against the TP
ranks each encoding every item of their row (how parallel.tp ran before the split, put back
for the `*_whole_encoders` plans as the plants put in a change: `whole_encoders`), with a
CLIP tower as large as the backbone's work (`ENCODER_TOWER`): tp1_zero2 (baseline), tp 2 and 4
split and whole. Writes tensor_parallel_encoders.json and .png.
"""

from __future__ import annotations

import argparse
import copy
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
WORLD = 4
PLANS = {"tp1_zero2": (1, 2), "tp2_zero2": (2, 2), "tp4_zero2": (4, 2), "tp1_zero3": (1, 3)}
BASELINE = "tp1_zero2"
ENCODER_PLANS = {"tp1_zero2": (1, 2), "tp2_zero2": (2, 2), "tp2_zero2_whole_encoders": (2, 2),
                 "tp4_zero2": (4, 2), "tp4_zero2_whole_encoders": (4, 2)}
ENCODER_TOWER = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
                 "num_attention_heads": 8, "image_size": 96, "patch_size": 8}
"""A CLIP tower of 18.9M parameters over 144 patches an image: its work on a sample is of the
order of the backbone's (which runs the 144 placeholder rows and the text)."""
BUCKET = 2_000_000  # ZeRO's reduce / all-gather / prefetch buckets, elements (8 MB in fp32)
PARTS = ("param_bytes", "optimizer_state_bytes", "activation_peak_bytes", "live_tensor_bytes",
         "rss_bytes")


def llm_config(layers: int, hidden: int) -> dict:
    """A Llama backbone: MLP 4 x width, 64-wide heads, a third of them key-value heads."""
    heads = hidden // 64
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 4 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": max(4, heads // 3), "max_position_embeddings": 256,
            "tie_word_embeddings": False}


def make_config(out_dir: str, llm: dict, tp: int = 1, ep: int = 1, tower: dict | None = None):
    """The demo composition with `llm` as its LLM (and `tower`'s fields in the CLIP tower's
    config): 8 samples a step, micro-batches of 2."""
    from ds_omni.config import OmniConfig, from_dict
    from tests.fixtures import tiny_config_dict
    raw = tiny_config_dict(out_dir, steps=100, global_batch_size=8, micro_batch_size=2)
    raw["model"]["llm"]["config"] = copy.deepcopy(llm)
    raw["model"]["vision"]["config"].update(tower or {})
    if tower:  # a sample holds its image's patches as placeholders
        raw["data"]["max_seq_len"] = 512
    raw["parallel"] = {"tp": tp, "ep": ep}
    return from_dict(OmniConfig, raw)


def ds_json(stage: int) -> dict:
    """The tests' DeepSpeed config (fp32, torch AdamW) with buckets of BUCKET elements: the
    defaults (5e8) make ZeRO-3 allocate a 2 GB reduce bucket, more than the whole model."""
    from tests.fixtures import ds_config
    out = ds_config(stage)
    out["zero_optimization"].update(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET,
                                    stage3_prefetch_bucket_size=BUCKET)
    return out


def tp_counters(engine) -> dict:
    """The mechanism ran: AutoTP's layers in the backbone, and the encoder items this rank
    encoded of its TP group's rows' items (`ds_omni.parallelize.tp_encoders`; None without tp)."""
    from ds_omni.parallelize import router_of
    counts = getattr(engine.module, "tp_counts", None)
    router = router_of(engine.module)
    split = router.tp_encoders.counts if router is not None and router.tp_encoders else None
    return {"tp_layers": None if counts is None else counts.column + counts.row,
            "tp_encoded_items": None if split is None else split.items_encoded,
            "tp_row_items": None if split is None else split.row_items}


def ranks(rank: int, world: int, plans: dict, steps: int, warmup: int, counters) -> dict:
    from benchmarks.model_memory import measure_plans
    return measure_plans(rank, world, plans, steps, warmup, counters)


def whole_encoders():
    """parallel.tp as it ran before the encoders' split: every TP rank encodes every item of
    its row (no placement, no gather) and keeps its encoder gradients (no sum: they are the
    same on each)."""
    from contextlib import ExitStack
    from unittest import mock
    from ds_omni.parallelize.tp_encoders import TPEncoders
    stack = ExitStack()
    stack.enter_context(mock.patch.object(TPEncoders, "place", lambda self, mb: mb))
    stack.enter_context(mock.patch.object(TPEncoders, "sum_grads_over_tp",
                                          lambda self, encoders: 0))
    return stack


def encoder_ranks(rank: int, world: int, plans: dict, steps: int, warmup: int,
                  counters) -> dict:
    """`ranks`, the `*_whole_encoders` plans under `whole_encoders`."""
    from contextlib import nullcontext
    from benchmarks.model_memory import measure_plans
    out = {}
    for name, plan in plans.items():
        with whole_encoders() if name.endswith("_whole_encoders") else nullcontext():
            out.update(measure_plans(rank, world, {name: plan}, steps, warmup, counters))
    return out


def run_plans(plans: dict, steps: int, warmup: int, counters, fn=ranks) -> dict:
    """{plan: per-rank results}: `plans` ({name: (cfg, DeepSpeed JSON)}) one after another in
    one launch of WORLD ranks (each rank running `fn`)."""
    from tests.harness import run_on_ranks
    per_rank = run_on_ranks(fn, WORLD, args=(plans, steps, warmup, counters), timeout=2400)
    return {name: [r[name] for r in per_rank] for name in plans}


def summarise(per_plan: dict, baseline: str, cap_mb: float | None = None) -> dict:
    """Each plan's largest rank for every part, its median step time, and both as ratios
    against `baseline`'s (the same run)."""
    mb = 2 ** 20
    out = {}
    for name, per_rank in per_plan.items():
        row = {f"{p}_max_mb": max(r[p] for r in per_rank) / mb for p in PARTS}
        row["per_rank_mb"] = {p: [r[p] / mb for r in per_rank] for p in PARTS}
        row["step_cpu_s_median"] = statistics.median(per_rank[0]["step_cpu_s"])
        row["step_wall_s_median"] = statistics.median(per_rank[0]["step_wall_s"])
        row["losses"] = per_rank[0]["losses"]
        row["counters"] = {k: v for k, v in per_rank[0].items() if k.endswith("_layers")
                           or k.endswith("_blocks")}
        if "tp_encoded_items" in per_rank[0]:  # each rank's share of its TP group's items
            row["counters"]["tp_encoded_items_per_rank"] = [r["tp_encoded_items"]
                                                            for r in per_rank]
            row["counters"]["tp_row_items_per_rank"] = [r["tp_row_items"] for r in per_rank]
        held = row["live_tensor_bytes_max_mb"] + row["activation_peak_bytes_max_mb"]
        row["held_max_mb"] = held
        if cap_mb is not None:
            row["fits_cap"] = held <= cap_mb
        out[name] = row
    for row in out.values():
        base = out[baseline]
        row["over_baseline"] = {k: row[k] / base[k] for k in row
                                if k.endswith("_max_mb") or k.endswith("_median")}
    return out


def plot(summary: dict, path: Path, title: str, cap_mb: float | None = None) -> None:
    """Stacked bars of each plan's largest rank: parameters, optimizer state, the rest of the
    live tensors, the activation peak; the cap as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(summary)
    parts = {"parameters": [summary[n]["param_bytes_max_mb"] for n in names],
             "optimizer state": [summary[n]["optimizer_state_bytes_max_mb"] for n in names]}
    parts["other live tensors"] = [max(0.0, summary[n]["live_tensor_bytes_max_mb"]
                                       - parts["parameters"][i] - parts["optimizer state"][i])
                                   for i, n in enumerate(names)]
    parts["activation peak"] = [summary[n]["activation_peak_bytes_max_mb"] for n in names]
    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0.0] * len(names)
    for label, values in parts.items():
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    if cap_mb is not None:
        ax.axhline(cap_mb, color="k", linestyle="--", label=f"cap {cap_mb:.0f} MiB")
    ax.set_ylabel("MiB, largest rank")
    ax.legend(fontsize=8)
    ax_t.bar(names, [summary[n]["step_cpu_s_median"] for n in names], color="gray")
    ax_t.set_ylabel("step CPU s, busiest rank (median)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="steps a plan, warmup included")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cap-mb", type=float, default=256.0)
    parser.add_argument("--encoders", action="store_true",
                        help="the encoders' split over TP against whole encoders (docstring)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    llm = llm_config(args.layers, args.hidden)
    table, tower = (ENCODER_PLANS, ENCODER_TOWER) if args.encoders else (PLANS, None)
    start, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmp:
        plans = {name: (make_config(f"{tmp}/{name}", llm, tp=tp, tower=tower), ds_json(stage))
                 for name, (tp, stage) in table.items()}
        per_plan = run_plans(plans, args.steps, args.warmup, tp_counters,
                             encoder_ranks if args.encoders else ranks)
    summary = summarise(per_plan, BASELINE, args.cap_mb)
    out = {"world": WORLD, "llm": llm, "tower": tower, "steps": args.steps,
           "warmup": args.warmup, "cap_mb": args.cap_mb,
           "plans": {k: list(v) for k, v in table.items()}, "baseline": BASELINE,
           "bucket_elements": BUCKET, "load_avg_before": load,
           "load_avg_after": os.getloadavg()[0], "wall_s": time.perf_counter() - start,
           "results": summary}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "tensor_parallel_encoders" if args.encoders else "tensor_parallel"
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1))
    plot(summary, RESULTS / f"{stem}.png",
         f"AutoTP on 4 CPU ranks, Llama {args.layers} x {args.hidden}"
         + (", CLIP tower 6 x 512" if args.encoders else ""), args.cap_mb)
    print(json.dumps({n: r["over_baseline"] for n, r in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
