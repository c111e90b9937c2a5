"""Hand-over benchmark: what receiving a finished step from the loader process costs the trainer
(`data.workers` >= 1), and what sending it costs the loader process.

    .venv/bin/python benchmarks/handover.py          # writes benchmarks/results/handover.json

The workload of benchmarks/prefetch.py (4 parquet sources, 256x256 JPEGs, global batch 16 in
micro-batches of 4, one rank). Two figures, both CPU time (`time.process_time`: the machine's
load barely moves it), medians:
- `trainer_cpu_s_per_next_step`: the trainer's `next_step` with the loader process 4 steps ahead
  and idle (the trainer sleeps between steps until the loader process has made them), so the
  figure is the hand-over alone: the request, the reply and building the `StepBatch`;
- `loader_cpu_s_per_step_serialising` and `trainer_cpu_s_per_step_deserialising`: the two ends
  of the hand-over in one process on the same steps (made by an in-process loader), with the
  hand-over of `loader_process.py` (`handover.py`: tensors' bytes into a shared-memory slot, the
  rest pickled) and, for comparison, the whole step pickled by `workers.dumps` and unpickled
  (the pipe hand-over before the shared-memory slot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
MICRO = 4
IMAGE_PX = 256
AHEAD = 4


def _cpu(fn, repeats: int) -> float:
    """Median CPU seconds of `fn()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        fn()
        times.append(time.process_time() - c0)
    return statistics.median(times)


def next_step_cost(cfg, built, steps: int, idle_s: float) -> dict:
    """The trainer's CPU and wall seconds per `next_step`, the loader process idle and ahead."""
    from ds_omni.data.build import build_loader
    from ds_omni.data.loader_process import feed_for
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, workers=1, pin_cores=True))
    loader = build_loader(cfg, built, num_micro=cfg.train.global_batch_size // MICRO)
    feed = feed_for(loader, AHEAD)
    for _ in range(2):  # warm-up: files opened, first streams
        feed.next_step()
    cpu, wall = [], []
    for _ in range(steps):
        time.sleep(idle_s)  # the loader process refills its steps ahead, then idles
        c0, t0 = time.process_time(), time.perf_counter()
        feed.next_step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    feed.close()
    loader.close()
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
            "cpu_s_all": cpu, "wall_s_all": wall}


def serialising_cost(cfg, built, steps: int, repeats: int) -> dict:
    """Both ends of the hand-over, in this process, on `steps` steps of an in-process loader."""
    from ds_omni.data.build import build_loader
    from ds_omni.data.workers import dumps
    loader = build_loader(cfg, built, num_micro=cfg.train.global_batch_size // MICRO)
    batches = [loader.next_step() for _ in range(steps)]
    loader.close()
    out = {"pipe_dumps_s": [], "pipe_loads_s": [], "step_bytes": []}
    for batch in batches:
        payload = dumps(batch)
        out["step_bytes"].append(len(payload))
        out["pipe_dumps_s"].append(_cpu(lambda: dumps(batch), repeats))
        out["pipe_loads_s"].append(_cpu(lambda: pickle.loads(payload), repeats))
    try:
        from ds_omni.data import handover
    except ImportError:  # before the shared-memory hand-over
        return {k: statistics.median(v) for k, v in out.items()}
    out.update(shm_send_s=[], shm_encode_s=[], shm_write_s=[], shm_receive_s=[],
               shm_header_bytes=[])
    prefix = f"dso_bench_{os.getpid()}_"
    sender, receiver = handover.Sender(prefix), handover.Receiver(prefix)
    try:
        for batch in batches:
            # the loader process: pickled when made (`encode`), written at the reply (`send`)
            out["shm_send_s"].append(_cpu(lambda: sender.send(handover.encode(batch)), repeats))
            encoded = handover.encode(batch)
            out["shm_encode_s"].append(_cpu(lambda: handover.encode(batch), repeats))
            out["shm_write_s"].append(_cpu(lambda: sender.send(encoded), repeats))
            header = sender.send(encoded)
            out["shm_header_bytes"].append(len(pickle.dumps(header)))
            out["shm_receive_s"].append(_cpu(lambda: receiver.receive(header), repeats))
    finally:
        receiver.close()
        sender.close()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--idle-s", type=float, default=0.25)
    args = p.parse_args()
    import torch
    from loader import make_sources, model_and_config, quiet_datasets
    torch.set_num_threads(1)
    quiet_datasets()
    root = tempfile.mkdtemp(prefix="ds_omni_handover_bench_")
    cfg, built = model_and_config(make_sources(Path(root), 4, 400, IMAGE_PX))
    load = [os.getloadavg()[0]]
    ends = serialising_cost(cfg, built, 6, 21)
    print(ends, flush=True)
    trainer = next_step_cost(cfg, built, args.steps, args.idle_s)
    load.append(os.getloadavg()[0])
    shutil.rmtree(root, ignore_errors=True)
    result = {"steps": args.steps, "ahead": AHEAD, "idle_s": args.idle_s,
              "trainer_cpu_s_per_next_step": trainer["cpu_s"],
              "trainer_wall_s_per_next_step": trainer["wall_s"],
              "trainer_cpu_s_all": trainer["cpu_s_all"], "trainer_wall_s_all": trainer["wall_s_all"],
              "ends": ends, "load_average_1min": load}
    if "shm_send_s" in ends:
        result["loader_cpu_s_per_step_serialising"] = ends["shm_send_s"]
        result["trainer_cpu_s_per_step_deserialising"] = ends["shm_receive_s"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "handover.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_all")}, indent=1))


if __name__ == "__main__":
    main()
