"""By hand (not in the suite, whose time is spent): a tiny Qwen3-VL (deepstack levels added after
the LLM's first layers) trained on 2 ranks under Ulysses SP=2 equals one process, with the checks
of `test_sequence_parallel.py` (loss, first gradients, parameters after 3 steps).

    python -m tests.dist.deepstack_sp_check [zero stage, default 3] [drop]

`drop` plants an error: the ranks skip adding the levels, and the check must fail.

The suite checks the same path in one process (`tests/unit/test_deepstack.py`: the shards'
embeddings and levels after a simulated all-to-all equal the whole row's); this runs the real
all-to-all, Ulysses attention and ZeRO.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests import oracle
from tests.dist.test_sequence_parallel import STEPS, _check_case, make_config
from tests.fixtures import ds_config, text_source
from tests.harness import run_on_ranks


def _ranks(rank, world, family, stage, out_dir, drop):
    if drop:
        from ds_omni.model import omni
        omni.Deepstack.add = lambda self, hidden, level: hidden
    cfg = make_config(family, out_dir, sp=2, reorder=False)
    return oracle.train_on_rank(rank, world, cfg, ds_config(stage), STEPS)


def main(stage: int = 3, drop: bool = False) -> None:
    from tests import family_dirs
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        family = {"model_dir": str(family_dirs.make_generic_dir(tmp / "q3", "qwen3_vl")),
                  "sources": [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]}
        results = run_on_ranks(_ranks, 2, timeout=600,
                               args=(family, stage, str(tmp / "sp"), drop))
        cfg = make_config(family, str(tmp / "ref"), sp=1, reorder=False)
        _check_case(f"qwen3_vl-zero{stage}-w2", cfg, 1, results)
    print(f"qwen3_vl deepstack under SP=2, ZeRO-{stage}: equal to one process")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, "drop" in sys.argv[2:])
