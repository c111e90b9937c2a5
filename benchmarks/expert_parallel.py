"""Expert parallelism: step time and memory per rank at ep 1 / 2 / 4 on 4 ranks, against ZeRO-3.

    .venv/bin/python benchmarks/expert_parallel.py [--layers 4] [--hidden 256] [--steps 3]
    # about 6 minutes on a 2-core machine at load 30

Four CPU ranks over gloo train the demo composition (CLIP tower, builtin:shapes data) with a
Qwen3-MoE backbone (default 4 layers, width 256, 8 experts of width 512, top-2, HF's auxiliary
loss on), through the real `setup_training` / `train_step`, the plans one after another in one
launch (`benchmarks/model_memory.py`):
- ep1_zero3 (the baseline): dp 4, ZeRO-3, every expert on every rank (HF's MoE blocks), its
  parameters partitioned over the 4 ranks;
- ep1_zero2: dp 4, ZeRO-2, HF's MoE blocks whole on every rank;
- ep2_zero2, ep4_zero2: DeepSpeed's AutoEP, each rank holding 4 / 2 of the 8 experts of every
  layer, tokens sent to their experts' ranks by all-to-all.
Each plan trains the same global batch (8 samples, micro-batches of 2) for `steps` steps; the
figures are each plan's busiest rank's median step CPU time and its largest rank's memory parts
(parameters, optimizer state, activation peak, live tensors, RSS growth) as ratios against
ep1_zero3's, all measured in this run. Writes benchmarks/results/expert_parallel.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.tensor_parallel import (BUCKET, RESULTS, WORLD, ds_json, make_config,  # noqa: E402
                                        plot, run_plans, summarise)

PLANS = {"ep1_zero3": (1, 3), "ep1_zero2": (1, 2), "ep2_zero2": (2, 2), "ep4_zero2": (4, 2)}
BASELINE = "ep1_zero3"


def moe_config(layers: int, hidden: int, experts: int, top_k: int) -> dict:
    """A Qwen3-MoE backbone: every layer sparse, experts 2 x width wide, 64-wide heads."""
    heads = hidden // 64
    return {"model_type": "qwen3_moe", "hidden_size": hidden, "intermediate_size": 4 * hidden,
            "moe_intermediate_size": 2 * hidden, "num_experts": experts,
            "num_experts_per_tok": top_k, "norm_topk_prob": True, "output_router_logits": True,
            "router_aux_loss_coef": 0.01, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "head_dim": 64, "max_position_embeddings": 256, "tie_word_embeddings": False}


def ep_counters(engine) -> dict:
    """The mechanism ran: AutoEP's MoE blocks in the model (0 without ep)."""
    from ds_omni.parallelize.expert_parallel import autoep_layers
    return {"autoep_blocks": len(autoep_layers(engine.module))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps a plan, warmup included")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    llm = moe_config(args.layers, args.hidden, args.experts, args.top_k)
    start, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_ep_") as tmp:
        plans = {name: (make_config(f"{tmp}/{name}", llm, ep=ep), ds_json(stage))
                 for name, (ep, stage) in PLANS.items()}
        per_plan = run_plans(plans, args.steps, args.warmup, ep_counters)
    summary = summarise(per_plan, BASELINE)
    out = {"world": WORLD, "llm": llm, "steps": args.steps, "warmup": args.warmup,
           "plans": {k: list(v) for k, v in PLANS.items()}, "baseline": BASELINE,
           "bucket_elements": BUCKET, "load_avg_before": load,
           "load_avg_after": os.getloadavg()[0], "wall_s": time.perf_counter() - start,
           "results": summary}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "expert_parallel.json").write_text(json.dumps(out, indent=1))
    plot(summary, RESULTS / "expert_parallel.png",
         f"AutoEP on 4 CPU ranks, Qwen3-MoE {args.layers} x {args.hidden}, "
         f"{args.experts} experts top-{args.top_k}")
    print(json.dumps({n: r["over_baseline"] for n, r in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
