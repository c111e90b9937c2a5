"""The composition table's pairs the quick tier had no launch for, against one process, in one
4-rank launch (ranks started once, the cases in a loop; the full matrix stays in the slow tier).

Cases, one step each (two for the per-sequence blocks, which need a long row), each the smallest
of its slow-tier case and checked by that case's own checks:
- "ep2_tp2" (`test_expert_parallel`): the MoE LLM's attention over tp2, its experts folded over
  ep2 x dp2, ZeRO-1: the oracle, AutoTP's layers, the fold (each TP pair splits its assignments);
- "pp2_ep2" (same): 2 stages, each its experts over its 2 ranks, encoders "uniform", ZeRO-1:
  the oracle, every stage's MoE layers added to the carried aux loss;
- "ep2_sp2_pool", "ep2_msp2" (`test_expert_sequence_parallel`): the MoE LLM over sp2 x dp2 with
  the encoder pool (dp rank 0's rows holding every image), and over blocks of max_sequence_sp
  2, experts over ep2, ZeRO-2: the oracle, each split row's aux statistics summed over its
  group, items pooled;
- "tp2_sp2" (`test_tensor_parallel`): LLaVA, SP groups one per TP rank, ZeRO-1: the oracle,
  Ulysses work split inside each TP rank's SP group;
- "tp2_pool" (same): tp2 x dp2 with the encoder pool, dp rank 0's rows holding every image:
  the oracle, items moved, both TP ranks alike;
- "tp2_msp2" (`test_tp_per_sequence`): blocks of the data-parallel ranks of one TP rank;
- "msp2_pool" (`sequence_parallel/pool.py`'s per-sequence case, its 3 steps: blocks of 2 ranks
  whose rows' images the pool encodes outside the block): max_sequence_sp x the encoder pool.
`tests/unit/config/test_composition_coverage.py` maps every pair the table lets compose to its
quick and slow cases.
"""

import pytest

from tests import oracle
from tests.dist import test_expert_parallel as ep_tests
from tests.dist import test_expert_sequence_parallel as ep_sp_tests
from tests.dist import test_tensor_parallel as tp_tests
from tests.dist import test_tp_per_sequence as tp_msp_tests
from tests.dist.sequence_parallel import pool as sp_pool
from tests.fixtures import ds_config, long_source
from tests.harness import run_on_ranks
from tests.oracle import ranks as oracle_ranks

pytestmark = pytest.mark.timeout(900)

WORLD = 4
# pp2_ep2 first: the fold leaves DeepSpeed's expert groups (module globals) drawn over tp, which
# a later AutoEP inside the engine would reuse (one process trains one plan outside tests)
EP_CASES = {"pp2_ep2": {"pp": 2, "encoder_placement": "uniform"}, "ep2_tp2": {"tp": 2}}
TP_CASES = {"tp2_sp2": {"stages": [1], "sp": 2, "steps": 1},
            "tp2_pool": {"stages": [2], "pool": True, "steps": 1}}
# ep beside SP: ZeRO-2 (ep x sp refuses 0 and 3); name -> (SP fields, steps, pooled)
EP_SP_CASES = {"ep2_sp2_pool": ({"sp": 2}, 1, True),
               "ep2_msp2": ({"max_sequence_sp": 2}, 2, False)}
MSP_STEPS = 2  # a long row per step is not certain: two steps give the blocks rows to run
MSP_POOL_STEPS = 3  # step 1 runs two blocks' rounds, where the pool moves a block's images


def _train(rank, world, tp_cases, long, skewed, msp_pool, out_dir):
    results = {"seconds": _Clock()}
    for name, degrees in EP_CASES.items():
        seen = {}
        with ep_tests.hf_layout(seen):
            results[name] = oracle.train_on_rank(
                rank, world, ep_tests.make_config(f"{out_dir}/{name}", 2, degrees=degrees),
                ds_config(1), 1, read_params=oracle_ranks.full_params)  # the patched one
        results[name]["seen"] = seen
        results["seconds"].lap(name)
    for name, (parallel, steps, pooled) in EP_SP_CASES.items():
        seen = {}
        cfg = ep_sp_tests.sp_config(f"{out_dir}/{name}", 2, parallel, long,
                                    skewed if pooled else None)
        with ep_tests.hf_layout(seen):
            results[name] = oracle.train_on_rank(rank, world, cfg, ds_config(2), steps,
                                                 read_params=oracle_ranks.full_params)
        results[name]["seen"] = seen
        results["seconds"].lap(name)
    for name, case in tp_cases.items():
        stage = case["stages"][0]
        results[(name, stage)] = oracle.train_on_rank(
            rank, world, tp_tests._config(case, f"{out_dir}/{name}"), ds_config(stage), 1)
        results["seconds"].lap(name)
    results["tp2_msp2"] = oracle.train_on_rank(
        rank, world, tp_msp_tests._config(f"{out_dir}/tp2_msp2", long), ds_config(1), MSP_STEPS)
    results["seconds"].lap("tp2_msp2")
    cfg = sp_pool.pool_per_sequence_config({"llava": {}}, "llava", f"{out_dir}/msp2_pool", msp_pool)
    with sp_pool._plans_seen() as plans:
        results["msp2_pool"] = oracle.train_on_rank(rank, world, cfg, ds_config(3), MSP_POOL_STEPS)
    results["msp2_pool"]["block_items_moved"] = sum(  # a block row's items encoded outside it
        len(p.items[i].group) > 1 for p in plans for i in p.moved())
    results["seconds"].lap("msp2_pool")
    return results


