"""By-hand check (not in the suite): PP=4 on 4 ranks trains as one process, in both placements.

    PYTHONPATH=$PWD .venv/bin/python -m tests.dist.pp4_check      # about 2-4 minutes on 2 cores

The suite's pipeline cases run PP=2 and DP2 x PP2 (`tests/dist/pipeline.py`); this runs the tiny
LLaVA with 6 decoder layers (so the cost model chooses the boundaries: 4 layers would force one a
stage) over 4 stages, "stage0" and "uniform", 3 steps of 4 micro-batches of one sample (text-only
samples among them), ZeRO-1. It compares the losses with a PP=1 DeepSpeed run of the same config on
one rank, and the losses, first-step gradients and final parameters (every stage's own, merged)
with the one-process oracle (`tests/oracle.py`), at the suite's tolerances. Prints the losses;
exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

STEPS, LAYERS = 3, 6
PLACEMENTS = ("stage0", "uniform")


def _config(out_dir: str, text: dict, pp: int, placement: str = "stage0"):
    from ds_omni.config import ParallelConfig, SourceConfig, from_dict
    from tests.fixtures import tiny_config
    cfg = tiny_config(out_dir, steps=STEPS, global_batch_size=4, micro_batch_size=1)
    cfg.model.llm.config["num_hidden_layers"] = LAYERS
    cfg.data.sources = [from_dict(SourceConfig, s)
                        for s in ({"name": "shapes", "path": "builtin:shapes"}, text)]
    cfg.parallel = ParallelConfig(pp=pp, encoder_placement=placement)
    return cfg


def _ranks(rank: int, world: int, out_dir: str, text: dict) -> dict:
    from tests import oracle
    from tests.fixtures import ds_config
    got = {}
    for placement in PLACEMENTS:
        cfg = _config(f"{out_dir}/{placement}_pp{world}", text, world, placement)
        got[placement] = oracle.train_on_rank(rank, world, cfg, ds_config(1), STEPS)
        if world == 1:
            break  # one placement is the whole model on one rank
    return got


def main() -> int:
    from ds_omni.model.build import build_model
    from tests import oracle
    from tests.fixtures import text_source
    from tests.harness import run_on_ranks
    failed = 0
    with tempfile.TemporaryDirectory(prefix="ds_omni_pp4_") as tmp:
        text = text_source(Path(tmp))
        pp4 = run_on_ranks(_ranks, 4, args=(tmp, text), timeout=900)
        pp1 = run_on_ranks(_ranks, 1, args=(tmp, text), timeout=600)[0]["stage0"]
        cfg = _config(f"{tmp}/ref", text, 1)
        keys = oracle.reference_step_keys(cfg, build_model(cfg.model), 1, STEPS)
        ref = oracle.run_reference(cfg, keys)
        print(f"oracle losses    {ref.losses}\nPP=1 losses      {pp1['losses']}")
        for placement in PLACEMENTS:
            ranks = [r[placement] for r in pp4]
            got = oracle.merge_stages(ranks)
            print(f"PP=4 {placement:8s}    {got['losses']}  max rel. to PP=1 "
                  f"{max(abs(a - b) / abs(b) for a, b in zip(got['losses'], pp1['losses'])):.1e}")
            try:
                assert [sorted(k for k in r["keys"][s]) for r in ranks[:1]
                        for s in range(STEPS)] == keys, "another global batch"
                assert all(r["losses"] == got["losses"] for r in ranks), "stages disagree"
                oracle.assert_matches(ref, got, f"PP=4 {placement}")
                print(f"  {placement}: loss, gradients and parameters match the oracle")
            except AssertionError as e:
                failed += 1
                print(f"  {placement}: MISMATCH: {str(e)[:400]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
