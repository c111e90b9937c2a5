"""Slow tier: resume on other numbers of ranks than the quick tier's 2 -> 1, with that test's
own functions and checks (tests/dist/test_fault_tolerance.py, which keeps the mechanism in the
quick tier: DeepSpeed's universal checkpoint, re-partitioned, and the elastic data position).

Each `old -> new` of RESIZES trains ZeRO 1 and 3 runs (budget reordering, a changing mixing
schedule) on `old` ranks, saves after 2 steps, resumes on `new` ranks, and checks the fp32
weights, Adam moments (each to its own scale), step counts and LR right after the load and that
every row of the data is trained once. The ranks start once per world size: one launch saves on
1 rank, one on 4, and one of 2 ranks resumes both.
"""

import pytest

from tests.dist import test_fault_tolerance as ft
from tests.harness import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1500)]

STAGES = (1, 3)
RESIZES = ((1, 2), (4, 2))


def _each_run(rank, world, fn, runs):
    """`fn` (`_resize_save` or `_resize_load`) on this rank for each run (root, sources)."""
    return [fn(rank, world, root, sources, STAGES) for root, sources in runs]


@pytest.fixture(scope="module")
def resized(tmp_path_factory) -> dict:
    """(old, new) -> (sources, rank 0's saved states, every new rank's resumed states)."""
    runs = {}
    for old, new in RESIZES:
        root = tmp_path_factory.mktemp(f"resize_{old}_{new}")
        runs[old, new] = (str(root), ft._resize_sources(root))
    saved = {}
    for old in sorted({old for old, _ in RESIZES}):
        mine = [r for r in RESIZES if r[0] == old]
        got = run_on_ranks(_each_run, old, args=(ft._resize_save, [runs[r] for r in mine]),
                           timeout=900)[0]
        saved.update(zip(mine, got))
    out = {}
    for new in sorted({new for _, new in RESIZES}):
        mine = [r for r in RESIZES if r[1] == new]
        per_rank = run_on_ranks(_each_run, new, args=(ft._resize_load, [runs[r] for r in mine]),
                                timeout=900)
        for i, r in enumerate(mine):
            out[r] = (runs[r][1], saved[r], [ranks[i] for ranks in per_rank])
    return out


@pytest.mark.parametrize("old,new", RESIZES)
def test_resume_on_another_number_of_ranks(resized, old, new):
    sources, saved, resumed = resized[old, new]
    assert all(r[s]["after"] == resumed[0][s]["after"] for r in resumed for s in STAGES)
    ft._check_resize(saved, resumed[0], sources)
