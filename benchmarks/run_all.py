"""`make bench`: every measured CPU benchmark in one go, with progress, then BENCHMARKS.md's
summary figures regenerated from the results files (`benchmarks/summary.py`).

    .venv/bin/python benchmarks/run_all.py            # about 30 minutes on 2 cores
    .venv/bin/python benchmarks/run_all.py --full     # also the long fixed-size runs (+~40 min)
    .venv/bin/python benchmarks/run_all.py --only sim_megascale_omni sim_bytescale --dry-run

Each script runs at settings shorter than its summary row's command where that command alone
would take many minutes (fewer rounds or repeats, one configuration of several): the table
below. Each writes its results/*.json (and PNG) as it always does, so a figure it backs is
regenerated from the shorter run; the rows' commands stay the full settings. Not run: the GPU
scripts (gpu_mfu.py, gpu_check.py, which need a GPU), and without `--full` the fixed-size long
runs (soak.py's 500 steps, index.py's 1 GB file, balance.py's DP 8-4096 sweep). A script that
fails or runs past its limit is reported and the others still run; the exit status is 1 then.
Writes benchmarks/results/bench_run.json (each script's seconds and exit status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# (script, arguments, limit in seconds): the quick settings of `make bench`
QUICK = [
    ("loader.py", ["--only", "throughput", "--repeats", "3", "--steps", "20"], 300),
    ("loader.py", ["--only", "large_files", "--repeats", "1", "--steps", "10"], 600),
    ("loader.py", ["--only", "memory"], 300),
    ("prefetch.py", ["--repeats", "3", "--steps", "6"], 300),
    ("uniform.py", ["--rounds", "3", "--steps", "6"], 300),
    ("balance.py", ["--planning-only"], 300),
    ("planner_speed.py", ["--baseline", "37aacd2"], 300),
    ("pool_planner_speed.py", ["--baseline", "48c2bc9"], 400),
    ("long_short_sp.py", ["--world", "2", "--rounds", "4"], 300),
    ("encoder_pool.py", ["--world", "2", "--rounds", "4"], 300),
    ("encoder_shards.py", ["--rounds", "4"], 400),
    ("pipeline.py", ["--rounds", "4"], 600),
    ("per_sequence_sp.py", ["--rounds", "4"], 500),
    ("sequence_parallel.py", ["--only", "bytes"], 300),
    ("mp_reader.py", ["--steps", "3"], 400),
    ("feed_rate.py", ["--repeats", "3"], 300),
    ("sim_megascale_omni.py", [], 600),
    ("sim_bytescale.py", [], 900),
]
FULL = [("balance.py", [], 2400), ("index.py", [], 900), ("soak.py", [], 1800)]


def run(index: int, total: int, script: str, args: list[str], limit: int,
        dry_run: bool) -> dict:
    cmd = [sys.executable, f"benchmarks/{script}", *args]
    label = " ".join(["benchmarks/" + script, *args])
    print(f"[{index}/{total}] {label} ...", end=" ", flush=True)
    if dry_run:
        print("(dry run)")
        return {"command": label, "rc": None, "seconds": 0.0}
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, f"ran past its limit of {limit} s"
    seconds = time.perf_counter() - start
    print(f"{seconds:.0f} s" + ("" if rc == 0 else f"  FAILED (exit {rc}):\n{tail}"), flush=True)
    return {"command": label, "rc": rc, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also the long fixed-size runs")
    parser.add_argument("--only", nargs="+", help="script names (without .py) to run")
    parser.add_argument("--dry-run", action="store_true", help="list the runs, run none")
    args = parser.parse_args(argv)
    plan = QUICK + (FULL if args.full else [])
    if args.only:
        plan = [p for p in plan if p[0].removesuffix(".py") in args.only]
    start, runs = time.perf_counter(), []
    for i, (script, script_args, limit) in enumerate(plan, 1):
        runs.append(run(i, len(plan), script, script_args, limit, args.dry_run))
    failed = [r["command"] for r in runs if r["rc"] not in (0, None)]
    if not args.dry_run:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "bench_run.json").write_text(json.dumps(
            {"runs": runs, "wall_s": time.perf_counter() - start, "failed": failed}, indent=1)
            + "\n")
    print(f"benchmarks done in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {failed}" if failed else ""))
    summary = subprocess.run([sys.executable, "benchmarks/summary.py"], cwd=REPO)
    return 1 if failed or summary.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
