"""`make bench`: every measured CPU benchmark in one go, with progress, then BENCHMARKS.md's
summary figures regenerated from the results files (`benchmarks/summary.py`).

    .venv/bin/python benchmarks/run_all.py            # make bench: 15 minutes on 2 shared cores
    .venv/bin/python benchmarks/run_all.py --full     # every row's command at its own settings
    .venv/bin/python benchmarks/run_all.py --dry-run  # the runs, where each writes, last seconds

Where results go. A summary row names a command, its page the results file it wrote; a run at other
settings must not overwrite that file, or the row's figure would silently change meaning. So:
- a run at the row's own settings (`Bench.quick` None: the command is short enough) writes to
  benchmarks/results/, and the summary regenerates the row from it;
- a run at shorter settings (`Bench.quick`: fewer rounds or repeats) writes to
  benchmarks/results/quick/ (the scripts read `DS_OMNI_BENCH_RESULTS`): it shows the code
  still runs and what it measures at those settings, printed beside the row's figure at the
  end; it never touches a row's file;
- `--full` runs every row's command at its own settings into benchmarks/results/ (hours).
Runs too long for 30 minutes even shortened (`Bench.full_only`: the fixed-size long runs)
and rows no command here reproduces (`NOT_RUN`: the GPU scripts, figures of renamed files)
are listed with their reason; tests/unit/project/test_summary.py checks that every row's command is
one of these. A script that fails or runs past its limit is reported and the others still
run; the exit status is 1 then. Writes bench_run.json (each run's seconds and exit status)
into each folder it wrote to.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
QUICK_RESULTS = RESULTS / "quick"


@dataclass(frozen=True)
class Bench:
    command: str
    """A summary row's command, as the row writes it without `.venv/bin/python benchmarks/`."""
    writes: tuple[str, ...]
    """The results files (under the results folder) it writes."""
    limit: int
    """Seconds make bench gives it (at the quick settings if any)."""
    quick: tuple[str, ...] | None = None
    """make bench's shorter arguments (written to results/quick/); None: the command itself."""
    full_only: str = ""
    """Why make bench does not run it at all (only --full does); empty: it does."""

    @property
    def script(self) -> str:
        return self.command.split()[0]

    def args(self, full: bool) -> list[str]:
        if full or self.quick is None:
            return shlex.split(self.command)[1:]
        return list(self.quick)


