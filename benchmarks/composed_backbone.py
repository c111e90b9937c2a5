"""The composed backbone: pp2 x tp2 against tp4 and ZeRO-3, pp2 x ep2 against ep4, on 4 ranks.

    .venv/bin/python benchmarks/composed_backbone.py [--layers 4] [--hidden 512] [--steps 3]
    # about 4-5 minutes on a 2-core machine

Four CPU ranks over gloo train the demo composition (CLIP tower, builtin:shapes data) through
the real `setup_training` / `train_step`, the plans one after another in one launch
(`benchmarks/model_memory.py`), each on the same 8-sample global batches in micro-batches of 2:
- a Llama backbone too large for one rank's budget (`--cap-mb`: its whole training state in
  fp32, weights, gradients and Adam's moments, 16 bytes a parameter, is above it): pp2_tp2 (two
  stages, AutoTP's layers over 2 ranks in each, ZeRO-1) against tp4 (AutoTP over all 4, ZeRO-1)
  and zero3 (dp 4, ZeRO-3);
- the Qwen3-MoE backbone of `expert_parallel.py` (8 experts, top-2): pp2_ep2 (two stages, each
  stage's experts over its 2 ranks, ZeRO-1) against ep4 (AutoEP over all 4, dp 4, ZeRO-1).
Per plan: the largest rank's memory (parameters, optimizer state, live tensors, the activation
peak of one micro-batch, and, under the pipeline, the activations a stage holds in flight: 1F1B
keeps pp - stage micro-batches alive on a stage) and the busiest rank's median step CPU time;
the figures are ratios pp2_tp2 / tp4, pp2_tp2 / zero3 and pp2_ep2 / ep4, all measured in this
run. Writes benchmarks/results/composed_backbone.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.expert_parallel import moe_config  # noqa: E402
from benchmarks.tensor_parallel import (RESULTS, WORLD, ds_json, llm_config,  # noqa: E402
                                        make_config, plot, run_plans, summarise)

# name -> (backbone, parallel section, ZeRO stage)
PLANS = {"pp2_tp2": ("dense", {"pp": 2, "tp": 2}, 1), "tp4": ("dense", {"tp": 4}, 1),
         "zero3": ("dense", {}, 3),
         "pp2_ep2": ("moe", {"pp": 2, "ep": 2}, 1), "ep4": ("moe", {"ep": 4}, 1)}
# (plan, baseline): the figures
RATIOS = (("pp2_tp2", "tp4"), ("pp2_tp2", "zero3"), ("pp2_ep2", "ep4"))


def plan_config(out_dir: str, llm: dict, parallel: dict):
    """The demo composition with `llm` (`tensor_parallel.make_config`) under `parallel`."""
    from ds_omni.config import ParallelConfig
    cfg = make_config(out_dir, llm)
    return dataclasses.replace(cfg, parallel=ParallelConfig(
        **parallel, **({"encoder_placement": "stage0"} if parallel.get("pp") else {})))


def counters(engine) -> dict:
    """The mechanisms ran: AutoTP's layers and AutoEP's blocks in this rank's model."""
    from ds_omni.parallelize.expert_parallel import autoep_layers
    counts = getattr(engine.module, "tp_counts", None)
    return {"tp_layers": None if counts is None else counts.column + counts.row,
            "autoep_blocks": len(autoep_layers(engine.module))}


def in_flight(summary: dict, per_plan: dict) -> None:
    """Each plan's largest rank's live tensors plus the activations it holds at once: one
    micro-batch's peak, times pp - stage under the pipeline's 1F1B (stage = rank // (world /
    pp), the pipe axis outermost)."""
    mb = 2 ** 20
    for name, per_rank in per_plan.items():
        pp = PLANS[name][1].get("pp", 1)
        held = [(r["live_tensor_bytes"] + r["activation_peak_bytes"]
                 * (pp - rank // (WORLD // pp))) / mb for rank, r in enumerate(per_rank)]
        summary[name]["in_flight_held_per_rank_mb"] = held
        summary[name]["in_flight_held_max_mb"] = max(held)


def ratios(summary: dict) -> dict:
    """{plan}_over_{baseline} -> the plan's figures over the baseline's (the same run)."""
    keys = ("step_cpu_s_median", "param_bytes_max_mb", "optimizer_state_bytes_max_mb",
            "activation_peak_bytes_max_mb", "live_tensor_bytes_max_mb", "held_max_mb",
            "in_flight_held_max_mb")
    return {f"{a}_over_{b}": {k: summary[a][k] / summary[b][k] for k in keys} for a, b in RATIOS}


def whole_state_mb(summary: dict) -> float:
    """The dense model's whole training state in fp32 on one rank: its parameters (the sum of
    ZeRO-3's partitions) four times over (weights, gradients, Adam's two moments)."""
    return 4 * sum(summary["zero3"]["per_rank_mb"]["param_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="steps a plan, warmup included")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cap-mb", type=float, default=192.0,
                        help="a rank's memory budget (live tensors + activations)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    llms = {"dense": llm_config(args.layers, args.hidden),
            "moe": moe_config(args.layers, args.moe_hidden, 8, 2)}
    start, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_composed_") as tmp:
        plans = {name: (plan_config(f"{tmp}/{name}", llms[llm], par), ds_json(stage))
                 for name, (llm, par, stage) in PLANS.items()}
        per_plan = run_plans(plans, args.steps, args.warmup, counters)
    summary = summarise(per_plan, "zero3", args.cap_mb)
    in_flight(summary, per_plan)
    out = {"command": " ".join([".venv/bin/python benchmarks/composed_backbone.py",
                                *sys.argv[1:]]), "world": WORLD, "llms": llms, "steps": args.steps, "warmup": args.warmup,
           "cap_mb": args.cap_mb, "dense_whole_state_mb": whole_state_mb(summary),
           "plans": {k: [v[0], v[1], v[2]] for k, v in PLANS.items()},
           "load_avg_before": load, "load_avg_after": os.getloadavg()[0],
           "wall_s": time.perf_counter() - start, "ratios": ratios(summary),
           "results": summary}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "composed_backbone.json").write_text(json.dumps(out, indent=1))
    plot(summary, RESULTS / "composed_backbone.png",
         f"Composed backbone on 4 CPU ranks: Llama {args.layers} x {args.hidden}, "
         f"Qwen3-MoE {args.layers} x {args.moe_hidden}", args.cap_mb)
    print(json.dumps(out["ratios"], indent=1))


if __name__ == "__main__":
    main()
