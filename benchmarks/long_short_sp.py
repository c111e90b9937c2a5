"""Long-short SP for encoders: encoder step time with one long image per step, split against whole.

    .venv/bin/python benchmarks/long_short_sp.py [--world 2] [--rounds 12]   # a few minutes

`world` ranks on CPU over gloo form one group sharing a row (as under `parallel.sp`, or a
per-sequence block). Each step's row holds one long image (48 x 48 patches) and `world + 1` short
ones (16 x 16), encoded by a Qwen2-VL vision tower (4 blocks, width 256, 8 heads) through
`OmniModel`'s encoder modules, forward and backward. The plan comes from `plan_reshard`, the code
training runs:
- whole: `parallel.encoder_sp: "off"`: every image whole on one rank (costliest first onto the
  least-loaded rank), so the rank with the long image sets the step time;
- long_short: `"auto"`: the long image is encoded by every rank, a piece each, Ulysses attention
  inside the tower; the short ones run whole.
The step time is the slowest rank's (a barrier before, an all-reduce max of each rank's time
after); both variants run in each round, in alternating order, and the figure is the median over
rounds of the paired ratio whole / long_short. Two clocks: wall time, and each rank's CPU time
(`time.process_time`, one thread per rank): the busiest rank's CPU time is what a step would take
with a core (or a GPU) per rank, which a shared 2-core machine cannot give the wall clock.
Writes benchmarks/results/long_short_sp_w{world}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
VISION = {"depth": 4, "embed_dim": 256, "num_heads": 8, "mlp_ratio": 4, "hidden_size": 256,
          "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
LONG, SHORT = (1, 48, 48), (1, 16, 16)  # image grids (t, h, w) in patches


def vision_encoder():
    """The Qwen2-VL family's vision encoder module (tower + merger) of a random model."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from ds_omni.model.families.qwen2_vl import Qwen2VLVisionEncoder
    torch.manual_seed(0)
    config = Qwen2VLConfig(vision_config=VISION, text_config={
        "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [2, 3, 3]}})
    inner = Qwen2VLForConditionalGeneration(config).model
    return Qwen2VLVisionEncoder(tower=inner.visual, projector=inner.visual.merger,
                                placeholder_id=0, vision_config=config.vision_config)


def images(world: int):
    """The step's items: (inputs, embedding rows, modelled cost), the long one first; the cost
    has the cost model's shape for a ViT (linear in patches plus quadratic attention)."""
    import torch
    patch_dim = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    out = []
    for grid in [LONG] + [SHORT] * (world + 1):
        n = grid[0] * grid[1] * grid[2]
        gen = torch.Generator().manual_seed(n)
        out.append(({"pixel_values": torch.randn(n, patch_dim, generator=gen),
                     "image_grid_thw": torch.tensor([grid])}, n // 4, float(n + n * n / 1024)))
    return out


def plan_of(items, world: int, rank: int, policy):
    import numpy as np
    from ds_omni.parallel.reshard import ItemSlots, plan_reshard
    slots, start = [], 0
    for k, (_, rows, cost) in enumerate(items):
        slots.append(ItemSlots("vision", k, np.arange(start, start + rows), cost))
        start += rows
    shard_len = -(-start // world)
    return plan_reshard(slots, world, shard_len, ["vision"], policy)[rank]


def encode_step(encoder, items, plan, group) -> None:
    """What `EmbeddingRouter.embed_shard` runs for the encoder: whole items collated, then pieces."""
    import torch
    whole = [items[k][0] for k in plan.encode.get("vision", [])]
    feats = []
    if whole:
        feats.append(encoder({"pixel_values": torch.cat([w["pixel_values"] for w in whole]),
                              "image_grid_thw": torch.cat([w["image_grid_thw"] for w in whole])}))
    for k, bounds in plan.split.get("vision", []):
        feats.append(encoder.forward_piece(items[k][0], bounds, group, plan.rank))
    torch.cat(feats).square().mean().backward()


def slowest_rank_rounds(variants: dict, rounds: int, warmup: int, after) -> dict:
    """{clock: {variant: [seconds per round]}}, clock "wall" (the slowest rank's) and "cpu" (the
    busiest rank's): every round runs each variant once, in alternating order, between barriers;
    `after()` follows each run; the first `warmup` rounds are not kept. A collective: every rank
    calls it with the same variants."""
    import torch
    import torch.distributed as dist
    times = {clock: {name: [] for name in variants} for clock in ("wall", "cpu")}
    for r in range(warmup + rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            variants[name]()
            elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu],
                                   dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest / busiest rank's
            after()
            if r >= warmup:
                times["wall"][name].append(float(elapsed[0]))
                times["cpu"][name].append(float(elapsed[1]))
    return times


def ranks(rank: int, world: int, rounds: int, warmup: int) -> dict:
    import torch
    from ds_omni.parallel.long_short import LongItems
    torch.set_num_threads(1)
    encoder = vision_encoder()
    items = images(world)
    policies = {"whole": None, "long_short": LongItems(None, {"vision": VISION["num_heads"]})}
    plans = {name: plan_of(items, world, rank, p) for name, p in policies.items()}
    times = slowest_rank_rounds(
        {name: (lambda name=name: encode_step(encoder, items, plans[name], None))
         for name in policies}, rounds, warmup, after=lambda: encoder.zero_grad(set_to_none=True))
    return {"times": times, "split": {n: p.split for n, p in plans.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.harness import run_on_ranks
    (res, *_) = run_on_ranks(ranks, args.world, args=(args.rounds, args.warmup), timeout=3000)
    out = {"world": args.world, "rounds": args.rounds, "long_grid": LONG, "short_grid": SHORT,
           "vision": VISION, "long_item_split": bool(res["split"]["long_short"]),
           "load_avg": os.getloadavg()[0]}
    for clock, t in res["times"].items():
        ratios = [w / s for w, s in zip(t["whole"], t["long_short"])]
        out[clock] = {"median_step_s": {k: statistics.median(v) for k, v in t.items()},
                      "speedup_median": statistics.median(ratios), "ratios": ratios}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"long_short_sp_w{args.world}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] if k not in ("wall", "cpu") else
                      {m: out[k][m] for m in ("median_step_s", "speedup_median")}
                      for k in ("world", "wall", "cpu", "long_item_split", "load_avg")}, indent=1))


if __name__ == "__main__":
    main()
