"""The demo (`launch/demo.sh`: the deepspeed launcher, 2 ranks, then `ds-omni data eval-demo`) for
several seeds: does the model learn to see every time, and how long does it take?

    .venv/bin/python benchmarks/demo_seeds.py                    # seeds 0 1 2 (~3 min each, 2 cores)
    .venv/bin/python benchmarks/demo_seeds.py --parallel --baseline-rev 162f97a
        # all at once, with the demo config of that revision (before issue 27's change) as well

Each seed sets the model's initialisation (`model.seed`), the sample order (`data.seed`) and the
training randomness (`train.seed`) together; the data itself and the held-out images that
eval-demo captions are the same for every seed. Writes benchmarks/results/demo_seeds.json: per
seed the caption accuracy of each attribute, the final training and eval loss, the wall time
of the whole demo (training, export, captioning) and the CPU seconds it used, then min / median /
max over the seeds and whether every seed reached the targets below. With --baseline-rev, the
demo config of that git revision (`examples/tiny_llava.json` there) runs once, in the same way
and the same conditions, and the ratios of the median wall time and CPU seconds to its own are
recorded: on a shared machine the seconds vary with the load, the ratios much less (under
--parallel the shorter run ends first and leaves the cores to the others, so the CPU ratio is
the fairer one there).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
# the bar (issue 27): caption accuracy of each attribute on eval-demo's 64 held-out images
TARGETS = {"colour": 0.9, "place": 0.85, "size": 0.85, "shape": 0.8}
ATTRIBUTES = (*TARGETS, "background", "exact")


def start_demo(out: Path, seed: int | None, config: Path | None = None) -> tuple:
    """Start one `launch/demo.sh` (seed None: the config's own seeds); (process, start time)."""
    env = {**os.environ, "VENV": sys.prefix, "OUT": str(out), "PYTHONPATH": str(REPO),
           "DS_OMNI_DIST_TIMEOUT": "120"}
    if config is not None:
        env["CONFIG"] = str(config)
    sets = [] if seed is None else [a for f in ("model.seed", "data.seed", "train.seed")
                                    for a in ("--set", f"{f}={seed}")]
    out.mkdir(parents=True, exist_ok=True)
    # a file, not a pipe: a pipe nobody reads while another demo is awaited fills up, and the
    # blocked rank's peer ends the job (the watchdog sees it hang in the progress bar's write)
    log = (out / "demo.log").open("w")
    proc = subprocess.Popen(["bash", str(REPO / "launch" / "demo.sh"), *sets], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, time.time()


def wait_cpu_seconds(proc: subprocess.Popen, deadline: float) -> float | None:
    """Wait for `proc`; the CPU seconds (user + system) it and the processes it waited for used
    (bash -> the deepspeed launcher -> its ranks, then eval-demo), or None past `deadline` (killed).

    Unlike the wall time, this hardly depends on how many other processes share the cores.
    """
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        time.sleep(0.5)


def finish_demo(out: Path, seed: int | None, started: tuple, timeout: float = 1800) -> dict:
    """Wait for a started demo; its report's figures and its wall time. Fails with its output."""
    proc, start = started
    cpu = wait_cpu_seconds(proc, start + timeout)
    if cpu is None:
        output = (out / "demo.log").read_text()
        raise RuntimeError(f"launch/demo.sh (seed {seed}) did not end in {timeout}s:\n"
                           f"{output[-4000:]}")
    # when its report was written, not when it was awaited (under --parallel the runs end apart)
    wall = (out / "report.json").stat().st_mtime - start if (out / "report.json").exists() else 0.0
    output = (out / "demo.log").read_text()
    if proc.returncode:
        raise RuntimeError(f"launch/demo.sh (seed {seed}) failed:\n{output[-4000:]}")
    report = json.loads((out / "report.json").read_text())
    scores = report["caption_eval"]
    return {"seed": seed, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "accuracy": {a: scores[f"{a}_accuracy"] for a in ATTRIBUTES},
            "last_loss_mean10pct": report["last_loss_mean10pct"],
            "last_eval_loss": report.get("last_eval_loss")}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarise(runs: list[dict]) -> dict:
    acc = {a: spread([r["accuracy"][a] for r in runs]) for a in ATTRIBUTES}
    reached = {str(r["seed"]): all(r["accuracy"][a] >= t for a, t in TARGETS.items()) for r in runs}
    return {"accuracy": acc, "wall_s": spread([r["wall_s"] for r in runs]),
            "cpu_s": spread([r["cpu_s"] for r in runs]),
            "last_loss_mean10pct": spread([r["last_loss_mean10pct"] for r in runs]),
            "last_eval_loss": spread([r["last_eval_loss"] for r in runs
                                      if r["last_eval_loss"] is not None] or [float("nan")]),
            "targets": TARGETS, "reached": reached, "all_reached": all(reached.values())}


def baseline_config(rev: str, work: Path) -> Path:
    """`examples/tiny_llava.json` as git revision `rev` had it."""
    text = subprocess.run(["git", "show", f"{rev}:examples/tiny_llava.json"], cwd=REPO, check=True,
                          stdout=subprocess.PIPE, text=True).stdout
    path = work / "baseline.json"
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--baseline-rev", help="also run this git revision's demo config, for the ratio")
    ap.add_argument("--parallel", action="store_true",
                    help="run the demos at once (on a shared machine: every run under one load)")
    ap.add_argument("--results", default=str(RESULTS / "demo_seeds.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="demo_seeds_") as tmp:
        work = Path(tmp)
        jobs = [(work / f"seed{seed}", seed, None) for seed in args.seeds]
        if args.baseline_rev:
            jobs.append((work / "baseline", None, baseline_config(args.baseline_rev, work)))
        done = []
        if args.parallel:  # all at once: each run sees the same load
            started = [start_demo(*job) for job in jobs]
            done = [finish_demo(out, seed, s) for (out, seed, _), s in zip(jobs, started)]
        else:
            done = [finish_demo(out, seed, start_demo(out, seed, cfg)) for out, seed, cfg in jobs]
        for run in done:
            print(json.dumps(run), flush=True)
        runs = done[:len(args.seeds)]
        result = {"command": "python benchmarks/demo_seeds.py " + " ".join(argv or sys.argv[1:]),
                  "parallel": args.parallel, "runs": runs, **summarise(runs)}
        if args.baseline_rev:
            base = done[-1]
            commit = subprocess.run(["git", "rev-parse", "--short", args.baseline_rev], cwd=REPO,
                                    check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
            result["baseline"] = {"rev": args.baseline_rev, "commit": commit, **base}
            result["wall_ratio_median_over_baseline"] = result["wall_s"]["median"] / base["wall_s"]
            result["cpu_ratio_median_over_baseline"] = result["cpu_s"]["median"] / base["cpu_s"]
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("accuracy", "wall_s", "all_reached")}, indent=1))
    return 0 if result["all_reached"] else 1


if __name__ == "__main__":
    sys.exit(main())
