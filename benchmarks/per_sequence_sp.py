"""Per-sequence SP degree: real step time on 4 ranks, a long-tail workload, against static sp=2 and sp=1.

    .venv/bin/python benchmarks/per_sequence_sp.py        # about 5-10 minutes on 2 shared cores

Four ranks on CPU over gloo, through the real `setup_training` / `train_step`, one global batch of
16 samples per step: mostly short image samples (~45 tokens) plus, about one in eight, a long one
(an image and ~1500 tokens of text, `tests.fixtures.long_source`). Variants, all with fixed-count
reordering over the 4 data-parallel ranks:
- sp1: dp=4, every sequence whole on one rank (the long one sets the step time);
- sp2: dp=2 x sp=2, every row split over 2 ranks (all-to-alls on every sequence);
- per_sequence: dp=4, `parallel.max_sequence_sp=4`: the long sequence gets a block, the others
  run alone.
All engines live in one launch and take one step each per round, in an order that rotates; the
figure is the median over rounds of the paired ratio variant / sp1 of the step time (the slowest
rank's; the loader's time is measured apart). Writes benchmarks/results/per_sequence_sp.json.
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
LLM = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
       "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 4096}
VARIANTS = {"sp1": {"sp": 1}, "sp2": {"sp": 2}, "per_sequence": {"max_sequence_sp": 4}}
MAX_LEN, GLOBAL_BATCH, MICRO = 2048, 16, 2


def variant_config(label: str, out_dir: str, long: dict, steps: int):
    from ds_omni.config import OmniConfig, from_dict
    from tests.fixtures import tiny_config_dict
    d = tiny_config_dict(f"{out_dir}/{label}", steps=steps, global_batch_size=GLOBAL_BATCH,
                         micro_batch_size=MICRO)
    d["model"]["llm"]["config"].update(LLM)
    d["data"]["sources"].append(long)
    d["data"].update(max_seq_len=MAX_LEN, pack_tokens=MAX_LEN * MICRO)
    dp = 4 // VARIANTS[label].get("sp", 1)
    d["data"]["reorder"] = {"mode": "fixed", "group_size": dp}
    d["parallel"] = dict(VARIANTS[label])
    return from_dict(OmniConfig, d)


def ranks(rank: int, world: int, out_dir: str, long: dict, rounds: int, warmup: int) -> dict:
    import torch
    from deepspeed.utils import groups as ds_groups
    from benchmarks.sequence_parallel import _one_step
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.setup import setup_training
    from tests.fixtures import ds_config
    torch.set_num_threads(1)
    runs = {}
    for label in VARIANTS:
        cfg = variant_config(label, out_dir, long, warmup + rounds)
        plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
        _, loader, engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_config(1), plan),
                                                   rank, plan)
        runs[label] = (loader, engine, groups)
    labels = list(runs)
    log = {label: [] for label in labels}
    for i in range(warmup + rounds):
        for label in labels[i % len(labels):] + labels[:i % len(labels)]:
            log[label].append(_one_step(*runs[label], ds_groups))
    return log


def summarise(per_rank: list[dict], warmup: int) -> dict:
    out = {}
    steps = {label: [max(r[label][i]["step_s"] for r in per_rank)
                     for i in range(warmup, len(per_rank[0][label]))] for label in VARIANTS}
    for label in VARIANTS:
        out[label] = {"step_s_median": statistics.median(steps[label]),
                      "load_s_median": statistics.median(
                          max(r[label][i]["load_s"] for r in per_rank)
                          for i in range(warmup, len(per_rank[0][label]))),
                      "tokens_per_step": per_rank[0][label][-1]["tokens"],
                      "losses": [per_rank[0][label][i]["loss"] for i in range(len(steps[label]))]}
    for label in ("sp2", "per_sequence"):
        ratios = [b / a for a, b in zip(steps["sp1"], steps[label])]
        out[label]["over_sp1_median_of_paired_ratios"] = statistics.median(ratios)
        out[label]["over_sp1_per_round"] = ratios
    ratios = [b / a for a, b in zip(steps["sp2"], steps["per_sequence"])]
    out["per_sequence"]["over_sp2_median_of_paired_ratios"] = statistics.median(ratios)
    # sp1 and per_sequence train the same global batches (dp=4, same reordering): same losses
    out["per_sequence"]["same_losses_as_sp1"] = all(
        abs(a - b) <= 1e-5 * abs(a) for a, b in zip(out["sp1"]["losses"],
                                                    out["per_sequence"]["losses"]))
    return out


def main(argv=None) -> None:
    from tests.fixtures import long_source
    from tests.harness import run_on_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ds_omni_hdpbench_") as tmp:
        long = long_source(Path(tmp), weight=0.14, words=1200)
        per_rank = run_on_ranks(ranks, 4, args=(tmp, long, args.rounds, args.warmup),
                                timeout=3000)
    report = {"command": ".venv/bin/python benchmarks/per_sequence_sp.py", "world": 4,
              "zero_stage": 1, "variants": VARIANTS, "llm": LLM, "max_seq_len": MAX_LEN,
              "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO,
              "rounds": args.rounds, "warmup": args.warmup,
              **summarise(per_rank, args.warmup), "runtime_s": round(time.perf_counter() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "per_sequence_sp.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k].get("over_sp1_median_of_paired_ratios") for k in
                      ("sp2", "per_sequence")} | {
        "per_sequence_over_sp2": report["per_sequence"]["over_sp2_median_of_paired_ratios"]}))


if __name__ == "__main__":
    main()
