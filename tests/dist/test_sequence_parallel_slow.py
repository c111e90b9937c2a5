"""The slow tier of `test_sequence_parallel.py`, through its config and checks (loss, first
gradients, parameters after 3 steps against the one-process oracle), in one launch of 2 ranks:

- a tiny Qwen3-VL (deepstack levels added after the LLM's first layers) under Ulysses SP=2 and
  ZeRO-3: the real all-to-all carries each image's rows with their levels side by side. The
  planted error "deepstack_levels_dropped" (the ranks skip adding the levels, tests/plants/)
  must fail the check. The quick tier checks the same path in one process
  (tests/unit/model/test_deepstack.py: the shards' embeddings and levels after a simulated all-to-all
  equal the whole row's);
- the per-sequence SP degree (`parallel.max_sequence_sp` 2) under ZeRO-2, which reduces
  gradients at every backward in the order their hooks fire, so every rank's backward must reach
  the same parameters while a block and lone ranks train different micro-batches; the quick tier
  runs it under ZeRO 1 and 3 (sequence_parallel/per_sequence.py's PER_SEQUENCE).
"""

from __future__ import annotations

import pytest

from tests import oracle, plants
from tests.dist.sequence_parallel.harness import STEPS, check_case, make_config
from tests.dist.sequence_parallel.per_sequence import check_per_sequence, per_sequence_config
from tests.fixtures import ds_config, long_source, text_source
from tests.harness import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1500)]

DEEPSTACK_STAGE = 3
PER_SEQUENCE_STAGE = 2
WORLD = 2


def _ranks(rank, world, families, out_dir, long) -> dict:
    out = {}
    for plant in (None, *plants.for_launch("sp_slow")):  # the honest case, then each plant
        cfg = make_config(families["qwen3_vl"], f"{out_dir}/{plant or 'qwen3_vl'}", sp=2,
                          reorder=False)
        out[plant or "qwen3_vl"] = oracle.train_on_rank(rank, world, cfg,
                                                       ds_config(DEEPSTACK_STAGE), STEPS, plant)
    cfg = per_sequence_config(families, "llava", f"{out_dir}/per_sequence", world, long)
    out["per_sequence"] = oracle.train_on_rank(rank, world, cfg, ds_config(PER_SEQUENCE_STAGE),
                                               STEPS)
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    from tests import family_dirs
    tmp = tmp_path_factory.mktemp("sp_slow")
    families = {"llava": {},
                "qwen3_vl": {"model_dir": str(family_dirs.make_generic_dir(tmp / "q3", "qwen3_vl")),
                             "sources": [{"name": "shapes", "path": "builtin:shapes"},
                                         text_source(tmp)]}}
    long = long_source(tmp, weight=0.3, words=300)
    results = run_on_ranks(_ranks, WORLD, args=(families, str(tmp / "sp"), long), timeout=1200)
    return families, long, tmp, results


def test_deepstack_under_sequence_parallelism(launch):
    families, _, tmp, results = launch
    cfg = make_config(families["qwen3_vl"], str(tmp / "ref_qwen3_vl"), sp=1, reorder=False)
    check_case(f"qwen3_vl-zero{DEEPSTACK_STAGE}-w{WORLD}", cfg, 1,
               [r["qwen3_vl"] for r in results])


@pytest.mark.parametrize("plant", plants.for_launch("sp_slow"))
def test_plant_is_caught(plant, launch):
    families, _, tmp, results = launch
    cfg = make_config(families["qwen3_vl"], str(tmp / f"ref_{plant}"), sp=1, reorder=False)
    with pytest.raises(AssertionError, match=plant):  # the oracle's comparison names the case
        check_case(plant, cfg, 1, [r[plant] for r in results])


def test_per_sequence_sp_under_zero2(launch):
    families, long, tmp, results = launch
    cfg = per_sequence_config(families, "llava", str(tmp / "ref_per_sequence"), WORLD, long)
    check_per_sequence(f"per_sequence-llava-zero{PER_SEQUENCE_STAGE}-w{WORLD}", cfg, WORLD,
                       [r["per_sequence"] for r in results])
