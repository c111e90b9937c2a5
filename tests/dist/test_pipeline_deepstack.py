"""Deepstack levels over the pipeline's stages (`ds_omni.parallelize.pipeline_deepstack`), against
one process.

One 2-rank launch: the tiny Qwen3-VL (2 LLM layers; level 0 added before layer 1, level 1
before the final norm) over 2 stages, ZeRO-1, the encoder placements ("stage0": stage 0 encodes;
"uniform" and "bubbles": each stage encodes a share, the rows with their levels side by side sent
to stage 0; "bubbles" in loader order, its work shown to run in the schedule's idle slots),
2 steps of 4 micro-batches with text-only rows among them, one decoder layer a stage
(parallel.stage_split "layers": the cost model puts both on stage 0). The oracle (`tests/oracle/`) must
match the losses (1e-6 relative), every step's reduced gradients (the deepstack mergers' and the
encoders' included) and the final parameters. Evidence: stage 1 added the levels it received
(`DeepstackCarry.levels_added`), stage 0 none. The plant "pp_deepstack_level_dropped" (stage 1
receives level 0 as zeros) must fail the check.

A 4-rank launch: the same under pp2 x sp2 (each SP shard's levels its own: shard positions) in
both placements, checked the same way (the SP work shown, as test_pipeline_composed); and under
pp2 x tp2 (stage 0 encodes; the TP work shown, the q/k norms whole). Qwen3-VL-MoE
under pp2 x ep2 (the levels beside the carried aux statistics): test_expert_parallel.py.
"""

import pytest

from tests import family_dirs, oracle, plants
from tests.dist.test_pipeline_composed import _config, _train_ranks, check
from tests.fixtures import text_source
from tests.harness import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1500)]


def _cases(tmp) -> dict:
    sources = [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]
    model = str(family_dirs.make_generic_dir(tmp / "q3", "qwen3_vl"))
    honest = {f"qwen3_vl_{p}": {"zero": 1, "sources": sources, "steps": 2, "placement": p,
                                "model_dir": model, "stage_split": "layers"}
              for p in ("stage0", "uniform", "bubbles")}
    honest["qwen3_vl_bubbles"]["reorder"] = {"mode": "loader_order"}  # items in later micro-batches
    assert plants.for_launch("pp_deepstack") == ["pp_deepstack_level_dropped"]
    return {**honest, "pp_deepstack_level_dropped": {**honest["qwen3_vl_stage0"], "steps": 1,
                                                     "plant": "pp_deepstack_level_dropped"}}


def _launch(tmp_path_factory, name: str, cases_of, world: int) -> tuple[dict, list]:
    """(the cases, each rank's results): one launch of `world` ranks over every case."""
    tmp = tmp_path_factory.mktemp(name)
    cases = cases_of(tmp)
    return cases, run_on_ranks(_train_ranks, world, args=(cases, str(tmp / "runs")), timeout=1200)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, "pp_deepstack", _cases, 2)


def test_pipeline_carries_deepstack_levels(two_ranks, tmp_path):
    """Every placement equals one process; layer 1 (and the norm) on stage 1, which added the
    levels stage 0 received."""
    cases, results = two_ranks
    for name, case in cases.items():
        if "plant" in case:
            continue
        assert results[0][name]["parts"] == [0, 2, 4], results[0][name]["parts"]
        added = [r[name]["deepstack_levels_added"] for r in results]
        assert added[0] == 0 and added[1] > 0, (name, added)
        check(name, case, results, _config(case, str(tmp_path / f"ref_{name}")))


def _four_rank_cases(tmp) -> dict:
    sources = [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]
    base = {"zero": 1, "sources": sources, "steps": 2, "stage_split": "layers"}
    qwen = str(family_dirs.make_generic_dir(tmp / "q3", "qwen3_vl"))
    cases = {f"qwen3_vl_pp2_sp2_{p}": {**base, "sp": 2, "placement": p, "model_dir": qwen}
             for p in ("stage0", "uniform")}
    return {**cases, "qwen3_vl_pp2_tp2": {**base, "tp": 2, "model_dir": qwen}}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, "pp_deepstack_4", _four_rank_cases, 4)


def test_pipeline_carries_deepstack_levels_beside_sp(four_ranks, tmp_path):
    """pp2 x sp2 (both placements) equals one process; stage 1 (ranks 2, 3) added levels,
    stage 0 none."""
    cases, results = four_ranks
    for name, case in cases.items():
        if "sp" not in case:
            continue
        added = [r[name]["deepstack_levels_added"] for r in results]
        # stage 1's (its SP shards: where the row's image tokens fall, here the first)
        assert added[:2] == [0, 0] and sum(added[2:]) > 0, (name, added)
        check(name, case, results, _config(case, str(tmp_path / f"ref_{name}")))


def test_pipeline_carries_deepstack_levels_beside_tp(four_ranks, tmp_path):
    """pp2 x tp2 (Qwen3-VL's LLM split by the plan ds_omni borrows from Qwen3) equals one
    process; both TP ranks of stage 1 (ranks 2, 3) added the levels, stage 0 none; every rank
    holds AutoTP's layers, each MLP halved (`check`), the q/k norms whole."""
    cases, results = four_ranks
    name = "qwen3_vl_pp2_tp2"
    added = [r[name]["deepstack_levels_added"] for r in results]
    assert added[:2] == [0, 0] and added[2] == added[3] > 0, added
    for r in results:
        assert r[name]["tp_counts"] == {"column": 5, "row": 2}, r[name]["tp_counts"]  # a layer
        norms = [s for n, s in r[name]["local_shapes"].items() if n.endswith("_norm.weight")]
        assert norms and all(s == (8,) for s in norms), norms
    check(name, cases[name], results, _config(cases[name], str(tmp_path / f"ref_{name}")))


@pytest.mark.parametrize("plant", plants.for_launch("pp_deepstack"))
def test_plant_pipeline_deepstack_is_caught(plant, two_ranks, tmp_path):
    cases, results = two_ranks
    with pytest.raises(AssertionError, match="losses"):
        check(plant, cases[plant], results, _config(cases[plant], str(tmp_path / "ref")))
