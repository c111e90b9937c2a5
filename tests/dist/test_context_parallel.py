"""Ring attention (parallel.cp) equals one process, exactly: one launch of 4 ranks (started once,
looping over its cases), each case 3 optimizer steps through DeepSpeed against the oracle
(`tests/oracle/`: loss rel 1e-6 every step, the reduced gradients, the final parameters), with
the evidence that the ring ran (`oracle.assert_split_work`: every decoder layer of every split
row made cp - 1 ring passes; targets trained once; shards differ).

Quick tier (CASES, 2 steps): sp=2 x cp=2 on Qwen2-VL (GQA, M-RoPE positions travelling with
their tokens, rows without images; ZeRO-2). Slow tier (SLOW_CASES): cp=2 under dp=2 with the
encoder pool and long-short SP (every item split over its row's ranks; LLaVA, ZeRO-1); Gemma 3
(bidirectional image blocks and sliding windows across the ring; ZeRO-2); sp2 x cp2 under ZeRO-3
with the pool and long-short SP. The kernel, the zigzag split and the planted errors of the ring
are checked in one process (tests/unit/model/test_ring_attention.py, tests/unit/parallel/).
"""

import pytest

from tests import oracle
from tests.dist.sequence_parallel.harness import STEPS, check_one_reader, make_config
from tests.fixtures import ds_config, text_source
from tests.harness import run_on_ranks

WORLD = 4
#        (family, ZeRO, sp, cp, encoder pool, encoder_sp 0)
CASES = [("qwen2_vl", 2, 2, 2, False, False)]
SLOW_CASES = [("llava", 1, 1, 2, True, True), ("gemma3", 2, 1, 2, False, False),
              ("llava", 3, 2, 2, True, True)]
QUICK_STEPS = 2


def case_name(case) -> str:
    family, stage, sp, cp, pool, split = case
    return (f"{family}-zero{stage}-sp{sp}xcp{cp}{'-pool' if pool else ''}"
            f"{'-split' if split else ''}")


def families(tmp) -> dict:
    from tests import family_dirs
    text = text_source(tmp)
    return {
        "llava": {},
        "qwen2_vl": {"model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q")),
                     "sources": [{"name": "shapes", "path": "builtin:shapes"}, text]},
        "gemma3": {"model_dir": str(family_dirs.make_generic_dir(tmp / "g3", "gemma3")),
                   "sources": [{"name": "shapes", "path": "builtin:shapes"}, text]},
    }


def case_config(family: dict, out_dir: str, case, *, reference: bool = False):
    _, _, sp, cp, pool, split = case
    cfg = make_config(family, out_dir, sp=1 if reference else sp, reorder=False)
    if not reference:
        cfg.parallel.cp = cp
        cfg.parallel.encoder_pool = "dp" if pool else "off"
        if split:
            cfg.parallel.encoder_sp = 0.0
    return cfg


def _ranks(rank, world, fams, out_dir, cases, steps) -> dict:
    out = {}
    for case in cases:
        cfg = case_config(fams[case[0]], f"{out_dir}/{case_name(case)}", case)
        out[case_name(case)] = oracle.train_on_rank(rank, world, cfg, ds_config(case[1]), steps)
    return out


def check(case, fams, tmp, per_rank, steps: int = STEPS) -> None:
    name, group = case_name(case), case[2] * case[3]
    cfg = case_config(fams[case[0]], str(tmp / f"ref_{name}"), case, reference=True)
    from ds_omni.model.build import build_model
    dp = WORLD // group
    want_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), dp, steps)
    for step in range(steps):  # the ranks of a row's sp x cp group train the same samples
        assert all(r["keys"][step] == per_rank[0]["keys"][step] for r in per_rank[:group]), name
        got = sorted(k for r in per_rank[::group] for k in r["keys"][step])
        assert got == want_keys[step], f"{name} step {step}: the ranks trained another batch"
    ref = oracle.run_reference(cfg, want_keys)
    oracle.assert_matches(ref, per_rank[0], name)
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), name
    oracle.assert_split_work(ref, per_rank, name, pooled=case[4])
    assert all(r["sp"]["sp_ring_steps"] > 0 for r in per_rank), name
    if case[5]:  # long-short SP: items really were split over the row's sp x cp ranks
        assert sum(r["long_items"] for r in per_rank) > 0, name
    check_one_reader(name, cfg, per_rank, sp=group)
    oracle.assert_moved(ref, name)


def _launch(tmp_path_factory, cases, steps):
    tmp = tmp_path_factory.mktemp("cp")
    fams = families(tmp)
    results = run_on_ranks(_ranks, WORLD, args=(fams, str(tmp / "cp"), cases, steps),
                           timeout=900)
    return fams, tmp, results


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return _launch(tmp_path_factory, CASES, QUICK_STEPS)


@pytest.fixture(scope="module")
def slow_launch(tmp_path_factory):
    return _launch(tmp_path_factory, SLOW_CASES, STEPS)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_ring_attention_matches_single_process(case, launch):
    fams, tmp, results = launch
    check(case, fams, tmp, [r[case_name(case)] for r in results], QUICK_STEPS)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=case_name)
def test_ring_attention_zero_matrix(case, slow_launch):
    fams, tmp, results = slow_launch
    check(case, fams, tmp, [r[case_name(case)] for r in results])
