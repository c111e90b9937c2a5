"""Joint pipeline: step time of PP=2 on 2 ranks (--pp 4: 4), encoders on stage 0 against uniform.

    .venv/bin/python benchmarks/pipeline.py        # about 4-8 minutes on 2 shared cores
    .venv/bin/python benchmarks/pipeline.py --zero 0   # the same under ZeRO-0: pipeline_zero0.json
    .venv/bin/python benchmarks/pipeline.py --pp 4 --rounds 16 --warmup 2   # pipeline_pp4.json
    .venv/bin/python benchmarks/pipeline.py --pp 4 --layers 4 --rounds 16 --warmup 2  # _pp4_l4

`--pp 4` runs PP=4 on 4 ranks (dp=1) with an LLM of 8 decoder layers of the same width (4 layers
over 4 stages leave the cost model almost no choice; `--layers 4` keeps PP=2's LLM and so its
encoder share) and the variants planned for 96-token samples (all but "stage0_full_len"), the
same mixes and clocks.

Two ranks on CPU over gloo, one pipeline of 2 stages (dp=1, ZeRO-1), through the real
`setup_training` / `train_step`. The vision tower is a realistic share of the work: as in a real
VLM (a CLIP-L tower next to a 7B LLM costs about 1.5 LLM layers per image; smaller LLMs make it
several), one image through the tower (CLIP, 6 layers of width 256, 64x64 images: 65 tokens,
~0.6 GFLOP forward) costs about as much as 5 of the LLM's decoder layers (width 256, ~0.12 GFLOP
each over one sample of ~100 tokens).
Stage boundaries come from the cost model for a micro-batch with one image per sample (what
`ds-omni plan` prints), planned for samples of 96 tokens (`parallel.stage_tokens`: one image's 65
tokens and a caption); "stage0_full_len" keeps the boundaries planned for full-length samples
(data.max_seq_len = 256, the default), which give stage 0 a decoder layer too many for this data
and were what the first runs measured. Two more variants put the encoders on stage 0 with the
boundaries other stacks choose (`parallel.stage_split`): "stage0_parameters", DeepSpeed's default
(`partition_method="parameters"`, the tower's trainable parameters counted on stage 0), and
"stage0_layers", Megatron-LM's (decoder layers split evenly). Mixes (image samples :
text-only samples): 9:1 (image-heavy), 1:1 and 1:9; a training run whose mix swings between 1:9
and 9:1 from step to step meets each of them with the same boundaries.

All fifteen engines (3 mixes x 5 variants) live in one launch and take one step each per round,
in an order that rotates. Two clocks per step: the wall time (the slower rank's) and the busiest
stage's CPU time (each rank's `time.process_time` over the step, one thread per rank: what the
stage computed, which the load of other jobs on a shared machine does not stretch the way it
stretches wall time). The figure per mix and clock is the median over rounds of the paired ratio
<variant> / uniform for every other variant. Writes benchmarks/results/pipeline.json.
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

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
VISION = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 6,
          "num_attention_heads": 4, "image_size": 64, "patch_size": 8}
LLM = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
       "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}
LAYERS_AT_PP = {2: 4, 4: 8}  # decoder layers per pipeline depth: at PP=4, 4 layers = 1 a stage
MIXES = {"image_heavy_9to1": 9.0, "even_1to1": 1.0, "text_heavy_1to9": 1 / 9}  # image : text
# variant -> (parallel.encoder_placement, parallel.stage_tokens, parallel.stage_split): cost-model
# boundaries planned for a sample of one image (65 tokens) and its caption, 96 tokens;
# "stage0_full_len" keeps the boundaries planned for full-length samples (max_seq_len 256, the
# default), which the first runs measured; "stage0_parameters" and "stage0_layers" split as
# DeepSpeed's default and Megatron-LM do (their boundaries do not depend on the sample length)
VARIANTS = {"stage0": ("stage0", 96, "cost"), "uniform": ("uniform", 96, "cost"),
            "stage0_full_len": ("stage0", 0, "cost"),
            "stage0_parameters": ("stage0", 96, "parameters"),
            "stage0_layers": ("stage0", 96, "layers")}
PLACEMENTS = tuple(VARIANTS)
DEEP_PLACEMENTS = tuple(v for v in VARIANTS if v != "stage0_full_len")  # PP > 2


def llm_config(pp: int, layers: int = 0) -> dict:
    """The LLM of a PP=`pp` run: `layers` decoder layers (0: LAYERS_AT_PP), the same width."""
    layers = layers or LAYERS_AT_PP[pp]
    if layers < pp:
        raise SystemExit(f"--layers {layers}: {pp} stages need at least {pp} decoder layers; "
                         f"pass --layers {pp} or more")
    return dict(LLM, num_hidden_layers=layers)
GLOBAL_BATCH, MICRO = 16, 2


def config(mix: str, placement: str, out_dir: str, text: dict, steps: int, pp: int = 2,
           layers: int = 0):
    from ds_omni.config import OmniConfig, from_dict
    from tests.fixtures import tiny_config_dict
    d = tiny_config_dict(f"{out_dir}/{mix}_{placement}", steps=steps,
                         global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO)
    d["model"]["vision"]["config"].update(VISION)
    d["model"]["llm"]["config"].update(llm_config(pp, layers))
    d["data"]["sources"] = [{"name": "shapes", "path": "builtin:shapes", "weight": MIXES[mix]},
                            dict(text, weight=1.0)]
    d["data"]["max_seq_len"] = 256
    where, tokens, split = VARIANTS[placement]
    d["parallel"] = {"pp": pp, "encoder_placement": where, "stage_tokens": tokens,
                     "stage_split": split}
    return from_dict(OmniConfig, d)


def ranks(rank: int, world: int, out_dir: str, text: dict, rounds: int, warmup: int,
          zero: int = 1, mixes: tuple = tuple(MIXES), placements: tuple = PLACEMENTS,
          layers: int = 0) -> dict:
    import torch
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.parallelize.pipeline import stage_plan
    from ds_omni.train.setup import cost_model, setup_training
    from tests.fixtures import ds_config
    torch.set_num_threads(1)
    runs, predicted = {}, {}
    for mix in mixes:
        for placement in placements:
            cfg = config(mix, placement, out_dir, text, warmup + rounds, pp=world, layers=layers)
            plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
            built, loader, engine, groups = setup_training(
                cfg, derive_ds_config(cfg, ds_config(zero), plan), rank, plan)
            runs[(mix, placement)] = (loader, engine, groups)
            stages = stage_plan(cfg, built, plan, cost_model(cfg, built))
            predicted[placement] = [t / 1e9 for t in stages.stage_time]
    log = rotating_rounds(runs, warmup + rounds)
    parts = {f"{m}/{p}": list(e.module.parts) for (m, p), (_, e, _) in runs.items()}
    return {"log": log, "parts": parts, "predicted_stage_gflop": predicted}


def rotating_rounds(runs: dict, steps: int) -> dict[str, list]:
    """`steps` rounds of one step of every run ({(mix, name): (loader, engine, groups)}), the order
    rotated each round so that no run always goes first: {"mix/name": [one_step's record]}."""
    labels = list(runs)
    log = {f"{m}/{p}": [] for m, p in labels}
    for i in range(steps):
        for mix, name in labels[i % len(labels):] + labels[:i % len(labels)]:
            log[f"{mix}/{name}"].append(one_step(*runs[(mix, name)]))
    return log


def one_step(loader, engine, groups) -> dict:
    import torch.distributed as dist
    from ds_omni.train.step import train_step
    batch = loader.next_step()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    result = train_step(engine, batch, groups)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    images = sum(len(mb.items.get("vision", [])) for mb in batch.micro_batches)
    return {"step_s": wall, "cpu_s": cpu, "loss": result.loss, "images": images,
            "tokens": result.tokens}


def summarise(per_rank: list[dict], warmup: int) -> dict:
    logs = [r["log"] for r in per_rank]
    out = {}
    mixes = [m for m in MIXES if f"{m}/stage0" in logs[0]]
    placements = [p for p in PLACEMENTS if f"{mixes[0]}/{p}" in logs[0]]
    for mix in mixes:
        entry = {}
        for clock in ("step_s", "cpu_s"):  # wall: the slower rank; CPU: the busiest stage
            steps = {p: [max(log[f"{mix}/{p}"][i][clock] for log in logs)
                         for i in range(warmup, len(logs[0][f"{mix}/{p}"]))] for p in placements}
            entry.update({f"{p}_{clock}_median": statistics.median(steps[p]) for p in placements})
            for base in (p for p in placements if p != "uniform"):
                ratios = [a / b for a, b in zip(steps[base], steps["uniform"])]
                entry[f"{base}_over_uniform_{clock}_median_of_paired_ratios"] = \
                    statistics.median(ratios)
        entry["cpu_s_median_per_stage"] = {p: [statistics.median(
            s["cpu_s"] for s in log[f"{mix}/{p}"][warmup:]) for log in logs] for p in placements}
        entry["images_per_step"] = statistics.mean(
            s["images"] for s in logs[0][f"{mix}/stage0"][warmup:])
        entry["stage_boundaries"] = {p: per_rank[0]["parts"][f"{mix}/{p}"] for p in placements}
        out[mix] = entry
    out["predicted_stage_gflop_per_micro_batch"] = per_rank[0]["predicted_stage_gflop"]
    for p in placements:  # a run swinging between the mixes meets each of these step times
        for clock in ("step_s", "cpu_s"):
            times = [out[m][f"{p}_{clock}_median"] for m in mixes]
            out[f"{p}_{clock}_max_over_mean_across_mixes"] = max(times) / statistics.mean(times)
    return out


def main(argv=None) -> None:
    from tests.fixtures import text_source
    from tests.harness import run_on_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1),
                    help="ZeRO stage (1: pipeline.json; 0: pipeline_zero0.json)")
    ap.add_argument("--pp", type=int, default=2, choices=sorted(LAYERS_AT_PP),
                    help="pipeline stages = ranks (dp=1); 4: 8 decoder layers, pipeline_pp4.json")
    ap.add_argument("--layers", type=int, default=0,
                    help="LLM decoder layers (default 4 at --pp 2, 8 at --pp 4); another count "
                         "writes pipeline_pp<N>_l<layers>.json")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    args = ap.parse_args(argv)
    placements = PLACEMENTS if args.pp == 2 else DEEP_PLACEMENTS
    t0, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ds_omni_ppbench_") as tmp:
        text = text_source(Path(tmp))
        per_rank = run_on_ranks(ranks, args.pp, args=(tmp, text, args.rounds, args.warmup,
                                                       args.zero, tuple(args.mixes), placements,
                                                       args.layers),
                                timeout=3000)
    command = " ".join([".venv/bin/python benchmarks/pipeline.py", *(argv or sys.argv[1:])])
    report = {"command": command, "world": args.pp, "pp": args.pp,
              "variants": {p: VARIANTS[p] for p in placements},
              "load_average_before": load_before,
              "zero_stage": args.zero, "vision": VISION, "llm": llm_config(args.pp, args.layers),
              "mixes_image_to_text": MIXES,
              "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO,
              "rounds": args.rounds, "warmup": args.warmup, **summarise(per_rank, args.warmup),
              "runtime_s": round(time.perf_counter() - t0, 1), "load_average_after": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "pipeline" + ("" if args.pp == 2 else f"_pp{args.pp}") + \
        ("" if args.layers in (0, LAYERS_AT_PP[args.pp]) else f"_l{args.layers}") + \
        ("" if args.zero == 1 else f"_zero{args.zero}") + ".json"
    (args.out / name).write_text(json.dumps(report, indent=1))
    print(json.dumps({f"{m} {b} {c}": report[m][f"{b}_over_uniform_{c}_median_of_paired_ratios"]
                      for m in MIXES if m in report for c in ("step_s", "cpu_s")
                      for b in placements if b != "uniform"}
                     | {k: v for k, v in report.items() if "max_over_mean" in k}, indent=1))


if __name__ == "__main__":
    main()
