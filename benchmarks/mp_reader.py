"""One reader per SP / TP group: what each rank's loader reads, decodes and spends, at sp 1 / 2 / 4
and tp 2.

    .venv/bin/python benchmarks/mp_reader.py          # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/mp_reader.py --steps 4

Four ranks over gloo (`tests/harness.run_on_ranks`), each running only its loader (no model
step): sp=4 (one SP group of 4 ranks), sp=2 (dp 2 x sp 2), sp=1 (dp 4) and tp=2 (dp 2 x tp 2:
each TP rank trains on the whole rows of its group), with the same data
(2 parquet sources of 256x256 JPEG conversations, `benchmarks/loader.py`'s) and the same global
batch of 16 samples a step. At sp 2, sp 4 and tp 2 both ways run in the same launch, one after
the other on fresh loaders: "before" (`data.shared_reading` false: every rank of an SP or TP
group reads, decodes and packs every row of its group) and "after" (true: the group's first rank
does, and scatters each peer its shard, or under TP its micro-batches). Per rank and way: rows read, payload bytes read, encoder items processed (images
decoded) from the loader's own counters (`OmniLoader.counts`), and loader CPU seconds
(`time.process_time` of the rank's process over the steps, after one warm-up step). The launch
checks that both ways give every rank the same keys and the same micro-batch tensors (under TP
a peer's encoder inputs are only those of the items it encodes: a subsequence of what it read
itself before).

Writes benchmarks/results/mp_reader.json and mp_reader.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
WORLD, BATCH, MICRO, ROWS, IMAGE_PX = 4, 16, 4, 512, 256
CASES = [("sp1", 1, 1), ("sp2", 2, 1), ("sp4", 4, 1), ("tp2", 1, 2)]  # (name, sp, tp)
SHARED = [name for name, sp, tp in CASES if sp * tp > 1]
NAMES = ["sp1-before"] + [f"{n}-{way}" for n in SHARED for way in ("before", "after")]


def _h(t) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _digest(batch) -> dict:
    """What a rank trains on in a step: a hash of its token shards ("tokens"), and one hash per
    encoder item ("items": each image's pixels, a row of the tiny CLIP's pixel_values), in order."""
    tokens, items = hashlib.sha256(), []
    for mb in batch.micro_batches:
        for t in (mb.input_ids, mb.targets, mb.position_ids, mb.cu_seqlens):
            tokens.update(_h(t).encode())
        items += [_h(row) for e in sorted(mb.encoder_inputs)
                  for _, t in sorted(mb.encoder_inputs[e].items()) for row in t]
    return {"tokens": tokens.hexdigest(), "items": items}


def _is_subsequence(part: list, whole: list) -> bool:
    it = iter(whole)
    return all(x in it for x in part)


def _same_training(before: dict, after: dict, tp_peer: bool) -> bool:
    """The two ways gave the rank the same keys and token shards, and the same encoder inputs:
    all of them, or on a TP peer under shared reading those of the items it encodes (its share
    of each row, `plan_tp_encode`), which the reader sends it without the others' pixels."""
    if before["keys"] != after["keys"]:
        return False
    for b, a in zip(before["digests"], after["digests"]):
        if b["tokens"] != a["tokens"]:
            return False
        if not (_is_subsequence(a["items"], b["items"]) if tp_peer else a["items"] == b["items"]):
            return False
    return True


