"""`ds-omni plan --search` speed against an earlier commit's search, on identical inputs.

The 7B-class VLM of `tests/unit/sim/test_sim_search.py` (Llama-2-7B's LLM, a CLIP-L/14-336-like
tower, 8k-token samples, 8,192 samples a step) searched on H100 clusters of 256, 1,024 and 4,096
GPUs, as `ds-omni plan --search --json` searches it (`sim.from_config.search_config`). Each
search runs in a child process: the working tree's, and the tree of git revision `--baseline`
(extracted into a temporary folder). Whether their answers (the ranked plans and figures, the
baselines, every dropped plan with its reason, the counts; all but the search's own seconds) are
identical is recorded (`identical`): they differ where the simulator changed since. Timed: CPU
seconds of the child's `search_config` call (process_time; the machine is shared, so CPU, not
wall).

Writes benchmarks/results/plan_search_4096.json (--gpus: other sizes; --out: another name).
Run: .venv/bin/python benchmarks/plan_search_speed.py --baseline 6c0bd48   (about 5 minutes)
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS")
               or Path(__file__).resolve().parent / "results")


def vlm7b_config() -> dict:
    """examples/tiny_llava.json with a 7B-class LLM (Llama-2-7B's sizes, 8 KV heads) and a
    CLIP-L/14-336-like vision tower, 8k-token samples, 8,192 samples a step."""
    cfg = json.loads((ROOT / "examples/tiny_llava.json").read_text())
    cfg["model"]["vision"]["config"].update(hidden_size=1024, intermediate_size=4096,
                                            num_hidden_layers=24, num_attention_heads=16,
                                            image_size=336, patch_size=14)
    cfg["model"]["llm"]["config"].update(hidden_size=4096, intermediate_size=11008,
                                         num_hidden_layers=32, num_attention_heads=32,
                                         num_key_value_heads=8, max_position_embeddings=8192)
    cfg["data"]["max_seq_len"] = 8192
    cfg["train"].update(global_batch_size=8192, micro_batch_size=1)
    return cfg


def content(out: dict) -> dict:
    """The search's answer without its own seconds (what must not change)."""
    return {k: v for k, v in out.items() if k != "seconds"}


def digest(out: dict) -> str:
    """sha256 of the answer's JSON (sorted keys; floats as Python prints them: exact)."""
    return hashlib.sha256(json.dumps(content(out), sort_keys=True).encode()).hexdigest()


def child(root: str, config: str, gpus: int, out: str) -> None:
    """In a child process: the search of `root`'s ds_omni, its answer and CPU seconds to `out`."""
    sys.path.insert(0, root)
    from ds_omni.config import load_config
    from ds_omni.sim.from_config import search_config
    from ds_omni.train.ds_config import load_ds_json
    assert Path(sys.modules["ds_omni"].__file__).resolve().is_relative_to(Path(root).resolve())
    cfg = load_config(config, [])
    ds_json = load_ds_json(str(ROOT / "ds_configs/zero2.json"))
    cpu = time.process_time()
    result = search_config(cfg, ds_json, gpus=gpus, gpus_per_node=8, gpu="h100")
    cpu = time.process_time() - cpu
    Path(out).write_text(json.dumps({"cpu_s": cpu, "result": result}))


def run(root: Path, config: Path, gpus: int, tmp: Path) -> dict:
    out = tmp / f"out_{gpus}_{abs(hash(str(root)))}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    subprocess.run([sys.executable, __file__, "--child", str(root), str(config), str(gpus),
                    str(out)], check=True, env=env, cwd=str(tmp))
    return json.loads(out.read_text())


def extract(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` (its ds_omni package) under `into`."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "ds_omni"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="6c0bd48", help="git revision of the earlier search")
    ap.add_argument("--gpus", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--out", default="plan_search_4096.json")
    args = ap.parse_args(argv)
    cases = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = extract(args.baseline, tmp / "baseline")
        config = tmp / "vlm7b.json"
        config.write_text(json.dumps(vlm7b_config()))
        for gpus in args.gpus:
            got = {}
            for side, root in (("baseline", base), ("current", ROOT)):
                got[side] = run(root, config, gpus, tmp)
                print(f"{gpus} GPUs, {side}: {got[side]['cpu_s']:.1f} s of CPU", flush=True)
            old, new = (content(got[k]["result"]) for k in ("baseline", "current"))
            if old != new:
                print(f"{gpus} GPUs: the answers differ (the simulator changed since "
                      f"{args.baseline})", flush=True)
            counts = new["counts"]
            cases[f"{gpus}gpus"] = {
                "gpus": gpus, "counts": counts, "identical": old == new,
                "digest": digest(got["current"]["result"]),
                "best_step_s": new["top"][0]["step_time"] if new["top"] else None,
                "baseline_cpu_s": got["baseline"]["cpu_s"],
                "current_cpu_s": got["current"]["cpu_s"],
                "speedup_cpu": got["baseline"]["cpu_s"] / got["current"]["cpu_s"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / args.out
    path.write_text(json.dumps({
        "command": "benchmarks/plan_search_speed.py " + " ".join(argv or sys.argv[1:]),
        "baseline": args.baseline, "load_1min": os.getloadavg()[0],
        "metric": "CPU seconds of search_config (ds-omni plan --search), each side in its own "
                  "process; whether the answers (all but the search's seconds) are identical: `identical`",
        "cases": cases}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:4], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main())
