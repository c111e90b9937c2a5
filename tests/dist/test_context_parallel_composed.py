"""Ring attention (parallel.cp) beside tensor and expert parallelism equals one process, exactly.

One 4-rank launch (slow tier), ranks started once for every case, each against the oracle
(`tests/oracle/`: loss rel 1e-6 every step, every step's reduced gradients, the parameters):
- "tp2_cp2": LLaVA, tp=2 x cp=2 (dp=1) under ZeRO-1, 3 steps. TP rank t's sequence ranks are t
  and t + 2, its ring [t, t + 2] (`ParallelPlan.cp_group_ranks`): each ring passes the key/value
  blocks of its TP rank's heads. Shown to run: AutoTP's 10 column and 4 row layers on every rank,
  each TP rank's ring split the rows (`oracle.assert_split_work` over its slice: each target
  once, different zigzag shards, cp - 1 ring passes in every layer of every row).
- "ep2_cp2": the MoE LLM of `test_expert_parallel` (Qwen3-MoE, 4 experts, top-2, HF's aux loss)
  at dp=2 x cp=2, ep=2 (EP groups [0, 1], [2, 3]: each a ring) under ZeRO-2, 3 steps, AutoEP's
  shards gathered into HF's layout. Each rank sums a sample's router statistics at its tokens'
  zigzag positions and the row's ranks add them (`moe_aux.sp_aux_sum` with the row index): one
  aux reduction per split row, the ring in every layer, AutoEP's blocks routing tokens.
`test_plant_is_caught`: rings drawn across TP ranks, and the aux statistics read as contiguous
shards (`tests/plants/`), each fail the oracle (one step each).
"""

import pytest

from tests import oracle, plants
from tests.dist.sequence_parallel.harness import make_config as sp_config
from tests.dist.test_expert_parallel import hf_layout, make_config as moe_config
from tests.dist.test_tensor_parallel import _in_tp_slice
from tests.fixtures import ds_config
from tests.harness import run_on_ranks
from tests.oracle import ranks as oracle_ranks

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]

STEPS, WORLD = 3, 4
# case -> (ZeRO stage, steps, plant)
CASES = {"tp2_cp2": (1, STEPS, None), "ep2_cp2": (2, STEPS, None),
         **{p: (1, 1, p) for p in plants.for_launch("tp_cp")},
         **{p: (2, 1, p) for p in plants.for_launch("ep_cp")}}
BASE = {**{p: "tp2_cp2" for p in plants.for_launch("tp_cp")},
        **{p: "ep2_cp2" for p in plants.for_launch("ep_cp")}}


def config(name: str, out_dir: str, reference: bool = False):
    """The case's config (`reference`: its one-process twin, cp, tp and ep 1)."""
    if BASE.get(name, name) == "tp2_cp2":
        cfg = sp_config({}, out_dir, sp=1, reorder=False)
        cfg.parallel.tp = 1 if reference else 2
    else:
        cfg = moe_config(out_dir, 1 if reference else 2)
    cfg.parallel.cp = 1 if reference else 2
    return cfg


def _ranks(rank, world, out_dir):
    results = {}
    for name, (stage, steps, plant) in CASES.items():
        cfg = config(name, f"{out_dir}/{name}")
        if BASE.get(name, name) == "tp2_cp2":
            results[name] = oracle.train_on_rank(rank, world, cfg, ds_config(stage), steps, plant)
            continue
        seen = {}
        with hf_layout(seen):
            results[name] = oracle.train_on_rank(rank, world, cfg, ds_config(stage), steps, plant,
                                                 read_params=oracle_ranks.full_params)  # patched
        results[name]["seen"] = seen
    return results


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_composed")
    return run_on_ranks(_ranks, WORLD, args=(str(out),), timeout=1200)


def _check(name, results, tmp_path):
    """The oracle's comparison of case `name`: the ranks of a row trained its samples, the
    global batch is the reference's; loss, gradients, parameters match."""
    from ds_omni.model.build import build_model
    steps = CASES[name][1]
    per_rank = [r[name] for r in results]
    cfg = config(name, str(tmp_path / f"ref_{name}"), reference=True)
    row = 4 if BASE.get(name, name) == "tp2_cp2" else 2  # the ranks of one row: cp (x tp)
    want = oracle.reference_step_keys(cfg, build_model(cfg.model), WORLD // row, steps)
    for step in range(steps):
        assert all(r["keys"][step] == per_rank[g]["keys"][step]
                   for g in range(0, WORLD, row) for r in per_rank[g:g + row]), name
        got = sorted(k for r in per_rank[::row] for k in r["keys"][step])
        assert got == want[step], f"{name} step {step}: the ranks trained another batch"
    ref = oracle.run_reference(cfg, want)
    oracle.assert_matches(ref, per_rank[0], name)
    assert all(r["losses"] == per_rank[g]["losses"]
               for g in range(0, WORLD, row) for r in per_rank[g:g + row]), name
    return ref, per_rank


@pytest.mark.dist
def test_tp2_x_cp2_matches_single_process(launch, tmp_path):
    ref, per_rank = _check("tp2_cp2", launch, tmp_path)
    for t in range(2):  # TP rank t's ring: global ranks t, t + 2
        oracle.assert_split_work(ref, [_in_tp_slice(r) for r in per_rank[t::2]],
                                 f"tp2_cp2 TP rank {t}")
    for rank, r in enumerate(per_rank):
        assert r["tp_counts"] == {"column": 10, "row": 4}, (rank, r["tp_counts"])
        assert r["sp"]["sp_ring_steps"] > 0, (rank, r["sp"])
    oracle.assert_moved(ref, "tp2_cp2")


@pytest.mark.dist
def test_ep2_x_cp2_matches_single_process(launch, tmp_path):
    ref, per_rank = _check("ep2_cp2", launch, tmp_path)
    oracle.assert_split_work(ref, per_rank, "ep2_cp2")
    assert sum(r["sp_rows"] for r in per_rank) > 0, "no row ran split"
    for rank, r in enumerate(per_rank):
        assert r["sp"]["sp_aux_reductions"] == r["sp_rows"], (rank, r["sp"], r["sp_rows"])
        assert r["sp"]["sp_ring_steps"] > 0, (rank, r["sp"])
        assert r["seen"]["autoep_layers"] == 2 and r["seen"]["routed"] > 0, (rank, r["seen"])
    oracle.assert_moved(ref, "ep2_cp2")


def test_every_plant_has_a_case():
    assert sorted(BASE) == sorted(plants.for_launch("tp_cp") + plants.for_launch("ep_cp"))


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("tp_cp") + plants.for_launch("ep_cp"))
def test_plant_is_caught(plant, launch, tmp_path):
    with pytest.raises(AssertionError, match="losses|grad of"):
        _check(plant, launch, tmp_path)
