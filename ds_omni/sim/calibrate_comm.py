"""Fit the simulator's links to this machine: time real collectives, fit alpha-beta.

    ds-omni calibrate-comm --ranks 2 4 --out cpu_cluster.json

Each of 2 and 4 processes (gloo) times all-reduce, all-gather, reduce-scatter and an all-to-all
with uneven splits at a few sizes (median of repeats, the slowest rank's). Every measurement
is written in the terms `sim/comm.py` charges it: `latencies` alpha's and `wire` bytes over
beta (a ring all-reduce of n bytes on p ranks: 2 (p - 1) latencies, 2 (p - 1) / p n bytes).
One least-squares fit over all of them gives alpha (seconds a message) and beta (bytes/s),
which become the cluster's intra-node link (the processes share one machine). The file is a
cluster description `cluster("path.json", gpus)` loads: the "cpu" preset with these fields.

CPU time would miss the wait a collective is made of, so collectives are timed by the wall
clock (`clock=time.process_time`: the CPU they spend, what a CPU-clock measurement counts);
each size is repeated and the median kept, which a busy machine distorts least.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from ds_omni.errors import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SIZES = (2 ** 12, 2 ** 16, 2 ** 19, 2 ** 21, 2 ** 23)  # buffer bytes (fp32): 4 KiB .. 8 MiB
# (two runs up to 2 MiB alone found alpha alike, ~0.65 ms, but beta 0.48 and 7.9 GB/s: too few
# bytes to see the bandwidth behind the latency on a busy machine)


@dataclass(frozen=True)
class Timing:
    op: str
    ranks: int
    nbytes: int
    """The whole buffer (all-reduce, the gathered / unscattered one) or, for the all-to-all,
    the bytes the busiest rank sends or receives."""
    seconds: float

    def terms(self) -> tuple[float, float]:
        """(latencies, wire bytes) `sim/comm.py` charges this collective: t = a * alpha + b / beta."""
        p, n = self.ranks, self.nbytes
        if self.op == "all_reduce":  # the ring
            return 2 * (p - 1), 2 * (p - 1) / p * n
        if self.op in ("all_gather", "reduce_scatter"):
            return p - 1, (p - 1) / p * n
        if self.op == "all_to_all":  # alpha per peer + the busiest rank's bytes
            return p - 1, n
        raise ConfigError(f"unknown collective {self.op!r}; timings are of {OPS}")


def fit_alpha_beta(timings: list[Timing]) -> tuple[float, float]:
    """(alpha s, beta B/s) minimising the squared relative error of t = a alpha + b / beta over
    `timings` (relative: a 4 KiB message counts as much as a 2 MiB one); both kept >= 0."""
    if len(timings) < 2:
        raise ConfigError(f"an alpha-beta fit needs >= 2 timings, got {len(timings)}")
    terms = np.array([t.terms() for t in timings], dtype=np.float64)  # [K, 2]
    seconds = np.array([t.seconds for t in timings], dtype=np.float64)  # [K]
    if not (seconds > 0).all():
        raise ConfigError("every timing must be > 0 s; a clock that reads 0 cannot be fitted")
    weighted = terms / seconds[:, None]  # relative residuals: divide each row by its time
    (alpha, inv_beta), *_ = np.linalg.lstsq(weighted, np.ones_like(seconds), rcond=None)
    if inv_beta <= 0:  # no byte term left: the sizes were too small to see the bandwidth
        raise ConfigError("the fit found no bandwidth term (time does not grow with size); "
                          "time larger messages (SIZES) or more repeats")
    if alpha < 0:  # latency too small to see: refit with bandwidth alone
        alpha = 0.0
        inv_beta = float(np.sum(terms[:, 1] / seconds) / np.sum((terms[:, 1] / seconds) ** 2))
    return float(alpha), float(1.0 / inv_beta)


def fit_report(timings: list[Timing]) -> dict:
    """The fit, each timing's predicted seconds and the median / max relative error."""
    alpha, beta = fit_alpha_beta(timings)
    rows, errors = [], []
    for t in timings:
        lat, wire = t.terms()
        pred = lat * alpha + wire / beta
        errors.append(abs(pred - t.seconds) / t.seconds)
        rows.append({"op": t.op, "ranks": t.ranks, "bytes": t.nbytes, "measured_s": t.seconds,
                     "predicted_s": pred})
    return {"alpha_s": alpha, "beta_bytes_per_s": beta, "timings": rows,
            "median_rel_error": float(np.median(errors)), "max_rel_error": float(max(errors))}