BENCHES = [
    Bench("loader.py --only throughput --repeats 7 --steps 40", ("loader.json",), 300,
          quick=("--only", "throughput", "--repeats", "3", "--steps", "20")),
    Bench("loader.py --only large_files --repeats 3 --steps 20", ("loader.json",), 600,
          quick=("--only", "large_files", "--repeats", "1", "--steps", "10")),
    Bench("loader.py --only memory", ("loader.json",), 300),
    Bench("prefetch.py --repeats 7 --steps 15", ("prefetch.json",), 300,
          quick=("--repeats", "3", "--steps", "8")),
    Bench("uniform.py --rounds 7 --steps 24", ("uniform.json",), 300,
          quick=("--rounds", "3", "--steps", "6")),
    Bench("step_profile.py --steps 30 --attention --profile 8", ("step_profile.json",), 300,
          quick=("--steps", "10")),
    Bench("balance.py --planning-only", ("balance.json",), 300),
    Bench("planner_speed.py --baseline 37aacd2", ("planner_speed.json",), 300),
    Bench("pool_planner_speed.py --baseline 48c2bc9", ("pool_planner_speed.json",), 400),
    Bench("long_short_sp.py --world 2 --rounds 8", ("long_short_sp_w2.json",), 300,
          quick=("--world", "2", "--rounds", "4")),
    Bench("long_short_sp.py --world 4 --rounds 6", ("long_short_sp_w4.json",), 300,
          full_only="4 ranks x 6 rounds; --world 2 covers the code"),
    Bench("encoder_pool.py --world 2 --rounds 8", ("encoder_pool_w2.json",), 300,
          quick=("--world", "2", "--rounds", "4")),
    Bench("encoder_pool.py --world 4 --rounds 6", ("encoder_pool_w4.json",), 300,
          full_only="4 ranks x 6 rounds; --world 2 covers the code"),
    Bench("encoder_pool.py --world 4 --sp 2 --rounds 6", ("encoder_pool_w4_sp2.json",), 300,
          full_only="4 ranks x 6 rounds; --world 2 covers the code"),
    Bench("encoder_shards.py", ("encoder_shards.json",), 400, quick=("--rounds", "4")),
    Bench("encoder_shards.py --pp 4 --layers 4 --rounds 16", ("encoder_shards_pp4.json",), 400,
          full_only="4 ranks x 16 rounds (178 s quiet); the PP=2 run covers the code"),
    Bench("pipeline_bubbles.py --rounds 12 --warmup 2", ("pipeline_bubbles.json",), 900,
          quick=("--rounds", "2", "--warmup", "1", "--pp", "2")),
    Bench("pipeline.py", ("pipeline.json",), 600, quick=("--rounds", "4")),
    Bench("pipeline.py --zero 0", ("pipeline_zero0.json",), 600,
          full_only="a second full PP=2 run (206 s quiet); the PP=2 run covers the code"),
    Bench("pipeline.py --pp 4 --layers 4 --rounds 16 --warmup 2", ("pipeline_pp4_l4.json",), 900,
          full_only="4 ranks x 16 rounds (571 s quiet)"),
    Bench("pipeline.py --pp 4 --rounds 16 --warmup 2", ("pipeline_pp4.json",), 900,
          full_only="4 ranks x 16 rounds (302 s quiet)"),
    Bench("per_sequence_sp.py", ("per_sequence_sp.json",), 500, quick=("--rounds", "4")),
    Bench("sequence_parallel.py --only bytes", ("sequence_parallel.json",), 300),
    Bench("mp_reader.py --steps 6", ("mp_reader.json", "mp_reader.png"), 400,
          quick=("--steps", "3")),
    Bench("feed_rate.py", ("feed_rate.json",), 300, quick=("--repeats", "3")),
    Bench("sim_validation.py --rounds 5 --warmup 1 --batches 4 --comm-repeats 5",
          ("sim_validation.json", "sim_validation.png"), 600,
          quick=("--rounds", "3", "--warmup", "1", "--batches", "2", "--comm-repeats", "2")),
    Bench("sim_published.py", ("sim_published.json", "sim_published.png"), 300,
          quick=("--max-gpus", "2048")),
    Bench("sim_megascale_omni.py", ("sim_megascale_omni.json", "sim_megascale_omni.png"), 600,
          quick=("--setups", "vit1b_llm12b_64gpus", "vit2p4b_llm70b_128gpus", "--search-s", "30")),
    Bench("sim_bytescale.py", ("sim_bytescale.json", "sim_bytescale.png"), 900,
          quick=("--gpus", "1024")),
    Bench("plan_search_speed.py --baseline 6c0bd48", ("plan_search_4096.json",), 900,
          quick=("--baseline", "6c0bd48", "--gpus", "256")),
    Bench("tensor_parallel.py", ("tensor_parallel.json", "tensor_parallel.png"), 900,
          full_only="4 ranks, 626 s at load 33-41"),
    Bench("tensor_parallel.py --encoders", ("tensor_parallel_encoders.json",
                                            "tensor_parallel_encoders.png"), 900,
          full_only="4 ranks, 769 s at load 11-31"),
    Bench("expert_parallel.py", ("expert_parallel.json", "expert_parallel.png"), 900,
          full_only="4 ranks, 346 s at load 25-33"),
    Bench("composed_backbone.py --steps 4", ("composed_backbone.json", "composed_backbone.png"),
          900, full_only="4 ranks, 5 plans, 8-9 minutes at load 25-70"),
    Bench("ep_all_to_all.py", ("ep_all_to_all.json", "ep_all_to_all.png"), 600,
          full_only="2 ranks, about 90 s quiet"),
    Bench("context_parallel.py", ("context_parallel.json",), 600, quick=("--tokens", "512")),
    Bench("balance.py", ("balance.json", "balance.png"), 2400,
          full_only="the DP 8-4096 sweep, 1,411 s alone"),
    Bench("index.py", ("index.json",), 900, full_only="indexes a 1 GB file three times"),
    Bench("soak.py", ("soak.json",), 1800, full_only="500 steps with 5 restarts"),
]
NOT_RUN = {
    "gpu_mfu.py": "needs a GPU (benchmarks/gpu_check.py runs it on a GPU machine)",
    "pipeline_merged.json": "the final-code PP=2 run, written with --out and renamed: rerunning "
                            "`pipeline.py` writes pipeline.json (the row of the earlier code)",
    "pipeline_rounds16.json": "a 16-round run written with --out and renamed",
    "pipeline.py --rounds 16": "it writes pipeline.json; its row's pipeline_rounds16.json is "
                               "an earlier such run renamed",
    "pipeline.py --mixes image_heavy_9to1 text_heavy_1to9": "it writes pipeline.json; its "
                                                            "row's file is an earlier run renamed",
    "pipeline_sharded_encoders.json": "written with --out and renamed after the sharded "
                                      "encoder step; `pipeline.py --mixes` writes pipeline.json",
    "pipeline_pp4_l4_sharded_encoders.json": "the same at PP=4, written with --out and renamed",
}
"""Summary rows make bench does not reproduce, by script, command or results file, with why."""


