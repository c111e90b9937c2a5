"""Encoder pool: the encoder phase of a skewed round, pooled over all ranks against encoded at home.

    .venv/bin/python benchmarks/encoder_pool.py [--world 2] [--sp 1] [--rounds 8]   # a few minutes

`world` ranks on CPU over gloo, `world / sp` SP groups of `sp` consecutive ranks. Each round the
row of the first group (rank 0 at sp = 1) holds 2 x world images (16 x 16 patches each), laid
end to end over its shards, and the other rows are text alone: the skew of the pool cases in
`tests/dist/test_parity.py` and `test_sequence_parallel.py`. The images are encoded forward and backward by a Qwen2-VL vision
tower (4 blocks, width 256, 8 heads; `long_short_sp.py`'s) through the family's encoder module:
- off (`parallel.encoder_pool: "off"`, the baseline): every rank encodes its own row's items, so
  rank 0 encodes all of them (under sp > 1 the first group's ranks share them by
  `reshard.plan_reshard` and reshard them inside the group) and the others run the zero-weight
  dummy pass ZeRO-3 makes them run;
- dp (`"dp"`): what training runs, `EncoderPool`'s pieces: `plan_round` over every rank's items,
  `exchange_inputs` (the moving items' patches, one all-to-all of bytes), the encoder on this
  rank's share, `ReshardEmbeddings` (rows home), backward through both exchanges.
The round's time is the slowest rank's (a barrier before, an all-reduce max of each rank's time
after); both variants run each round in alternating order, and the figure is the median over
rounds of the paired ratio off / dp. Two clocks: wall time, and each rank's CPU time
(`time.process_time`, one thread per rank), which is what a round would take with a core (or a
GPU) per rank, which a shared 2-core machine cannot give the wall clock.
Writes benchmarks/results/encoder_pool_w{world}.json (`_sp{sp}` added under sp > 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
GRID = (1, 16, 16)  # image grid (t, h, w) in patches


def round_items(world: int, rank: int, sp: int = 1) -> list:
    """This rank's items of a round (`EncodedItem`s): the first group's row has them all."""
    import torch
    from benchmarks.long_short_sp import VISION
    from ds_omni.batch import EncodedItem
    if rank >= sp:
        return []
    patch_dim = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    n = GRID[0] * GRID[1] * GRID[2]
    gen = torch.Generator().manual_seed(0)
    return [EncodedItem(inputs={"pixel_values": torch.randn(n, patch_dim, generator=gen),
                                "image_grid_thw": torch.tensor(GRID)}, num_embeddings=n // 4)
            for _ in range(2 * world)]


def home_row(items, rank: int, sp: int):
    """The `HomeRow` of this rank's group: its items end to end over sp shards."""
    import numpy as np
    from ds_omni.parallelize.encoder_pool import HomeRow
    starts = np.cumsum([0] + [it.num_embeddings for it in items])
    return HomeRow(rank - rank % sp, sp, max(1, -(-int(starts[-1]) // sp)),
                   {("vision", k): np.arange(starts[k], starts[k + 1]) for k in range(len(items))})


def collate(items) -> dict:
    """Qwen2-VL's collate: patches end to end, grids stacked."""
    import torch
    return {"pixel_values": torch.cat([it.inputs["pixel_values"] for it in items]),
            "image_grid_thw": torch.stack([it.inputs["image_grid_thw"] for it in items])}


def _dummy(encoder):
    import torch
    return 0.0 * encoder(encoder.dummy_inputs(torch.device("cpu"), torch.float32)).sum()


def encode_off(encoder, items, rank: int, sp: int, group) -> None:
    """Each row's items inside its own group (at sp = 1: on its own rank)."""
    from ds_omni.parallel.reshard import ItemSlots, ReshardEmbeddings, plan_reshard
    if not items:  # nothing in the row: the zero-weight dummy pass (ZeRO-3 runs it)
        _dummy(encoder).backward()
        return
    if sp == 1:
        encoder(collate(items)).square().sum().backward()
        return
    row = home_row(items, rank, sp)
    slots = [ItemSlots("vision", k, row.positions[("vision", k)], float(it.num_embeddings))
             for k, it in enumerate(items)]
    plan = plan_reshard(slots, sp, row.shard_len, ["vision"])[rank % sp]
    todo = [items[k] for k in plan.encode.get("vision", [])]
    rows = ReshardEmbeddings.apply(encoder(collate(todo)), plan, group)  # [shard's rows, D]
    rows.square().sum().backward()


def encode_pooled(encoder, items, rank: int, world: int, sp: int) -> None:
    """One round as `EncoderPool.place` and `EmbeddingRouter.embed_shard` run it."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from ds_omni.batch import EncodedItem
    from ds_omni.parallelize.encoder_pool import exchange_inputs, item_meta, plan_round
    from ds_omni.parallel.reshard import ReshardEmbeddings
    row = home_row(items, rank, sp)
    shards = {k: tuple(np.bincount(p // row.shard_len, minlength=sp).tolist()) if sp > 1 else ()
              for (_, k), p in row.positions.items()}
    mine = [item_meta(row.start, "vision", k, it, float(it.num_embeddings), shards[k])
            for k, it in enumerate(items)] if rank == row.start else []
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)  # training gathers once per step, not per round
    plan = plan_round([it for r in everyone for it in r], world, ["vision"])
    received = exchange_inputs(plan, rank, {"vision": items}, None, torch.device("cpu"))
    todo = [items[plan.items[i].index] if rank in plan.items[i].group
            else EncodedItem(inputs=received[i], num_embeddings=plan.items[i].rows)
            for i in plan.encodes(rank)]
    assert todo, "every rank encodes a share of a skewed round"
    rows = ReshardEmbeddings.apply(encoder(collate(todo)), plan.reshard(rank, row), None)
    rows.square().sum().backward()  # also on a rank with no row home: the backward all-to-all


def ranks(rank: int, world: int, rounds: int, warmup: int, sp: int = 1) -> dict:
    import torch
    import torch.distributed as dist
    from benchmarks.long_short_sp import slowest_rank_rounds, vision_encoder
    torch.set_num_threads(1)
    encoder = vision_encoder()
    items = round_items(world, rank, sp)
    group = None
    if sp > 1:  # every rank creates every SP group, in the same order
        group = [dist.new_group(list(range(s, s + sp))) for s in range(0, world, sp)][rank // sp]
    variants = {"off": lambda: encode_off(encoder, items, rank, sp, group),
                "dp": lambda: encode_pooled(encoder, items, rank, world, sp)}
    times = slowest_rank_rounds(variants, rounds, warmup,
                                after=lambda: encoder.zero_grad(set_to_none=True))
    return {"times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.harness import run_on_ranks
    (res, *_) = run_on_ranks(ranks, args.world, args=(args.rounds, args.warmup, args.sp),
                             timeout=3000)
    out = {"world": args.world, "sp": args.sp, "rounds": args.rounds, "grid": GRID,
           "images_on_rank0": 2 * args.world, "load_avg": os.getloadavg()[0]}
    for clock, t in res["times"].items():
        ratios = [o / p for o, p in zip(t["off"], t["dp"])]
        out[clock] = {"median_round_s": {k: statistics.median(v) for k, v in t.items()},
                      "speedup_median": statistics.median(ratios), "ratios": ratios}
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"encoder_pool_w{args.world}" + (f"_sp{args.sp}" if args.sp > 1 else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] if k not in ("wall", "cpu") else
                      {m: out[k][m] for m in ("median_round_s", "speedup_median")}
                      for k in ("world", "sp", "wall", "cpu", "load_avg")}, indent=1))


if __name__ == "__main__":
    main()
