"""Qwen3-VL's LLM under parallel.tp (HF's plan for it names the embedding alone; ds_omni borrows
Qwen3's, `tensor_parallel.PLAN_OF`) equals one process.

Two ranks (tp=2, dp=1), the tiny Qwen3-VL (2 LLM layers, 4 query / 2 key-value heads of 8 dims,
deepstack levels added to the first layers), ZeRO-1, 3 steps of packed rows with text-only rows
among them, against the oracle (`tests/oracle/`): losses (rel 1e-6), every step's gradients (the
shards gathered whole) and the final parameters. The mechanism is shown to run: 2 x 5 column and
2 x 2 row AutoTP layers, exactly the decoder projections split, the q/k norms (which see half the
heads on each rank) whole, the encoders' work split over TP. The plant "tp_qk_norm_grad_not_summed"
(the norms' gradients left unsummed over TP) must fail the check.
"""

import pytest

from tests import family_dirs, plants
from tests.dist.test_tensor_parallel import (_check, _check_sharded_params, _check_tp_encode,
                                             _config, _planted, _train_ranks)
from tests.fixtures import text_source
from tests.harness import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_qwen3_vl")
    honest = {"qwen3_vl": {"stages": [1],
                           "model_dir": str(family_dirs.make_generic_dir(tmp / "q3", "qwen3_vl")),
                           "sources": [{"name": "shapes", "path": "builtin:shapes"},
                                       text_source(tmp)]}}
    assert plants.for_launch("tp_qwen3_vl") == ["tp_qk_norm_grad_not_summed"]
    cases = {**honest, **_planted(honest, "tp_qwen3_vl", "qwen3_vl")}
    return cases, run_on_ranks(_train_ranks, 2, args=(cases, str(tmp / "runs")), timeout=900)


def test_tensor_parallel_qwen3_vl_matches_single_process(launch, tmp_path):
    cases, results = launch
    _check("qwen3_vl", cases["qwen3_vl"], results, tmp_path)
    _check_sharded_params(cases["qwen3_vl"], results, "qwen3_vl", 1, tmp_path)
    _check_tp_encode(results, "qwen3_vl", 1)
    for r in results:
        got = r[("qwen3_vl", 1)]
        assert got["tp_counts"] == {"column": 10, "row": 4}, got["tp_counts"]
        shapes = got["local_shapes"]
        assert shapes["backbone.layers.0.mlp.up_proj.weight"] == (32, 32)  # of 64
        assert shapes["backbone.layers.0.self_attn.k_proj.weight"] == (8, 32)  # one KV head
        assert shapes["backbone.layers.0.self_attn.q_norm.weight"] == (8,)  # whole


@pytest.mark.parametrize("plant", plants.for_launch("tp_qwen3_vl"))
def test_plant_tp_qwen3_vl_is_caught(plant, launch, tmp_path):
    cases, results = launch
    with pytest.raises(AssertionError, match=r"grad of \S*[qk]_norm"):
        _check(plant, cases[plant], results, tmp_path)