class _Clock(dict):
    """Each case's seconds on a rank, in order (the launch's budget, printed by `launch`)."""

    def __init__(self):
        import time
        super().__init__()
        self.last = time.monotonic()

    def lap(self, name: str) -> None:
        import time
        now = time.monotonic()
        self[name], self.last = round(now - self.last, 1), now


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The cases' configs' inputs and every rank's results (timed: the quick tier's budget)."""
    import time
    from tests.data_files import skewed_source
    tmp = tmp_path_factory.mktemp("pairs")
    tp_cases = {name: dict(case) for name, case in TP_CASES.items()}
    skewed = skewed_source(tmp / "skewed", dp=2)  # dp rank 0's rows hold every image
    tp_cases["tp2_pool"]["sources"] = [skewed]
    long = long_source(tmp, weight=0.3, words=300)
    (tmp / "msp_pool").mkdir()
    msp_pool = sp_pool.skewed_sources(tmp / "msp_pool")
    start = time.monotonic()
    results = run_on_ranks(_train, WORLD, timeout=600, args=(
        tp_cases, long, skewed, msp_pool, str(tmp / "runs")))
    print(f"\npairs launch: {time.monotonic() - start:.1f} s on {WORLD} ranks, rank 0's cases "
          f"{dict(results[0]['seconds'])}")
    return tp_cases, long, results, skewed, msp_pool


@pytest.mark.dist
def test_ep2_x_tp2(launch, tmp_path):
    per_rank = [r["ep2_tp2"] for r in launch[2]]
    ep_tests._check_one("ep2_tp2", per_rank, tmp_path, dp=2, tp=2, steps=1)
    ep_tests._check_folded(per_rank)


@pytest.mark.dist
def test_pp2_x_ep2_uniform(launch, tmp_path):
    per_rank = [r["pp2_ep2"] for r in launch[2]]
    ep_tests._check_one("pp2_ep2", per_rank, tmp_path, dp=2, pp=2, steps=1)
    ep_tests._check_carried(per_rank, 2, steps=1)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(EP_SP_CASES))
def test_ep2_beside_sp_with_encoder_pool(name, launch, tmp_path):
    """ep x sp with the encoder pool, and ep x max_sequence_sp: the oracle, the rows run split
    summed their aux statistics over their group, the pool moved items."""
    _, long, results, skewed, _ = launch
    per_rank = [r[name] for r in results]
    parallel, steps, pooled = EP_SP_CASES[name]
    ep_sp_tests.check_parallel(name, WORLD, parallel, per_rank, long, tmp_path, steps,
                               pool=skewed if pooled else None)
    ep_sp_tests._assert_aux_reduced(name, per_rank)
    if pooled:  # dp rank 0's rows hold every image: dp rank 1's ranks encode some
        assert sum(r["pool_items_moved"] for r in per_rank[2:]) > 0, name


@pytest.mark.dist
def test_tp2_x_sp2(launch, tmp_path):
    tp_tests._check_tp_sp("tp2_sp2", launch[0]["tp2_sp2"], launch[2], tmp_path)


@pytest.mark.dist
def test_tp2_x_encoder_pool(launch, tmp_path):
    tp_cases, _, results, _, _ = launch
    tp_tests._check("tp2_pool", tp_cases["tp2_pool"], results, tmp_path, dp=2)
    moved = [r[("tp2_pool", 2)]["pool_items_moved"] for r in results]
    assert moved[2] > 0 and moved[2] == moved[3], moved


@pytest.mark.dist
def test_tp2_x_max_sequence_sp2(launch, tmp_path):
    _, long, results, _, _ = launch
    tp_msp_tests.check_case("tp2_msp2", [r["tp2_msp2"] for r in results], long, MSP_STEPS,
                            tmp_path)


@pytest.mark.dist
def test_max_sequence_sp2_x_encoder_pool(launch, tmp_path):
    msp_pool, results = launch[4], launch[2]
    cfg = sp_pool.pool_per_sequence_config({"llava": {}}, "llava", str(tmp_path / "ref"), msp_pool)
    sp_pool._check_pool_per_sequence("msp2_pool", cfg, [r["msp2_pool"] for r in results])