def plan_runs(full: bool, only: list[str] | None) -> list[tuple[Bench, Path]]:
    """(bench, the folder it writes to) in order."""
    out = []
    for b in BENCHES:
        if only and b.script.removesuffix(".py") not in only:
            continue
        if b.full_only and not full:
            continue
        quick = not full and b.quick is not None
        out.append((b, QUICK_RESULTS if quick else RESULTS))
    return out


def last_seconds(b: Bench, where: Path) -> float | None:
    """The seconds its previous run took: from that folder's bench_run.json, else the
    `runtime_s` / `wall_s` its results file records."""
    label = _label(b, where == RESULTS)
    try:
        runs = json.loads((where / "bench_run.json").read_text())["runs"]
        return next(r["seconds"] for r in runs if r["command"] == label)
    except (OSError, ValueError, KeyError, StopIteration):
        pass
    try:
        data = json.loads((where / b.writes[0]).read_text())
    except (OSError, ValueError):
        return None
    if not str(data.get("command", b.command)).endswith(b.command):
        return None  # the file was written by another command (e.g. the full run)
    for key in ("runtime_s", "wall_s"):
        if isinstance(data.get(key), (int, float)):
            return float(data[key])
    return None


def _label(b: Bench, full: bool) -> str:
    return " ".join(["benchmarks/" + b.script, *b.args(full)])


def run(index: int, total: int, b: Bench, where: Path, dry_run: bool) -> dict:
    full = where == RESULTS
    label = _label(b, full)
    print(f"[{index}/{total}] {label} -> {where.relative_to(REPO)}/ ...", end=" ", flush=True)
    if dry_run:
        seen = last_seconds(b, where)
        at_full = last_seconds(b, RESULTS) if seen is None and not full else None
        print("(dry run; last " + (f"{seen:.0f} s)" if seen is not None else "unknown" + (
            f", {at_full:.0f} s at the row's settings)" if at_full is not None else ")")))
        return {"command": label, "rc": None, "seconds": seen if seen is not None else at_full}
    where.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_OMNI_BENCH_RESULTS=str(where))
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, f"benchmarks/{b.script}", *b.args(full)],
                              cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=b.limit)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, f"ran past its limit of {b.limit} s"
    seconds = time.perf_counter() - start
    print(f"{seconds:.0f} s" + ("" if rc == 0 else f"  FAILED (exit {rc}):\n{tail}"), flush=True)
    return {"command": label, "rc": rc, "seconds": seconds, "folder": str(where)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="every row's command at its own settings, into results/")
    parser.add_argument("--only", nargs="+", help="script names (without .py) to run")
    parser.add_argument("--dry-run", action="store_true", help="list the runs, run none")
    args = parser.parse_args(argv)
    plan = plan_runs(args.full, args.only)
    start = time.perf_counter()
    runs = [run(i, len(plan), b, where, args.dry_run) for i, (b, where) in enumerate(plan, 1)]
    failed = [r["command"] for r in runs if r["rc"] not in (0, None)]
    if args.dry_run:
        known = [r["seconds"] for r in runs if r["seconds"] is not None]
        print(f"{len(plan)} runs, {sum(known) / 60:.0f} min by the last runs of {len(known)} "
              "(a quick run never seen counted at its row's settings)")
        _list_skipped(args.full)
        return 0
    for where in {w for _, w in plan}:
        mine = [r for r in runs if r["folder"] == str(where)]
        (where / "bench_run.json").write_text(json.dumps(
            {"runs": mine, "wall_s": time.perf_counter() - start, "failed": failed}, indent=1)
            + "\n")
    print(f"benchmarks done in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {failed}" if failed else ""))
    summary = subprocess.run([sys.executable, "benchmarks/summary.py"], cwd=REPO)
    if any(w == QUICK_RESULTS for _, w in plan):
        print_quick_figures()
    return 1 if failed or summary.returncode else 0


def print_quick_figures() -> None:
    """Each summary row whose files the quick runs wrote: its figure, then the quick runs'
    (shorter settings: a smoke check of the same code, not the row's figure)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import summary  # noqa: E402  (benchmarks/summary.py, beside this script)
    _, changed, _ = summary.regenerate_all(REPO / "BENCHMARKS.md", QUICK_RESULTS)
    print(f"quick runs' figures ({QUICK_RESULTS.relative_to(REPO)}/) beside the rows' own:")
    for line in changed:
        print("  " + line)


def _list_skipped(full: bool) -> None:
    if not full:
        for b in BENCHES:
            if b.full_only:
                print(f"  only with --full: {b.command} ({b.full_only})")
    for what, why in NOT_RUN.items():
        print(f"  not run: {what} ({why})")


if __name__ == "__main__":
    sys.exit(main())
