"""Start-up time of 2 ranks on a ~1 GB LLaVA JSON array: the shared row index against main's
per-rank indexing, same run.

A LLaVA-Instruct-style JSON array (`llava_v1_5_mix665k.json` is 1.03 GB, 665k rows; the rows
here are made from a seed: ids, image paths, 1-6 turns of question and answer, a quarter of them
text-only) is written to a temporary folder. Each launch starts 2 rank processes at once
(RANK=0/1, WORLD_SIZE=2); a rank does what a training rank does before its first step reads
data: the start-up check (`preflight`'s `startup_check`), then the loader's source for its rank
(`Source` + `SourceCursor`, the loader's chunk order) up to its first row. Timed from the
launch to each rank's first row (imports included); a launch's start-up is its slower rank.

Launches, in this order, on the same file:
  - `baseline`: the package at `--baseline` (a git revision, default the merge base with main,
    extracted with `git archive`): each rank indexes the file twice (check, loader);
  - `first`: the working tree, an empty index folder: one rank builds the index, the other
    waits for it and reads it;
  - `second`: the working tree again: both ranks read the index file.
The file stays in the page cache throughout (written just before; 23 GiB of RAM): on a network
file system the baseline's four full reads would cost more, the index's none.

Writes benchmarks/results/index.json. The data file is deleted at the end.
Run: .venv/bin/python benchmarks/index.py            (about 6 minutes on a quiet 2-core machine)
     .venv/bin/python benchmarks/index.py --gb 0.05   (a quick try)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
WORDS = ("the a of man dog bus street what is in picture image colour left right people sitting "
         "table two three red blue wearing holding standing near large small white black next "
         "to on with describe detail why how many there are background scene").split()


# ---------------------------------------------------------------------------- the data file
def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def _row(i: int, rng: random.Random) -> dict:
    """One LLaVA-Instruct row (mean about 1.5 KB, as in llava_v1_5_mix665k.json)."""
    turns = []
    for t in range(rng.randint(1, 6)):
        question = _sentence(rng, 5, 20) + "?"
        turns += [{"from": "human", "value": ("<image>\n" if t == 0 and i % 4 else "") + question},
                  {"from": "gpt", "value": " ".join(_sentence(rng, 6, 30)
                                                    for _ in range(rng.randint(1, 5)))}]
    row = {"id": f"{i:012d}", "conversations": turns}
    if i % 4:
        row["image"] = f"images/{i % 16}.png"
    return row


def write_llava(path: Path, gigabytes: float, seed: int, distinct: int = 4096) -> int:
    """Rows until the file holds `gigabytes` (conversations drawn from `distinct` made ones, ids
    and image paths per row); 16 small PNGs beside it (the rows' images)."""
    from PIL import Image
    (path.parent / "images").mkdir(parents=True, exist_ok=True)
    for k in range(16):
        Image.new("RGB", (8, 8), (k * 15, 40, 200)).save(path.parent / "images" / f"{k}.png")
    rng = random.Random(seed)
    pool = [_row(i, rng)["conversations"] for i in range(distinct)]
    n, size = 0, 0
    with open(path, "w") as f:
        f.write("[\n")
        while size < gigabytes * 1e9:
            row = {"id": f"{n:012d}", "conversations": pool[n % distinct]}
            if n % 4:
                row["image"] = f"images/{n % 16}.png"
            else:
                row["conversations"] = [{**pool[n % distinct][0], "value": pool[n % distinct][0][
                    "value"].removeprefix("<image>\n")}] + pool[n % distinct][1:]
            text = ("" if n == 0 else ",\n") + json.dumps(row)
            f.write(text)
            size += len(text)
            n += 1
        f.write("\n]\n")
    return n


# ---------------------------------------------------------------------------- one rank
def rank_main(cfg_path: str, launched_at: float) -> None:
    """A rank: the start-up check, then its loader source's first row; prints its timings."""
    t_import = time.time()
    from ds_omni.config.loader import load_config
    from ds_omni.data.check import startup_check
    from ds_omni.data.sources import Source
    from ds_omni.data.stream import SourceCursor
    cfg = load_config(cfg_path)
    t_check = time.time()
    startup_check(cfg)
    t_source = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    source = Source(cfg.data.sources[0], chunk_rows=cfg.data.chunk_rows)
    loc, _ = SourceCursor(source, 0, rank, world, cfg.data.seed).next()
    t_row = time.time()
    print(json.dumps({"rank": rank, "rows": len(source), "first_row": str(loc),
                      "import_s": t_check - t_import, "check_s": t_source - t_check,
                      "loader_first_row_s": t_row - t_source,
                      "to_first_row_s": t_row - launched_at}))


def launch(cfg_path: Path, pythonpath: str, env: dict, world: int = 2) -> dict:
    """`world` ranks at once; their timings, and the slower rank's start-up."""
    launched_at, load = time.time(), os.getloadavg()[0]
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--rank", str(cfg_path), str(launched_at)],
        env={**os.environ, **env, "PYTHONPATH": pythonpath, "RANK": str(r),
             "WORLD_SIZE": str(world)}, stdout=subprocess.PIPE, text=True) for r in range(world)]
    ranks = []
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        if p.returncode:
            raise SystemExit(f"a rank failed (exit {p.returncode})")
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    return {"ranks": ranks, "startup_s": max(r["to_first_row_s"] for r in ranks),
            "data_s": max(r["check_s"] + r["loader_first_row_s"] for r in ranks),
            "wall_s": time.time() - launched_at,
            "load_1min": {"before": load, "after": os.getloadavg()[0]}}  # other jobs' share


