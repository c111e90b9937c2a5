"""Loader benchmarks: throughput against HF interleave_datasets + a torch DataLoader, the same on
files of growing size (up to 4 x 250,000 rows), and resident memory with 1 to 300 sources.

    .venv/bin/python benchmarks/loader.py            # all; writes benchmarks/results/loader.json
    .venv/bin/python benchmarks/loader.py --only large_files

Throughput: the same local parquet sources (conversations with images), the same per-sample work
(image decode and preprocessing through the model's HF image processor, tokenisation, placeholder
expansion, packing into micro-batches) on both sides; samples/s over a fixed number of samples,
each run in a fresh process, repeats interleaved; the figure is the median of per-repeat ratios. The baseline streams every source with
`datasets.load_dataset(..., streaming=True)`, mixes with `interleave_datasets` and batches with a
`torch.utils.data.DataLoader`; ds_omni is one data-parallel rank of `OmniLoader` ("fixed" mode).

Large files: the same comparison on 4 sources of one parquet file each, at 2,000, 20,000 and
250,000 rows per file (1M rows in all at the top; 64x64 JPEGs, row groups of 100 rows as
`datasets` writes image data). ds_omni reads its chunks in a seeded random order, so most lie deep
inside a file; throughput must not fall as files grow (reading a chunk must not cost the rows
before it), and stay >= 0.9x the baseline at every size.

Memory: resident set size (the process and any DataLoader workers) after reading 5 global batches,
minus that of the same process before building anything, for S sources of one small parquet
file each; and the size of the JSON data state. Each point runs in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
BATCH, MICRO = 16, 4
# rows per parquet row group of the large files: what `datasets`' 100 MB cap gives for images of
# ~100 KB (these 64x64 JPEGs are ~1 KB: its cap would put 84,000 of them in one group)
LARGE_ROW_GROUP = 1000


# ----------------------------------------------------------------------------------- data
def make_sources(root: Path, n_sources: int, rows: int, image_size: int) -> list[dict]:
    """n_sources parquet files of `rows` shape pictures (image_size px) with conversations."""
    import datasets
    from PIL import Image
    import io
    from ds_omni.data.demo import shapes_rows
    root.mkdir(parents=True, exist_ok=True)
    specs = []
    base = shapes_rows(rows, seed=0)
    if image_size != 32:  # larger pictures: realistic decode and resize work
        for r in base:
            im = Image.open(io.BytesIO(r["image"]["bytes"])).resize((image_size, image_size))
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=90)
            r["image"] = {"bytes": buf.getvalue(), "path": None}
    features = datasets.Features({
        "id": datasets.Value("string"), "image": datasets.Image(),
        "conversations": datasets.List({"from": datasets.Value("string"),
                                        "value": datasets.Value("string")})})
    table = datasets.Dataset.from_list(base, features=features)
    for s in range(n_sources):
        path = root / f"src{s:03d}.parquet"
        if not path.exists():
            table.to_parquet(str(path))
        specs.append({"name": f"src{s:03d}", "path": str(path), "weight": 1.0 + s % 3})
    return specs


def make_large_sources(root: Path, n_sources: int, rows: int, image_size: int,
                       row_group: int | None = LARGE_ROW_GROUP) -> list[dict]:
    """n_sources parquet files of `rows` rows each (2,000 pictures repeated, ids unique), in row
    groups of `row_group` rows (None: `datasets`' own, up to 100 MB), written once and reused."""
    specs = [{"name": f"src{s:03d}", "path": str(root / f"src{s:03d}.parquet"),
              "weight": 1.0 + s % 3} for s in range(n_sources)]
    if all(Path(s["path"]).exists() for s in specs):
        return specs
    import datasets
    import pyarrow as pa
    base = make_sources(root / "base", 1, 2000, image_size)[0]["path"]
    table = datasets.Dataset.from_parquet(base).data.table
    whole = pa.concat_tables([table] * -(-rows // len(table))).slice(0, rows)
    for s, spec in enumerate(specs):
        ids = pa.array([f"s{s}-{i}" for i in range(rows)])
        datasets.Dataset(whole.set_column(whole.schema.get_field_index("id"), "id", ids)) \
            .to_parquet(spec["path"], batch_size=row_group)
    return specs


def model_and_config(sources: list[dict]):
    from ds_omni.config import OmniConfig, from_dict
    from ds_omni.model.build import build_model
    from tests.fixtures import tiny_config_dict
    d = tiny_config_dict("/tmp/unused", global_batch_size=BATCH, micro_batch_size=MICRO)
    d["data"]["sources"] = sources
    d["data"]["chunk_rows"] = 256
    cfg = from_dict(OmniConfig, d)
    return cfg, build_model(cfg.model)


# ------------------------------------------------------------------------------ the loaders
def run_ds_omni(cfg, built, steps: int):
    from ds_omni.data.build import build_loader
    loader = build_loader(cfg, built, num_micro=BATCH // MICRO)
    n = 0
    for _ in range(steps):
        batch = loader.next_step()
        assert batch.error is None, batch.error
        n += len(batch.keys)
    return n, loader


def run_baseline(cfg, built, steps: int, workers: int):
    """interleave_datasets over streaming sources + DataLoader doing the same per-sample work."""
    import datasets
    import torch
    from ds_omni.data.build import sample_processors
    from ds_omni.data.packing import pack
    from ds_omni.data.sources import Locator, Source
    procs = sample_processors(cfg, built)
    streams = [datasets.load_dataset("parquet", data_files=[s.path], split="train",
                                     streaming=True).decode(False) for s in cfg.data.sources]
    weights = [s.weight for s in cfg.data.sources]
    mixed = datasets.interleave_datasets(streams, probabilities=[w / sum(weights) for w in weights],
                                         seed=0, stopping_strategy="all_exhausted")
    schema_source = Source(cfg.data.sources[0])

    class Samples(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()  # workers split the stream by position
            me, every = (info.id, info.num_workers) if info else (0, 1)
            for i, row in enumerate(mixed):
                if i % every != me:
                    continue
                text, media, sid = schema_source.parts(row, Locator("s", 0, i))
                yield procs[cfg.data.sources[0].name](text=text, media=media, sample_id=sid,
                                                      source="s")

    loader = torch.utils.data.DataLoader(
        Samples(), batch_size=MICRO, num_workers=workers,
        collate_fn=lambda samples: pack(samples, built.item_processors))
    n, it = 0, iter(loader)
    for _ in range(steps * (BATCH // MICRO)):
        n += len(next(it).sample_ids)
    return n, it  # the iterator owns the worker processes: keep it alive to measure them


# ------------------------------------------------------------------------------- measuring
def rss_mb(pid: int) -> float:
    """Resident memory of `pid` and all its descendants, in MB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines()
                              if line.startswith("VmRSS")))
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return total / 1024


def quiet_datasets() -> None:
    """No 5 s sleep when a stream is closed (datasets 5.x), on both sides of the comparison."""
    import datasets
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    datasets.disable_progress_bars()


def child_throughput(kind: str, workers: int, steps: int, root: str, rows: int = 0) -> dict:
    quiet_datasets()
    sources = make_large_sources(Path(root), 4, rows, 64) if rows else \
        make_sources(Path(root), 4, 2000, 128)
    cfg, built = model_and_config(sources)
    run = (lambda s: run_ds_omni(cfg, built, s)) if kind == "ds_omni" else \
        (lambda s: run_baseline(cfg, built, s, workers))
    run(2)  # warm up: file opening, first streams, worker start
    t0, c0 = time.perf_counter(), time.process_time()
    n, loader = run(steps)
    out = {"samples": n, "seconds": time.perf_counter() - t0,
           "cpu_seconds": time.process_time() - c0}
    if kind == "ds_omni":
        loader.close()
    return out


def child_memory(kind: str, n_sources: int, *rest) -> dict:
    workers, root = (int(rest[0]), rest[1]) if len(rest) == 2 else (0, rest[0])
    import gc
    quiet_datasets()
    sources = make_sources(Path(root), n_sources, 400, 32)
    cfg, built = model_and_config(sources)
    gc.collect()
    before = rss_mb(os.getpid())
    n, loader = run_ds_omni(cfg, built, 5) if kind == "ds_omni" else run_baseline(
        cfg, built, 5, workers)
    gc.collect()
    after = rss_mb(os.getpid())
    state = loader.state_dict() if kind == "ds_omni" else None
    return {"rss_mb": after - before, "samples": n,
            "state_bytes": len(json.dumps(state)) if state else None}


def in_subprocess(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines = out.stdout.strip().splitlines()
    if out.returncode and not (lines and lines[-1].startswith("{")):
        raise RuntimeError(out.stderr[-3000:])
    if out.returncode:  # measured, then failed at exit (a library's thread torn down)
        print(f"note: {args[:2]} exited with {out.returncode} after its measurement: "
              f"{out.stderr.strip().splitlines()[-1:]}", flush=True)
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------ main
def throughput(root: str, repeats: int, steps: int) -> dict:
    """Repeats interleave the three loaders, so a slow spell of the machine hits all of them;
    the figure is the median over repeats of ds_omni's rate / the baseline's rate."""
    kinds = (("ds_omni", 0), ("baseline", 0), ("baseline", 2))
    rates: dict[str, list[float]] = {f"{k}_workers{w}": [] for k, w in kinds}
    for _ in range(repeats):
        for kind, workers in kinds:
            r = in_subprocess(["throughput", kind, str(workers), str(steps), root])
            rates[f"{kind}_workers{workers}"].append(r["samples"] / r["seconds"])
        print({k: round(v[-1]) for k, v in rates.items()}, flush=True)
    ours = rates["ds_omni_workers0"]
    out = {k: {"samples_per_s": v, "median": statistics.median(v)} for k, v in rates.items()}
    for name in ("baseline_workers0", "baseline_workers2"):
        out[name]["ds_omni_over_this"] = statistics.median(
            a / b for a, b in zip(ours, rates[name]))
    return out


LARGE_ROWS = (2_000, 20_000, 250_000)


def chunk_reads(root: str, chunks: int = 6) -> dict:
    """CPU microseconds per row of reading `chunks` chunks at seeded random places of one file of
    each size: `Source.stream` against HF streaming's `skip(start).take(C)` (how chunks were
    read before), which reads every row before the chunk; "big_groups": the largest size in
    `datasets`' own 100 MB row groups (84,000 of these rows), where a chunk decodes its row group
    up to its end."""
    import datasets
    import numpy as np
    from ds_omni.config import SourceConfig
    from ds_omni.data.sources import Source
    quiet_datasets()
    out = {}
    for rows in [*LARGE_ROWS, "big_groups"]:
        path = str(Path(root) / str(rows) / "src000.parquet")
        source = Source(SourceConfig(name="s", path=path), chunk_rows=256)
        picks = np.random.default_rng(0).choice(len(source.chunks), chunks, replace=False)
        hf = datasets.load_dataset("parquet", data_files=[path], split="train",
                                   streaming=True).decode(False)
        times = {"ds_omni": 0.0, "hf_skip": 0.0}
        n = 0
        for c in picks:
            chunk = source.chunks[c]
            t0 = time.process_time()
            n += sum(1 for _ in source.stream(chunk, chunk.start))
            t1 = time.process_time()
            sum(1 for _ in hf.skip(chunk.start).take(chunk.stop - chunk.start))
            times["ds_omni"] += t1 - t0
            times["hf_skip"] += time.process_time() - t1
        out[str(rows)] = {f"{k}_us_per_row": 1e6 * v / n for k, v in times.items()}
        print(rows, out[str(rows)], flush=True)
    return out


def large_files(root: str, repeats: int, steps: int) -> dict:
    """ds_omni and the 0-worker baseline at each file size, repeats interleaved; the figures are
    medians of per-repeat ratios (against the baseline, and against ds_omni's smallest size).
    Rates are samples per CPU second of the process (both sides read in one process): on a
    shared machine, wall time measures the neighbours as much as the loader."""
    for rows in LARGE_ROWS:  # written before any timing
        make_large_sources(Path(root) / str(rows), 4, rows, 64)
    make_large_sources(Path(root) / "big_groups", 1, LARGE_ROWS[-1], 64, row_group=None)
    rates = {(k, r): [] for r in LARGE_ROWS for k in ("ds_omni", "baseline")}
    for _ in range(repeats):
        for rows in LARGE_ROWS:
            for kind in ("ds_omni", "baseline"):
                r = in_subprocess(["throughput", kind, "0", str(steps), str(Path(root) / str(rows)),
                                   str(rows)])
                rates[kind, rows].append(r["samples"] / r["cpu_seconds"])
        print({f"{k}@{r}": round(v[-1]) for (k, r), v in rates.items()}, flush=True)
    out = {}
    smallest = rates["ds_omni", LARGE_ROWS[0]]
    for rows in LARGE_ROWS:
        ours, base = rates["ds_omni", rows], rates["baseline", rows]
        out[str(rows)] = {
            "ds_omni_samples_per_cpu_s": ours, "baseline_samples_per_cpu_s": base,
            "ds_omni_median": statistics.median(ours), "baseline_median": statistics.median(base),
            "ds_omni_over_baseline": statistics.median(a / b for a, b in zip(ours, base)),
            "ds_omni_over_smallest_files": statistics.median(a / b for a, b in zip(ours, smallest))}
    return {"rows_per_file": out, "chunk_reads": chunk_reads(root), "sources": 4, "image_px": 64,
            "chunk_rows": 256, "row_group_rows": LARGE_ROW_GROUP,
            "total_rows_at_largest": 4 * LARGE_ROWS[-1]}


def memory(root: str) -> dict:
    rows = {}
    for n in (1, 10, 100, 300):
        ours = in_subprocess(["memory", "ds_omni", str(n), root])
        base0 = in_subprocess(["memory", "baseline", str(n), "0", root])
        base2 = in_subprocess(["memory", "baseline", str(n), "2", root])
        rows[str(n)] = {"ds_omni_rss_mb": ours["rss_mb"], "ds_omni_state_bytes": ours["state_bytes"],
                        "baseline_0workers_rss_mb": base0["rss_mb"],
                        "baseline_2workers_rss_mb": base2["rss_mb"],
                        "ds_omni_over_baseline_2workers": ours["rss_mb"] / base2["rss_mb"]}
        print(n, rows[str(n)], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs="+")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", choices=["throughput", "large_files", "memory"])
    p.add_argument("--data", help="folder for the generated files, kept and reused (default: a "
                   "temporary folder, removed at the end)")
    args = p.parse_args()
    if args.child:
        kind, what, *rest = args.child
        fn = child_throughput if kind == "throughput" else child_memory
        print(json.dumps(fn(what, *[int(x) if x.isdigit() else x for x in rest])))
        return
    root = args.data or tempfile.mkdtemp(prefix="ds_omni_loader_bench_")
    out = RESULTS / "loader.json"
    result = json.loads(out.read_text()) if out.exists() else {}
    if args.only in (None, "throughput"):
        result["throughput"] = throughput(str(Path(root) / "tp"), args.repeats, args.steps)
    if args.only in (None, "large_files"):
        result["large_files"] = large_files(str(Path(root) / "large"), args.repeats, args.steps)
    if args.only in (None, "memory"):
        result["memory"] = memory(str(Path(root) / "mem"))
    result |= {"setup": {"global_batch": BATCH, "micro_batch": MICRO, "throughput_sources": 4,
                        "throughput_image_px": 128, "memory_rows_per_source": 400,
                        "cpu_count": os.cpu_count()}}
    if not args.data:
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "loader.png")
    print(json.dumps(result, indent=1))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(15, 3.8))
    if "throughput" in result:
        names = list(result["throughput"])
        a.bar(names, [result["throughput"][n]["median"] for n in names], color=["C0", "C1", "C2"])
        a.set_ylabel("samples/s (median)")
        a.set_title("loader throughput, 1 process")
        a.tick_params(axis="x", labelsize=8)
    if "large_files" in result:
        per = result["large_files"]["rows_per_file"]
        rows = sorted(per, key=int)
        for key, label in (("ds_omni_median", "ds_omni"),
                           ("baseline_median", "interleave, 0 workers")):
            c.plot([int(r) for r in rows], [per[r][key] for r in rows], marker="o", label=label)
        c.set_xscale("log")
        c.set_ylim(bottom=0)
        c.set_xlabel("rows per file (4 sources)")
        c.set_ylabel("samples per CPU second (median)")
        c.set_title("throughput as files grow")
        c.legend(fontsize=8)
    if "memory" in result:
        n = sorted(result["memory"], key=int)
        for key, label in (("ds_omni_rss_mb", "ds_omni"), ("baseline_0workers_rss_mb", "interleave, 0 workers"),
                           ("baseline_2workers_rss_mb", "interleave, 2 workers")):
            b.plot([int(x) for x in n], [result["memory"][x][key] for x in n], marker="o", label=label)
        b.set_xscale("log")
        b.set_yscale("log")
        b.set_xlabel("sources")
        b.set_ylabel("added resident memory, MB")
        b.set_title("loader memory after 5 global batches")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
