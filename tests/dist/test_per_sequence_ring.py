"""Per-sequence blocks past the heads equal one process, exactly: an LLM of 2 query heads (1 KV
head) and parallel.max_sequence_sp=4, so a long sequence's block of 4 runs Ulysses over 2 ranks
inside and a ring of 2 across (`ParallelPlan.block_split`). One launch of 4 ranks, started once,
looping over its cases (3 steps each), each against the oracle (`tests/oracle/`: loss rel 1e-6
every step, the reduced gradients, the final parameters) with the evidence of the ring: every
block-of-4 row was cut zigzag and made cp - 1 ring passes in every decoder layer
(`sp_ring_steps`), blocks of 2 (Ulysses alone) none.

Cases: ZeRO-2; ZeRO-1 and ZeRO-3 with the encoder pool and long-short SP (the long sequences'
images split over their block); the plant `block_ring_transposed`, which the oracle must catch
on the loss. Slow tier: a 4-rank launch costs about 80 s of CPU, its start-up most of it (more than
the quick tier's ~20 s); the split rule and the block's groups are checked in one process
(tests/unit/parallel/test_block_split.py).
"""

import pytest

from tests import oracle, plants
from tests.dist.sequence_parallel.harness import STEPS
from tests.dist.sequence_parallel.per_sequence import check_per_sequence, per_sequence_config
from tests.fixtures import TINY_LLAMA, ds_config, long_source
from tests.harness import run_on_ranks

WORLD, PACK = 4, 128  # long samples (~380 tokens) need 3 micro-batches: a block of 4
TWO_HEADS = {**TINY_LLAMA, "num_attention_heads": 2, "num_key_value_heads": 1}
#        (ZeRO, encoder pool and long-short SP, plant)
CASES = [(2, False, None), (1, True, None), (3, True, None),
         *((2, False, p) for p in plants.for_launch("ring_block"))]


def case_name(case) -> str:
    stage, pool, plant = case
    return f"zero{stage}{'-pool-split' if pool else ''}{'-' + plant if plant else ''}"


def case_config(out_dir: str, long: dict, case):
    cfg = per_sequence_config({"llava": {}}, "llava", out_dir, WORLD, long)
    cfg.model.llm.config = dict(TWO_HEADS)
    cfg.data.pack_tokens = PACK
    if case[1]:
        cfg.parallel.encoder_pool, cfg.parallel.encoder_sp = "dp", 0.0
    return cfg


def _ranks(rank, world, long, out_dir, cases, steps) -> dict:
    out = {}
    for case in cases:
        cfg = case_config(f"{out_dir}/{case_name(case)}", long, case)
        out[case_name(case)] = oracle.train_on_rank(rank, world, cfg, ds_config(case[0]), steps,
                                                    plant=case[2])
    return out


def check_rings(name: str, per_rank: list[dict]) -> None:
    """Blocks of 4 ran the ring (zigzag rows, cp - 1 = 1 pass a decoder layer each), blocks of
    2 did not; every rank of a block-of-4 row passed as many blocks as its layers."""
    ring_rows = 0
    for rank, r in enumerate(per_rank):
        mine = [(group[1], bool(more["slots"]))  # (block size, cut zigzag) of each block row
                for _, _, group, _, _, more in r["shards"] if group]
        assert all(zigzag == (size == 4) for size, zigzag in mine), (name, rank, mine)
        rows = sum(size == 4 for size, _ in mine)
        ring_rows += rows
        got = r["sp"]["sp_ring_steps"]
        assert got == r["ulysses_per_row"] * rows, (
            f"{name} rank {rank}: {got} ring passes for {rows} rows on blocks of 4 x "
            f"{r['ulysses_per_row']} layer calls: a block's ring step was skipped")
        assert (r["sp"]["sp_ring_bytes"] > 0) == (rows > 0), (name, rank, r["sp"])
    assert ring_rows >= WORLD, f"{name}: no long sequence ran on a block of 4 ({ring_rows} shards)"


def check(case, long, tmp, per_rank, steps: int) -> None:
    name = case_name(case)
    cfg = case_config(str(tmp / f"ref_{name}"), long, case)
    check_per_sequence(name, cfg, WORLD, per_rank, steps, pooled=case[1])
    check_rings(name, per_rank)
    if case[1]:  # long-short SP: the long sequences' images were split over their blocks
        assert sum(r["long_items"] for r in per_rank) > 0, name


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ring_block")
    long = long_source(tmp, weight=0.3, words=300)
    results = run_on_ranks(_ranks, WORLD, args=(long, str(tmp / "run"), CASES, STEPS),
                           timeout=900)
    return long, tmp, results


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if not c[2]], ids=case_name)
def test_block_past_heads_matches_single_process(case, launch):
    long, tmp, results = launch
    check(case, long, tmp, [r[case_name(case)] for r in results], STEPS)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("ring_block"))
def test_plant_is_caught(plant, launch):
    """The checks of the honest cases fail with the plant in, on the loss (its steps have
    blocks of 4, as the honest cases': `check_per_sequence` asserts that before the loss)."""
    long, tmp, results = launch
    case = next(c for c in CASES if c[2] == plant)
    with pytest.raises(AssertionError, match=r"losses \["):
        check(case, long, tmp, [r[case_name(case)] for r in results], STEPS)
