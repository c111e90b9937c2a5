"""By hand (not in the suite, whose time is spent): a tiny Qwen3.5 (a gated delta net layer, run
once per sample of each packed row, and an attention layer) trained on 2 data-parallel ranks
under ZeRO equals one process (loss, first gradients, parameters after 3 steps), with the checks
of `test_sequence_parallel.py`. Under ZeRO-3 the per-sample layer runs several times in one
forward, each time gathering its parameters.

    python -m tests.dist.per_sample_check [zero stage, default 3] [drop]

`drop` plants an error: the ranks run the gated delta net over the whole row (one sample's state
flows into the next), and the check must fail.

The suite checks one process (`tests/unit/test_per_sample.py`: a training step on a packed row
equals HF per sample).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests import oracle
from tests.dist.test_sequence_parallel import STEPS, make_config
from tests.fixtures import ds_config, text_source
from tests.harness import run_on_ranks


def _ranks(rank, world, family, stage, out_dir, drop):
    if drop:
        from ds_omni.model import omni, per_sample
        omni.run_per_sample = lambda layer, hidden, kwargs: layer(hidden, **{
            k: v for k, v in kwargs.items() if k not in (*per_sample._ROW_ONLY, "cu_seqlens")})
    cfg = make_config(family, out_dir, sp=1, reorder=False)
    return oracle.train_on_rank(rank, world, cfg, ds_config(stage), STEPS)


def main(stage: int = 3, drop: bool = False) -> None:
    from tests import family_dirs
    from ds_omni.model.build import build_model
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        family = {"model_dir": str(family_dirs.make_generic_dir(tmp / "q35", "qwen3_5")),
                  "sources": [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]}
        per_rank = run_on_ranks(_ranks, 2, timeout=600,
                                args=(family, stage, str(tmp / "dp"), drop))
        cfg = make_config(family, str(tmp / "ref"), sp=1, reorder=False)
        name = f"qwen3_5-zero{stage}-dp2"
        want_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), 2, STEPS)
        for step in range(STEPS):
            got = sorted(k for r in per_rank for k in r["keys"][step])
            assert got == want_keys[step], f"{name} step {step}: the ranks trained another batch"
        ref = oracle.run_reference(cfg, want_keys)
        oracle.assert_matches(ref, per_rank[0], name)
        assert per_rank[1]["losses"] == per_rank[0]["losses"], name
        oracle.assert_moved(ref, name)
    print(f"qwen3_5 (per-sample gated delta net) on 2 ranks, ZeRO-{stage}: equal to one process")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, "drop" in sys.argv[2:])
