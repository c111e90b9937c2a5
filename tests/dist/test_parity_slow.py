"""By hand (not in the suite, for its time): the encoder pool (`parallel.encoder_pool: "dp"`) on
more families and ranks than the suite's 2-rank LLaVA / composition cases, with test_parity's own
config, launch and checks (3 steps, fp32, against the one-process oracle of tests/oracle.py: loss
1e-6 rel, first-step gradients, parameters 1e-5 rel).

    PYTHONPATH=$PWD .venv/bin/python -m tests.dist.encoder_pool_check [2] [4]

2: Qwen2-VL (a variable number of patches per image; `image_grid_thw` travels with the patches)
   and LLaVA-NeXT (tiles + `image_sizes`) on 2 ranks, ZeRO-3.
4: the demo LLaVA on 4 ranks, ZeRO-3, micro-batches of 4 samples (so rank 0's 4 images a round
   spread one to each rank).
Every case reads a skewed source: the rows of data-parallel rank 0 hold every image, the other
ranks' rows are text alone, so each round the pool moves most of rank 0's items away; the check
also asserts that every other rank encoded some of them.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from tests.data_files import skewed_source
from tests.dist.test_parity import _check, _train_ranks
from tests.harness import run_on_ranks

POOL = {"pool": True, "steps": 3, "reorder": {"mode": "loader_order"}}


def cases(tmp: Path, world: int) -> dict:
    from tests import family_dirs
    if world == 4:  # 4 images a round on rank 0: one for each rank
        skewed = skewed_source(tmp / "skewed", dp=world, rows=64)
        return {"pool_llava_w4": {"stages": [3], "sources": [skewed], **POOL,
                                  "train": {"global_batch_size": 16, "micro_batch_size": 4}}}
    skewed = skewed_source(tmp / "skewed", dp=world)
    return {
        "pool_qwen2_vl": {"stages": [3], "sources": [skewed], **POOL,
                          "model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q"))},
        "pool_llava_next": {"stages": [3], "sources": [skewed], **POOL,
                            "model_dir": str(family_dirs.make_llava_next_dir(tmp / "n"))}}


def check(world: int) -> float:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        launch = cases(tmp, world)
        results = run_on_ranks(_train_ranks, world, args=(launch, str(tmp / "dp")), timeout=900)
        for name, case in launch.items():
            _check(name, case, results, tmp, dp=None)  # asserts ranks 1.. encoded rank 0's items
            moved = [r[(name, case["stages"][0])]["pool_items_moved"] for r in results]
            print(f"{name} ({world} ranks, ZeRO-{case['stages'][0]}): equal to one process; "
                  f"items encoded for another rank, per rank: {moved}", flush=True)
    return time.monotonic() - t0


if __name__ == "__main__":
    for w in sys.argv[1:] or ["2", "4"]:
        print(f"{w} ranks: done in {check(int(w)):.0f} s", flush=True)
