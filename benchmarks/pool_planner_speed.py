"""Encoder pool placement (`assign_pool`) speed against an earlier commit's, on identical rounds.

The module at `--baseline` (a git revision) is extracted as in `planner_speed.py` and run side by
side with the working tree's on the same rounds: ranks 64, 512 and 4096, rows alone (sp = 1) or
in SP groups of 2, 4 items a row with lognormal costs (some rows heavy, so items move); every
owner list must come out identical, else the run stops. Timed: CPU time of this process
(process_time) per round, median, alternating which goes first. Why it matters: every rank plans
every round of the pool (training), and the simulator plans them all for every rank.

Writes benchmarks/results/pool_planner_speed.json.
Run: .venv/bin/python benchmarks/pool_planner_speed.py --baseline 48c2bc9   (about 2 minutes)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import planner_speed  # noqa: E402
from ds_omni.parallelize import encoder_pool  # noqa: E402

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS")
               or Path(__file__).resolve().parent / "results")


def round_items(module, ranks: int, group: int, rng) -> list:
    """4 items a row; a row's cost scale is lognormal (sigma 1), so busy rows shed items."""
    items = []
    for home in range(0, ranks, group):
        scale = rng.lognormal(0.0, 1.0)
        for k in range(4):
            rows = int(rng.integers(16, 256))
            shards = tuple(np.bincount(np.arange(rows) * group // rows, minlength=group).tolist()
                           ) if group > 1 else ()
            items.append(module.PoolItem(home, "vision", k, rows, float(scale * rows),
                                         shards=shards))
    return items


def compare(modules, ranks: int, group: int, rounds: int, seed: int) -> dict:
    spent = {m: [] for m in modules}
    for r in range(rounds):
        order = modules if r % 2 else modules[::-1]
        owners = []
        for mod in order:
            items = round_items(mod, ranks, group, np.random.default_rng([seed, ranks, group, r]))
            t0 = time.process_time()
            owners.append(mod.assign_pool(items, ranks))
            spent[mod].append(time.process_time() - t0)
        if owners[0] != owners[1]:
            raise SystemExit(f"owners differ (ranks {ranks}, group {group}, round {r})")
    base, cur = (float(np.median(spent[m]) * 1e3) for m in modules)
    return {"baseline_cpu_ms": base, "current_cpu_ms": cur, "speedup_cpu": base / cur}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="git revision to compare to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        planner_speed.load_baseline(args.baseline, Path(tmp))
        old = importlib.import_module("ds_omni_baseline.parallelize.encoder_pool")
        rows = {}
        for ranks, rounds in ((64, 20), (512, 6), (4096, 2)):
            for group in (1, 2):
                key = f"ranks{ranks}_sp{group}"
                rows[key] = compare((old, encoder_pool), ranks, group, rounds, args.seed)
                print(key, json.dumps(rows[key]), flush=True)
    report = {"command": ".venv/bin/python benchmarks/pool_planner_speed.py --baseline "
                         f"{args.baseline}", "baseline": args.baseline, "seed": args.seed,
              "metric": "median CPU ms of assign_pool per round; owners of both identical",
              "results": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pool_planner_speed.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
