"""Soak: 500 steps of the demo config on 2 ranks under `ds-omni supervise`, a rank killed about
every 100 steps, against the same 500 steps run without a fault.

    .venv/bin/python benchmarks/soak.py   # writes benchmarks/results/soak.json (~20 min, 2 cores)

The demo config (`examples/tiny_llava.json`, `ds_configs/zero2.json`: ZeRO-2, warm-up + cosine
LR, prefetch on) with `train.steps` 500, a checkpoint every 50 steps (the last 2 kept), sample ids
logged, and a 20 s peer timeout. Faults come from `tests/e2e/faulty.py` (the machinery of the
in-suite 60-step soak), one at a different point of the step each time: SIGKILL of rank 1 in a
forward (step 100), of rank 0 (the store's host) in a backward (200), of rank 1 in the middle of
a save (after step 300, before its manifest: the job falls back to step 250), of rank 0 in the
optimizer step (400); and a SIGSTOP of rank 1 (a frozen node, only the watchdog can end that job)
in the loader at step 450. A fault of a forward, backward or optimizer step "at step N" fires in
that step's training, right after the checkpoint of step N; one in the loader fires while the
loader makes step N's batch, which with prefetch on (the demo's default) happens on the prefetch
thread while step N-1 trains. So the job falls back to 100, 200, 250, 400 and 400. (Results
written before tests/e2e/faulty.py counted steps this way fired a step early and fell back to 50,
150, 250, 350 and 400.) The uninterrupted run is a plain launch of the same config.

Compared: every step's sample ids (none lost, none repeated), the sample count, every step's loss
and the final loss; also the restarts, their causes and the wall time of both runs.
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
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
STEPS, SAVE_EVERY, PEER_TIMEOUT = 500, 50, 20
FAULTS = ("kill:1:forward:100,kill:0:backward:200,kill:1:save:300,kill:0:optimizer:400,"
          "stop:1:loader:450")


def write_configs(root: Path, name: str) -> tuple[str, str, str]:
    """(config, DeepSpeed config, output dir): the demo's, with the soak's train settings."""
    cfg = json.loads((REPO / "examples" / "tiny_llava.json").read_text())
    out = root / name
    cfg["train"].update(steps=STEPS, save_every=SAVE_EVERY, keep_checkpoints=2, log_samples=True,
                        peer_timeout_s=PEER_TIMEOUT, export_hf=False, output_dir=str(out))
    path = root / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path), str(REPO / "ds_configs" / "zero2.json"), str(out)


def launch(root: Path, name: str, supervised: bool) -> tuple[float, str]:
    """Run one job through the deepspeed launcher; (wall seconds, output dir)."""
    from tests.e2e.launch import BIN, launcher_cmd, run
    cfg, ds, out = write_configs(root, name)
    cmd = launcher_cmd("deepspeed", 2)[:-1] + ["tests.e2e.faulty", "train", "--config", cfg,
                                               "--deepspeed", ds]
    env = {"DS_OMNI_TEST_FAULT_DIR": str(root), "DS_OMNI_DIST_TIMEOUT": "300"}
    if supervised:
        cmd = [str(BIN / "ds-omni"), "supervise", "--max-restarts", "8", "--backoff", "0", "--",
               *cmd]
        env["DS_OMNI_TEST_FAULTS"] = FAULTS
    t0 = time.monotonic()
    res = run(cmd, timeout=4 * 3600, env=env)
    seconds = time.monotonic() - t0
    if res.returncode:
        raise SystemExit(f"{name} failed ({res.returncode}):\n{res.stdout[-5000:]}")
    return seconds, out


def compare(plain: str, soak: str) -> dict:
    from ds_omni.train.metrics import read_metrics
    a, b = read_metrics(plain), read_metrics(soak)
    keys_a = [k for r in a for k in r["sample_keys"]]
    keys_b = [k for r in b for k in r["sample_keys"]]
    diffs = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)]
    return {"steps": [len(a), len(b)], "samples": [len(keys_a), len(keys_b)],
            "distinct_samples": [len(set(keys_a)), len(set(keys_b))],
            "same_sample_ids_every_step": [r["sample_keys"] for r in a] == [
                r["sample_keys"] for r in b],
            "final_loss": [a[-1]["loss"], b[-1]["loss"]],
            "max_rel_loss_difference": max(diffs), "identical_losses": diffs == [0.0] * len(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "soak.json"))
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="ds_omni_soak_"))
    root.mkdir(parents=True, exist_ok=True)
    soak_s, soak = launch(root, "soak", supervised=True)
    plain_s, plain = launch(root, "plain", supervised=False)
    restarts = [json.loads(x) for x in (Path(soak) / "restarts.jsonl").read_text().splitlines()]
    result = {"steps": STEPS, "ranks": 2, "faults": FAULTS, "save_every": SAVE_EVERY,
              "peer_timeout_s": PEER_TIMEOUT, "wall_s": {"soak": soak_s, "plain": plain_s},
              "restarts": [{"resume_from": r["resume_from"], "cause": r["cause"]}
                           for r in restarts], **compare(plain, soak)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