def extract(rev: str, into: Path) -> str:
    """The package `ds_omni` as of git revision `rev`, under `into` (a PYTHONPATH entry)."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "ds_omni"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        tf.extractall(into, filter="data")
    return str(into)


def _config(tmp: Path, data: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures import tiny_config_dict
    cfg = tiny_config_dict(str(tmp / "out"))
    cfg["data"] = {"sources": [{"name": "llava", "path": str(data)}], "max_seq_len": 2048}
    path = tmp / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


def _merge_base() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], check=True,
                          capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="size of the JSON array file")
    ap.add_argument("--baseline", default=None, help="git revision of main's behaviour")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", default=None, help="folder for the data file (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "index.json"))
    args = ap.parse_args()
    baseline = args.baseline or _merge_base()
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="ds_omni_index_") as d:
        tmp = Path(d)
        data = tmp / "llava" / "llava_v1_5_like.json"
        t = time.time()
        rows = write_llava(data, args.gb, args.seed)
        print(f"wrote {data.stat().st_size / 1e9:.2f} GB, {rows} rows in {time.time() - t:.0f} s")
        cfg = _config(tmp, data)
        env = {"DS_OMNI_INDEX_DIR": str(tmp / "index"), "DS_OMNI_CACHE": os.environ.get(
            "DS_OMNI_CACHE", str(ROOT / ".cache" / "ds_omni")), "HF_HUB_OFFLINE": "1"}
        launches = {"baseline": launch(cfg, extract(baseline, tmp / "baseline"), env)}
        print(f"baseline: {launches['baseline']['startup_s']:.1f} s")
        for name in ("first", "second"):
            launches[name] = launch(cfg, str(ROOT), env)
            print(f"{name}: {launches[name]['startup_s']:.1f} s")
        index_files = list((tmp / "index").glob("*.json"))
        index_bytes = sum(f.stat().st_size for f in index_files)
        size = data.stat().st_size
    report = _report(args, baseline, rows, size, index_bytes, len(index_files), launches)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "launches"}, indent=1))


def _report(args, baseline: str, rows: int, size: int, index_bytes: int, index_files: int,
            launches: dict) -> dict:
    names = ("baseline", "first", "second")
    out = {"command": "python benchmarks/index.py" + (f" --gb {args.gb}" if args.gb != 1 else ""),
           "baseline": baseline, "data_bytes": size, "rows": rows, "world": 2,
           "index_files": index_files, "index_bytes": index_bytes}
    for what in ("startup_s", "data_s"):  # to the first row; its data part (check + loader)
        b, f, s = (launches[k][what] for k in names)
        out[what] = {"baseline": b, "first": f, "second": s, "baseline_over_first": b / f,
                     "baseline_over_second": b / s, "first_over_second": f / s}
    return out | {"launches": launches}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], float(sys.argv[3]))
    else:
        main()
