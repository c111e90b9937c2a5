"""Joint pipeline: the encoders' optimizer step sharded over the stages against done on every stage.

    .venv/bin/python benchmarks/encoder_shards.py                          # PP=2, about 2 minutes
    .venv/bin/python benchmarks/encoder_shards.py --pp 4 --layers 4 --rounds 16   # PP=4, about 3

Under `parallel.encoder_placement: "uniform"` every stage holds the encoders. ds_omni gives each
trainable encoder parameter one owner stage: its gradient is reduced onto the owner, only the
owner's optimizer steps it, and the owner broadcasts the update (`EncoderShards`). The baseline,
"replicated", is what ds_omni did before: the gradients all-reduced over the pipeline and every
stage's optimizer stepping the whole encoder copy (stages other than 0 marked
`ds_pipe_replicated`); it is built here only, by giving the engine a `ReplicatedShards` in place of
`EncoderShards` (same interface), so both run in one launch, on the same machine load.

Workload, clocks and rounds are `benchmarks/pipeline.py`'s (its config, one CLIP tower of 6 layers
of width 256, ~5M parameters, 16 samples a step in 8 micro-batches of 2, ZeRO-1, dp=1, one thread
per rank), mixes 9:1 and 1:9 image:text. Both engines take one step each per round in a rotating
order; the figure is the median over rounds of the paired ratio replicated / sharded of the
busiest stage's CPU time (and of each stage's). Writes benchmarks/results/encoder_shards[_pp4].json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pipeline import config, rotating_rounds  # noqa: E402

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
MIXES = ("image_heavy_9to1", "text_heavy_1to9")
ENGINES = ("sharded", "replicated")


class ReplicatedShards:
    """The baseline: every stage owns (and steps) every encoder parameter; gradients summed over
    the pipeline by one all-reduce; nothing to broadcast."""

    def __init__(self, params, stage, stages, group):
        self.params, self.group = params, group
        self.owned, self.replicas = list(params), []

    def reduce_grads(self) -> None:
        import torch
        import torch.distributed as dist
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def broadcast_params(self) -> None:
        pass

    def replicas_frozen(self):
        return contextlib.nullcontext()


def build(cfg, ds_json: dict, rank: int, plan, engine: str):
    """`setup_training` of one engine; "replicated" swaps in `ReplicatedShards` for its build,
    and marks stage > 0's encoder copies as DeepSpeed replicas, as before."""
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallelize import pipeline
    from ds_omni.train.setup import setup_training
    original = pipeline.EncoderShards
    if engine == "replicated":
        pipeline.EncoderShards = ReplicatedShards
    try:
        built, loader, ds_engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_json, plan),
                                                  rank, plan)
    finally:
        pipeline.EncoderShards = original
    joint = ds_engine.module.joint
    if engine == "replicated" and joint.stage != 0:
        for p in joint.encoders.parameters():
            p.ds_pipe_replicated, p.model_parallel = True, False
    return loader, ds_engine, groups


def ranks(rank: int, world: int, out_dir: str, text: dict, rounds: int, warmup: int,
          layers: int) -> dict:
    import torch
    from ds_omni.parallel.plan import ParallelPlan
    from tests.fixtures import ds_config
    torch.set_num_threads(1)
    runs, optimized = {}, {}
    for mix in MIXES:
        for engine in ENGINES:
            cfg = config(mix, "uniform", f"{out_dir}/{engine}", text, warmup + rounds, pp=world,
                         layers=layers)
            plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
            runs[(mix, engine)] = build(cfg, ds_config(1), rank, plan, engine)
            joint = runs[(mix, engine)][1].module.joint
            optimized[engine] = sum(p.numel() for p in joint.shards.owned)
    log = rotating_rounds(runs, warmup + rounds)
    return {"log": log, "encoder_params_stepped_here": optimized}


def summarise(per_rank: list[dict], warmup: int) -> dict:
    logs = [r["log"] for r in per_rank]
    out = {}
    for mix in MIXES:
        cpu = {e: [[s["cpu_s"] for s in log[f"{mix}/{e}"][warmup:]] for log in logs]
               for e in ENGINES}  # engine -> stage -> round
        busiest = {e: [max(stages) for stages in zip(*cpu[e])] for e in ENGINES}
        out[mix] = {
            "busiest_stage_cpu_s_median": {e: statistics.median(busiest[e]) for e in ENGINES},
            "replicated_over_sharded_busiest_cpu_median_of_paired_ratios": statistics.median(
                a / b for a, b in zip(busiest["replicated"], busiest["sharded"])),
            "cpu_s_median_per_stage": {e: [statistics.median(s) for s in cpu[e]] for e in ENGINES},
            "replicated_over_sharded_cpu_per_stage_median_of_paired_ratios": [
                statistics.median(a / b for a, b in zip(rep, sh))
                for rep, sh in zip(cpu["replicated"], cpu["sharded"])],
            "wall_s_median": {e: statistics.median(max(log[f"{mix}/{e}"][i]["step_s"]
                                                       for log in logs)
                                                   for i in range(warmup, len(logs[0][f"{mix}/{e}"])))
                              for e in ENGINES},
        }
    out["encoder_params_stepped_per_stage"] = {
        e: [r["encoder_params_stepped_here"][e] for r in per_rank] for e in ENGINES}
    return out


def main(argv=None) -> None:
    from tests.fixtures import text_source
    from tests.harness import run_on_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2, choices=(2, 4))
    ap.add_argument("--layers", type=int, default=0,
                    help="LLM decoder layers (benchmarks/pipeline.py's default per --pp)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    t0, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ds_omni_shards_") as tmp:
        text = text_source(Path(tmp))
        per_rank = run_on_ranks(ranks, args.pp, args=(tmp, text, args.rounds, args.warmup,
                                                       args.layers), timeout=3000)
    report = {"command": " ".join([".venv/bin/python benchmarks/encoder_shards.py",
                                   *(argv or sys.argv[1:])]),
              "pp": args.pp, "layers": args.layers, "zero_stage": 1, "rounds": args.rounds,
              "warmup": args.warmup, "load_average_before": load_before,
              **summarise(per_rank, args.warmup),
              "runtime_s": round(time.perf_counter() - t0, 1), "load_average_after": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "encoder_shards" + ("" if args.pp == 2 else f"_pp{args.pp}") + ".json"
    (args.out / name).write_text(json.dumps(report, indent=1))
    print(json.dumps({m: report[m] for m in MIXES}, indent=1))


if __name__ == "__main__":
    main()