def _run(cfg, built, plan, rank: int, shared: bool, steps: int) -> dict:
    from ds_omni.data.build import build_loader
    from ds_omni.parallel.groups import rank_groups
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shared_reading=shared))
    groups = rank_groups(plan, rank, prefetch=False)
    loader = build_loader(cfg, built, plan, groups, num_micro=BATCH // (plan.dp * MICRO))
    loader.next_step()  # warm-up: files opened, first streams
    start = dataclasses.replace(loader.counts)
    cpu, wall = time.process_time(), time.perf_counter()
    keys, digests = [], []
    for _ in range(steps):
        batch = loader.next_step()
        assert batch.error is None, batch.error
        keys.append(batch.keys)
        digests.append(_digest(batch))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    end = loader.counts
    loader.close()
    return {"rows": end.rows - start.rows, "bytes": end.bytes - start.bytes,
            "images": end.items - start.items, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
            "keys": keys, "digests": digests}


def ranks(rank: int, world: int, root: str, steps: int) -> dict:
    import datasets
    from loader import make_sources, model_and_config  # benchmarks/loader.py
    from ds_omni.parallel.plan import ParallelPlan
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    import torch
    torch.set_num_threads(1)
    cfg, built = model_and_config(make_sources(Path(root), 2, ROWS, IMAGE_PX))
    cfg.data.chunk_rows = 32
    out = {}
    for name, sp, tp in CASES:
        cfg.parallel.sp, cfg.parallel.tp = sp, tp
        plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
        for shared in ((False,) if sp * tp == 1 else (False, True)):
            out[f"{name}-{'after' if shared else 'before'}"] = _run(cfg, built, plan, rank,
                                                                     shared, steps)
    return out


def summarise(per_rank: list[dict]) -> dict:
    report = {}
    for name in per_rank[0]:
        rows = [r[name] for r in per_rank]
        report[name] = {k: [r[k] for r in rows] for k in ("rows", "bytes", "images", "cpu_s",
                                                           "wall_s")}
        report[name]["total"] = {k: round(sum(r[k] for r in rows), 3)
                                 for k in ("rows", "bytes", "images", "cpu_s")}
    for name in SHARED:
        before, after = report[f"{name}-before"], report[f"{name}-after"]
        tp = dict((n, t) for n, _, t in CASES)[name]
        same = all(_same_training(per_rank[r][f"{name}-before"], per_rank[r][f"{name}-after"],
                                  tp_peer=r % tp != 0) for r in range(len(per_rank)))
        assert same, f"{name}: the ranks' batches differ between the two ways"
        report[name] = {
            "same_batches": same,
            "after_over_before_total": {k: round(after["total"][k] / before["total"][k], 4)
                                        for k in ("rows", "bytes", "images", "cpu_s")},
            "after_over_before_busiest_rank_cpu": round(max(after["cpu_s"]) /
                                                        max(before["cpu_s"]), 4)}
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = NAMES
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, (key, label) in zip(axes, (("bytes", "MB read"), ("images", "images decoded"),
                                       ("cpu_s", "loader CPU s"))):
        for r in range(WORLD):
            vals = [report[n][key][r] / (1e6 if key == "bytes" else 1) for n in names]
            ax.bar([i + 0.2 * (r - 1.5) for i in range(len(names))], vals, width=0.2,
                   label=f"rank {r}")
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_title(f"{label} per rank")
    axes[0].legend(fontsize=7)
    fig.suptitle("one reader per SP / TP group: 4 ranks, the same data and global batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    from tests.harness import run_on_ranks
    with tempfile.TemporaryDirectory(prefix="ds_omni_mp_reader_") as tmp:
        per_rank = run_on_ranks(ranks, WORLD, args=(tmp, args.steps), timeout=args.timeout)
    report = {"command": f"python benchmarks/mp_reader.py --steps {args.steps}",
              "world": WORLD, "global_batch": BATCH, "steps": args.steps, "image_px": IMAGE_PX,
              "loadavg": os.getloadavg(), **summarise(per_rank)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mp_reader.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, RESULTS / "mp_reader.png")
    for name in NAMES:
        r = report[name]
        print(f"{name:11s} rows {r['rows']} MB {[round(b / 1e6, 2) for b in r['bytes']]} "
              f"images {r['images']} cpu_s {r['cpu_s']}")
    for name in SHARED:
        print(f"{name}: after/before totals {report[name]['after_over_before_total']}")


if __name__ == "__main__":
    main()
