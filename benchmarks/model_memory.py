"""Per-rank memory and step time of one training plan, as tensors' bytes (the TP and EP benchmarks).

CPU ranks have no `torch.cuda.max_memory_allocated`, so each part is counted from the tensors
that hold it, and RSS is reported beside them as a cross-check:
- parameters: this rank's share of the model's parameters (under ZeRO-3 its partition,
  `ds_tensor`; under tp or ep the local shards), numel x itemsize;
- optimizer state: the torch optimizer's state (Adam's two moments) plus the fp32 master copies
  its param groups hold (DeepSpeed's ZeRO 1-3 keep a partition of them apart from the model's
  weights, also in fp32);
- activations: the bytes autograd saves for backward in one micro-batch's forward
  (`torch.autograd.graph.saved_tensors_hooks`, each storage counted once), the largest over
  the measured steps: their peak, since backward frees them;
- live tensors: the bytes of every tensor object alive after the last step (gc, each storage
  once) less those alive before the plan was set up: parameters, optimizer state, gradient
  partitions and buckets and buffers together; `live - parameters - optimizer state` is what
  the rest holds. Allocated counts, touched or not (a bucket DeepSpeed allocates whole);
- RSS: the growth of the process's resident memory over the plan (a cross-check; pages that
  an earlier plan freed may be reused, so it can read low, and untouched buffers do not count).
All plans of a benchmark run one after another in the same ranks (one launch: starting 4 ranks
costs minutes on a loaded 2-core machine); each plan's engine is freed before the next.
Step time: each step's CPU time (`time.process_time`, one thread a rank) and wall time, the
busiest / slowest rank's (an all-reduce max), the first `warmup` steps dropped.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager

MB = 2 ** 20


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def param_bytes(module) -> int:
    """This rank's share of `module`'s parameters (ZeRO-3: the partition it holds)."""
    return sum(tensor_bytes(getattr(p, "ds_tensor", p)) for p in module.parameters())


def optimizer_bytes(engine) -> dict[str, int]:
    """{"moments": Adam's state, "master": the fp32 copies the torch optimizer steps}."""
    import torch
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps torch's
    moments = sum(tensor_bytes(v) for state in inner.state.values() for v in state.values()
                  if torch.is_tensor(v) and v.numel() > 1)  # not the step counters
    model = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    master = sum(tensor_bytes(p) for g in inner.param_groups for p in g["params"]
                 if p.untyped_storage().data_ptr() not in model)  # ZeRO-0 steps the weights
    return {"moments": moments, "master": master}


def live_tensor_bytes() -> int:
    """Bytes of every storage a live tensor object holds (each storage once)."""
    import torch
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        try:  # (isinstance() on some lazy objects of transformers warns: not tensors anyway)
            if torch.is_tensor(obj) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError):  # meta tensors, freed weak proxies
            continue
    return sum(seen.values())


def rss_bytes() -> int:
    """Resident memory of this process now."""
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class SavedActivations:
    """The bytes autograd saves in each forward of `module` (a forward pre-hook starts a new
    tally; each storage counts once); `peak` is the largest tally."""

    def __init__(self, module):
        self.peak, self._seen = 0, {}
        module.register_forward_pre_hook(lambda *_: self._seen.clear())

    def _pack(self, t):
        storage = t.untyped_storage()
        self._seen[storage.data_ptr()] = storage.nbytes()
        self.peak = max(self.peak, sum(self._seen.values()))
        return t

    @contextmanager
    def counting(self):
        import torch
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield


def measure_plan(rank: int, world: int, cfg, ds_json: dict, steps: int, warmup: int,
                 extra=None) -> dict:
    """Train `steps` steps of `cfg` on this rank (every rank calls it) and measure it.
    `extra(engine)`: more facts to report (the mechanism's counters)."""
    import torch
    import torch.distributed as dist
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.train.setup import setup_training
    from ds_omni.train.step import train_step
    torch.set_num_threads(1)
    live_before, rss_before, t0 = live_tensor_bytes(), rss_bytes(), time.perf_counter()
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    built, loader, engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_json, plan),
                                                   rank, plan)
    saved = SavedActivations(engine.module)
    if rank == 0:
        print(f"  set up in {time.perf_counter() - t0:.0f} s", flush=True)
    cpu, wall, losses = [], [], []
    for step in range(steps):
        batch = loader.next_step()  # the loader's time is not the step's
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        with saved.counting():
            losses.append(train_step(engine, batch, groups).loss)
        took = torch.tensor([time.process_time() - start_cpu, time.perf_counter() - start],
                            dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the busiest / slowest rank's
        if step >= warmup:
            cpu.append(float(took[0]))
            wall.append(float(took[1]))
    opt = optimizer_bytes(engine)
    out = {"param_bytes": param_bytes(engine.module), "optimizer_moment_bytes": opt["moments"],
           "optimizer_master_bytes": opt["master"],
           "optimizer_state_bytes": opt["moments"] + opt["master"],
           "activation_peak_bytes": saved.peak,
           "live_tensor_bytes": live_tensor_bytes() - live_before,
           "rss_bytes": rss_bytes() - rss_before, "step_cpu_s": cpu, "step_wall_s": wall,
           "losses": losses, **(extra(engine) if extra else {})}
    loader.close()
    del engine, built, loader, saved
    gc.collect()  # before the next plan's "before"
    return out


def measure_plans(rank: int, world: int, plans: dict, steps: int, warmup: int,
                  extra=None) -> dict:
    """{name: measure_plan(...)} for `plans` ({name: (cfg, DeepSpeed JSON)}), in order."""
    out = {}
    for name, (cfg, ds_json) in plans.items():
        if rank == 0:
            print(f"{name} ...", flush=True)
        out[name] = measure_plan(rank, world, cfg, ds_json, steps, warmup, extra)
        if rank == 0:
            print(f"  steps: {[round(s, 2) for s in out[name]['step_cpu_s']]} s CPU", flush=True)
    return out
