"""Budget planner speed against an earlier commit's planner, on identical inputs, same run.

The planner at `--baseline` (a git revision) is extracted into a temporary package and run side by
side with the working tree's: both get the same sample stream, step by step, and every plan must
come out identical (keys, ranks, micro-batches, blocks, delays); a difference stops the run.
Timed per group and step: add() of the step's samples + plan(), wall (perf_counter) and CPU time
of this process (process_time), alternating which planner goes first. Workloads are
`benchmarks/balance.py`'s: the long-tail text mix (32 sequences per rank, 16 micro-batches,
per-sequence SP up to 8 and without) and the 1:1 multimodal mix (16 per rank, M = 4), G = 8.

Writes benchmarks/results/planner_speed.json.
Run: .venv/bin/python benchmarks/planner_speed.py --baseline 37aacd2   (about a minute)
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import balance as bal  # noqa: E402
from ds_omni.data import reorder  # noqa: E402
from ds_omni.data.cost import CostModel  # noqa: E402

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS")
               or Path(__file__).resolve().parent / "results")


def load_baseline(rev: str, into: Path):
    """`ds_omni.data.reorder` as of git revision `rev`, imported as package `ds_omni_baseline`."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "ds_omni"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    pkg = into / "ds_omni_baseline"
    (into / "ds_omni").rename(pkg)
    for f in pkg.rglob("*.py"):  # the baseline's own imports must stay inside it
        f.write_text(f.read_text().replace("from ds_omni.", "from ds_omni_baseline.")
                     .replace("import ds_omni.", "import ds_omni_baseline."))
    sys.path.insert(0, str(into))
    return importlib.import_module("ds_omni_baseline.data.reorder")


def _same(a, b) -> bool:
    x, y = a.assignment, b.assignment
    return (a.keys == b.keys and np.array_equal(x.rank, y.rank) and np.array_equal(x.micro, y.micro)
            and {i: (k.start, k.size, k.round) for i, k in x.blocks.items()}
            == {i: (k.start, k.size, k.round) for i, k in y.blocks.items()}
            and np.array_equal(a.delay, b.delay) and a.outliers == b.outliers
            and a.forced == b.forced)


def _timed(spent: list, fn, *args):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args)
    spent[0] += time.perf_counter() - t0
    spent[1] += time.process_time() - c0
    return out


def compare(modules, work, n: int, m: int, tokens: int, degree: int, groups: int,
            steps: int, warmup: int) -> dict:
    """Both planners on each group's stream; returns medians per planner, checks every plan."""
    budget = reorder.rank_budget(work.draw(200_000)[0], n)
    times = {mod: ([], []) for mod in modules}
    for g in range(groups):
        pls = {mod: mod.BudgetPlanner(8, m, max_wait=2, lookahead=1.5) for mod in modules}
        stream = bal.GroupStream(work, block=8 * n * 4)
        for step in range(warmup + steps):
            order = modules if (g + step) % 2 else modules[::-1]
            spent = {mod: [0.0, 0.0] for mod in modules}  # wall, cpu
            while pls[modules[0]].wants_more(budget):
                read = stream.take(8 * n // 4)
                for mod in order:
                    _timed(spent[mod], pls[mod].add, *read)
            plans = [_timed(spent[mod], pls[mod].plan, budget, tokens, degree) for mod in order]
            if step >= warmup:
                for mod in modules:
                    times[mod][0].append(spent[mod][0])
                    times[mod][1].append(spent[mod][1])
            if not _same(*plans):
                raise SystemExit(f"plans differ (group {g}, step {step}): the change is not exact")
    return {name: {"wall_ms": float(np.median(times[mod][0]) * 1e3),
                   "cpu_ms": float(np.median(times[mod][1]) * 1e3)}
            for name, mod in zip(("baseline", "current"), modules)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="git revision of the planner to compare to")
    ap.add_argument("--groups", type=int, default=12, help="groups (streams) per workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    cm = CostModel(bal.model_dims())
    lt = lambda k: bal.LongTailWorkload(bal.LongTailParams(), cm, [args.seed, k])  # noqa: E731
    mm = lambda k: bal.Workload(bal.workload_spec(0.5), cm, [args.seed, k])  # noqa: E731
    cases = {"long_tail_per_sequence_sp": (lt(1), 32, 16, 32768, 8),
             "long_tail": (lt(2), 32, 16, 262144, 1),
             "multimodal_1:1_per_sequence_sp": (mm(3), 16, 4, 32768, 8),
             "multimodal_1:1": (mm(4), 16, 4, 32768, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        modules = (load_baseline(args.baseline, Path(tmp)), reorder)
        rows = {}
        for name, (work, n, m, tokens, degree) in cases.items():
            r = compare(modules, work, n, m, tokens, degree, args.groups, steps=4, warmup=2)
            rows[name] = r | {"speedup_wall": r["baseline"]["wall_ms"] / r["current"]["wall_ms"],
                              "speedup_cpu": r["baseline"]["cpu_ms"] / r["current"]["cpu_ms"]}
            print(name, json.dumps(rows[name]), flush=True)
    report = {"command": f".venv/bin/python benchmarks/planner_speed.py --baseline {args.baseline}",
              "baseline": args.baseline, "seed": args.seed, "groups": args.groups,
              "metric": "median per group and step of add() + plan(), G = 8; every plan of both "
                        "planners compared and identical", "results": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_speed.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
