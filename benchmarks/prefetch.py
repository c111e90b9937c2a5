"""Prefetch benchmark: how much of the loading time the training step hides: prefetch off, on
(a thread), on with the thread driving one pack worker (the design before the loader process:
"thread_workers"), and with the whole loader in a loader process (`data.workers` 1: "workers").

    .venv/bin/python benchmarks/prefetch.py          # writes benchmarks/results/prefetch.json

One data-parallel rank with the loader of `benchmarks/loader.py` (4 parquet sources, 256x256
JPEGs, global batch 16 in micro-batches of 4: image decoding, the HF image processor, tokenising
and packing per step). The training step is the tiny LLaVA's forward and backward on the step's
first micro-batch, slowed by a fixed number of matmuls (which release the GIL, as a GPU step's
host thread does while it waits for the device) so that it takes about as long as loading a step
(both measured first). The trainer holds one core (`torch.set_num_threads(1)`); the loader
thread (and its worker) has the other. With the loader process (`data.workers` 1) the trainer
and the loader process are pinned to a core each by `data.pin_cores` (the placement is in the
results); the in-process variants are not pinned.

Per repeat, the same N steps with `data.prefetch_steps` 0, then 1, then 1 with the thread and a
pack worker, then 1 with `data.workers` 1, then 2 with `data.workers` 1 ("workers_ahead2": a
step more of slack, since a model as slow as its loading runs the loader at full use, where a
one-step buffer turns every slow step's jitter into waiting) (fresh loaders, the same samples:
checked); the loading time is what the trainer waits for data with prefetch off (all of it). Hidden = (wall time off - wall time on) / loading time off; also
1 - (wait on / wait off). The figures are medians over repeats; the machine's load average
(`os.getloadavg`) is recorded with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
MICRO = 4
IMAGE_PX = 256  # decoding these makes a step's loading about as long as the tiny model's step


def train_step(model, batch, work, matmuls: int) -> None:
    """Forward and backward of the first micro-batch, then `matmuls` 1-thread matmuls.

    The tiny model on CPU is all interpreter and dispatch (it holds the GIL); a GPU step's host
    thread mostly waits for the device. The matmuls stand for that: they release the GIL."""
    model(batch.micro_batches[0]).loss_sum.backward()
    for _ in range(matmuls):
        work @ work


def make_loader(cfg, built, workers: int, pack_workers: int = 0):
    """`data.workers` as the run builds it (>= 1: a loader process), or (`pack_workers`) the
    loader in the training process driving that many pack workers (the former design)."""
    from ds_omni.data.build import build_loader, loader_parts
    from ds_omni.data.rank_place import LoaderComms, RankPlace
    # data.pin_cores: with the loader process, the trainer on one core and it on the other
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, workers=workers,
                                                            pin_cores=True))
    num_micro = cfg.train.global_batch_size // MICRO
    if pack_workers:
        return loader_parts(cfg, built, RankPlace(num_micro=num_micro)).build(
            LoaderComms(), pack_workers)
    return build_loader(cfg, built, num_micro=num_micro)


def timed_steps(cfg, built, prefetch: int, steps: int, work, matmuls: int,
                workers: int = 0, pack_workers: int = 0) -> dict:
    from ds_omni.data.loader_process import feed_for
    loader = make_loader(cfg, built, workers, pack_workers)
    feed = feed_for(loader, prefetch)
    for _ in range(2):  # warm-up: files opened, first streams (and the worker started)
        train_step(built.model, feed.next_step(), work, matmuls)
    keys, waits, walls = [], [], []
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        t_step = time.perf_counter()
        batch = feed.next_step()
        waits.append(feed.last_wait_s)
        train_step(built.model, batch, work, matmuls)
        keys.append(batch.keys)
        walls.append(time.perf_counter() - t_step)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    feed.close()
    placement = loader.cores.record() if hasattr(loader, "cores") else None
    loader.close()
    return {"wall_s": wall, "data_wait_s": sum(waits), "keys": keys, "trainer_cpu_s": cpu,
            "placement": placement, "step_wait_s": waits, "step_wall_s": walls}


def loading_cpu(cfg, built, workers: int, steps: int = 6, pack_workers: int = 0) -> float:
    """CPU seconds the training process spends per step on loading alone (no training; all its
    threads, not the loader process's or the workers'): what `data.workers` moves out of it."""
    loader = make_loader(cfg, built, workers, pack_workers)
    loader.next_step()  # warm-up (and the worker started)
    cpu0 = time.process_time()
    for _ in range(steps):
        loader.next_step()
    cpu = (time.process_time() - cpu0) / steps
    loader.close()
    return cpu


def calibrate(cfg, built, work, steps: int = 12) -> dict:
    """Seconds to load one step, to train one (unslowed), and per matmul (medians over `steps`
    steps after a discarded run: a first loader of the process, or one hiccup of a short mean,
    set a model 15-25 % shorter than the repeats' loading in earlier runs); the matmuls that make
    a step as long as its loading."""
    timed_steps(cfg, built, 0, 4, work, 0)  # discarded: first image processing, first streams
    off = timed_steps(cfg, built, 0, steps, work, 0)
    load = statistics.median(off["step_wait_s"])
    step = statistics.median(w - d for w, d in zip(off["step_wall_s"], off["step_wait_s"]))
    per_mm = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            work @ work
        per_mm.append((time.perf_counter() - t0) / 20)
    per_mm = statistics.median(per_mm)
    return {"load_s_per_step": load, "model_s_per_step": step, "s_per_matmul": per_mm,
            "matmuls": max(0, round((load - step) / per_mm))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    import torch
    from loader import make_sources, model_and_config, quiet_datasets
    torch.set_num_threads(1)
    torch.manual_seed(0)
    quiet_datasets()
    root = tempfile.mkdtemp(prefix="ds_omni_prefetch_bench_")
    cfg, built = model_and_config(make_sources(Path(root), 4, 2000, IMAGE_PX))
    work = torch.randn(384, 384)
    cal = calibrate(cfg, built, work)
    print(cal, flush=True)
    cpu = {"in_process": loading_cpu(cfg, built, 0),
           "thread_and_pack_worker": loading_cpu(cfg, built, 0, pack_workers=1),
           "workers_1": loading_cpu(cfg, built, 1)}
    print(cpu, flush=True)
    variants = (("off", 0, 0, 0), ("on", 1, 0, 0), ("thread_workers", 1, 0, 1),
                ("workers", 1, 1, 0), ("workers_ahead2", 2, 1, 0))
    runs = {name: [] for name, *_ in variants}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, prefetch, workers, pack in variants:
            runs[name].append(timed_steps(cfg, built, prefetch, args.steps, work, cal["matmuls"],
                                          workers, pack))
        assert all(r[-1]["keys"] == runs["off"][-1]["keys"] for r in runs.values()), \
            "prefetch, the workers or the loader process changed the samples"
        load.append(os.getloadavg()[0])
        print({k: round(v[-1]["wall_s"], 2) for k, v in runs.items()}, flush=True)
    shutil.rmtree(root, ignore_errors=True)
    result = {"calibration": cal, "steps": args.steps, "repeats": args.repeats,
              "trainer_cpu_s_per_step_loading_only": cpu,
              "load_average_1min": load,
              "wall_s": {k: [r["wall_s"] for r in v] for k, v in runs.items()},
              "step_wait_s_median": {k: statistics.median(w for r in v for w in r["step_wait_s"])
                                     for k, v in runs.items()},
              "data_wait_s": {k: [r["data_wait_s"] for r in v] for k, v in runs.items()},
              # CPU time of the training process (all its threads; not the worker's): what the
              # loading takes from the trainer, a figure the machine's load barely moves
              "trainer_cpu_s_per_step": {k: statistics.median(r["trainer_cpu_s"] for r in v) /
                                         args.steps for k, v in runs.items()},
              "setup": {"global_batch": cfg.train.global_batch_size, "micro_batch": MICRO,
                        "sources": 4, "image_px": IMAGE_PX, "trainer_threads": 1},
              # data.pin_cores of the loader process variant ("workers"); the others unpinned
              "placement_workers": runs["workers"][-1]["placement"],
              "cores": sorted(os.sched_getaffinity(0))}
    # the run's own condition: the slowed model's step over the loading step, both from the
    # repeats' prefetch-off runs (1.0: as long, as the benchmark means; below 1, no feed can hide
    # all the loading: at most this fraction of it)
    result["model_over_loading_per_step"] = statistics.median(
        (r["wall_s"] - r["data_wait_s"]) / r["data_wait_s"] for r in runs["off"])
    for name, tag in (("on", ""), ("thread_workers", "_thread_workers"), ("workers", "_workers"),
                      ("workers_ahead2", "_workers_ahead2")):
        pairs = list(zip(runs["off"], runs[name]))
        result[f"hidden_fraction_wall{tag}"] = statistics.median(
            (off["wall_s"] - on["wall_s"]) / off["data_wait_s"] for off, on in pairs)
        result[f"hidden_fraction_wait{tag}"] = statistics.median(
            1 - on["data_wait_s"] / off["data_wait_s"] for off, on in pairs)
        result[f"speedup_on_over_off{tag}"] = statistics.median(
            off["wall_s"] / on["wall_s"] for off, on in pairs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prefetch.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("wall_s", "data_wait_s")},
                     indent=1))


if __name__ == "__main__":
    main()