def cluster_fields(report: dict) -> dict:
    """The cluster description (`cluster(path)`): the cpu preset, its links fitted. Between
    nodes the same link (this calibration ran on one machine; a cluster of them would be
    calibrated across two)."""
    return {"preset": "cpu", "intra_latency": report["alpha_s"],
            "intra_bw": report["beta_bytes_per_s"], "inter_latency": report["alpha_s"],
            "inter_bw": report["beta_bytes_per_s"]}


# ----------------------------------------------------------------------- the measured run
def _uneven_splits(p: int, rank: int, elems: int) -> tuple[list[int], list[int]]:
    """Rank i sends (1 + (i + j) % p) shares to rank j: every split differs."""
    share = max(1, elems // (p * (p + 1) // 2))
    send = [share * (1 + (rank + j) % p) for j in range(p)]
    recv = [share * (1 + (i + rank) % p) for i in range(p)]
    return send, recv


def _time(fn, repeats: int, clock=time.perf_counter) -> float:
    import torch.distributed as dist
    fn()  # warm-up: buffers and the algorithm chosen
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _measure_rank(rank: int, world: int, sizes, repeats: int, clock) -> list[tuple]:
    import torch
    import torch.distributed as dist
    out = []
    for nbytes in sizes:
        n = nbytes // 4  # fp32 elements
        buf, part = torch.ones(n), torch.ones(n // world)
        send, recv = _uneven_splits(world, rank, n)
        a2a_in, a2a_out = torch.ones(sum(send)), torch.empty(sum(recv))
        ops = {"all_reduce": lambda: dist.all_reduce(buf),
               "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(n // world * world),
                                                                 part),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, buf[:n // world * world]),
               "all_to_all": lambda: dist.all_to_all_single(a2a_out, a2a_in, recv, send)}
        for op, fn in ops.items():
            # the all-to-all's own rows are a local copy (`comm.all_to_all_pairs` skips them)
            moved = (max(sum(send) - send[rank], sum(recv) - recv[rank]) * 4
                     if op == "all_to_all" else n // world * world * 4)
            out.append((op, world, moved, _time(fn, repeats, clock)))
    return out


def _child(rank: int, world: int, out_dir: str, sizes, repeats: int, clock) -> None:
    import pickle
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    # a file store: no port to pick (a free port can be taken by another job before rank 0 binds)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        rows = _measure_rank(rank, world, sizes, repeats, clock)
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure(world: int, sizes=SIZES, repeats: int = 9, timeout: float = 300.0,
            clock=time.perf_counter) -> list[Timing]:
    """Time every collective of OPS at `sizes` on `world` local processes over gloo; the
    slowest rank's median of each, on `clock` (`time.process_time`: the CPU a call spends,
    what a CPU-clock measurement of training counts, not its waits)."""
    import multiprocessing as mp
    import pickle
    if world < 2:
        raise ConfigError(f"collectives need >= 2 processes, got --ranks {world}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ds_omni_comm_") as tmp:
        procs = [ctx.Process(target=_child, args=(r, world, tmp, tuple(sizes), repeats, clock))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        files = [Path(tmp, f"rank{r}.pkl") for r in range(world)]
        if not all(f.exists() for f in files):
            raise ConfigError(f"the {world}-process collective run failed or ran past {timeout} "
                              f"s (exit codes {[p.exitcode for p in procs]}); its ranks' "
                              "errors are printed above")
        per_rank = [pickle.loads(f.read_bytes()) for f in files]
    return [Timing(op, w, max(r[i][2] for r in per_rank), max(r[i][3] for r in per_rank))
            for i, (op, w, _, _) in enumerate(per_rank[0])]


def calibrate(worlds=(2, 4), sizes=SIZES, repeats: int = 9, clock=time.perf_counter) -> dict:
    """Measure on every world size of `worlds`, fit one link: the report and the cluster."""
    timings = [t for w in worlds for t in measure(w, sizes, repeats, clock=clock)]
    report = fit_report(timings)
    return {"cluster": cluster_fields(report), **report, "ranks": list(worlds),
            "cpu_count": os.cpu_count()}


def write(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.write_text(json.dumps(result, indent=1))
    return out


# ------------------------------------------------------------------ the encoder pool's planning
POOL_META_BYTES = 64
"""Pickled bytes of one item's metadata in the pool's all-gather (a `PoolItem` with one input,
pixel_values [16, 3, 14, 14] float32: 63 bytes an item in a list of 8, `pickle.dumps`, which
writes the repeated strings once)."""


def pool_items(ranks: int, per_rank: int) -> list:
    """[ranks][per_rank] the metadata of one round's items as every rank reports it: one image
    each (pixel values [n, 3, 14, 14] float32), costs uneven enough that some items move."""
    from ds_omni.parallelize.encoder_pool import PoolItem
    return [[PoolItem(r, "vision", k, 16, 1.0 + ((r * 7 + k * 3) % 5),
                      (("pixel_values", (16, 3, 14, 14), "float32"),))
             for k in range(per_rank)] for r in range(ranks)]


def time_pool_planning(ranks: int = 2, per_rank: int = 8, rounds: int = 4,
                       repeats: int = 15) -> float:
    """CPU seconds the encoder pool's step planning costs one rank per item of the group's step
    (`Cluster.pool_item_s`): what `EncoderPool.plan_step` runs besides the wire, its metadata
    pickled for `all_gather_object` and every rank's unpickled, then `plan_round` for each
    round over every rank's items. A micro-benchmark of the pure planner on `time.process_time`
    (no process group: the all-gather's wire is charged by the simulator's links); the median of
    `repeats`."""
    import pickle

    import torch

    from ds_omni.batch import EncodedItem
    from ds_omni.parallelize.encoder_pool import item_meta, plan_round
    step = [pool_items(ranks, per_rank) for _ in range(rounds)]  # [rounds][ranks][per_rank]
    item = EncodedItem(inputs={"pixel_values": torch.zeros(16, 3, 14, 14)}, num_embeddings=16)
    others = [pickle.dumps([(step[m][r], []) for m in range(rounds)]) for r in range(1, ranks)]
    times = []
    for _ in range(repeats):
        t0 = time.process_time()  # rank 0: its own items' metadata out, everyone's in
        mine = [([item_meta(0, it.encoder, it.index, item, it.cost) for it in step[m][0]], [])
                for m in range(rounds)]
        everyone = [pickle.loads(b) for b in [pickle.dumps(mine)] + others]
        for m in range(rounds):
            plan_round([it for r in everyone for it in r[m][0]], ranks, ["vision"])
        times.append(time.process_time() - t0)
    return statistics.median(times) / (ranks * per_rank * rounds)


def time_ring_blocks(heads: int = 8, head_dim: int = 32, tokens: int = 1024,
                     repeats: int = 5) -> float:
    """FLOP/s of ring attention's block kernel (`Cluster.ring_flops_per_s`): the CPU kernel
    training runs (`ring_kernels.TorchBlock`), forward and its written-out backward, on one dense
    `tokens` x `tokens` block (a packed row of 4 samples, zigzag: every query of a rank scores
    every key, masked); its matmuls' 3 x 4 h C K D FLOPs over its `time.process_time` (the median
    of `repeats`; one thread)."""
    import torch

    from ds_omni.model.ring_attention import ring_mask
    from ds_omni.model.ring_kernels import TorchBlock
    pos = torch.arange(tokens)
    bounds = torch.tensor([0, tokens // 4, tokens // 2, 3 * tokens // 4, tokens])
    q = torch.randn(tokens, heads, head_dim)
    k, v = (torch.randn(tokens, max(1, heads // 2), head_dim) for _ in range(2))
    allowed, kernel, scaling = ring_mask(pos, pos, bounds), TorchBlock(), head_dim ** -0.5
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        out, lse = kernel.forward(q, k, v, allowed, scaling)
        kernel.backward(torch.ones_like(out), q, k, v, out, lse, allowed, scaling)
        times.append(time.process_time() - t0)
    return 3 * 4 * heads * tokens * tokens * head_dim / statistics.median(times)


def _ring_rank(barrier, results, kwargs: dict) -> None:
    barrier.wait()  # every process starts timing together, as the ranks of a run share cores
    results.put(time_ring_blocks(**kwargs))


def time_ring_blocks_at_once(world: int, **kwargs) -> float:
    """`time_ring_blocks` in `world` processes at once (the median of their FLOP/s), as the
    compute calibration profiles: a rank's CPU seconds grow when its neighbours run."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_ring_rank, args=(barrier, results, kwargs))
             for _ in range(world)]
    for p in procs:
        p.start()
    rates = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(rates)
