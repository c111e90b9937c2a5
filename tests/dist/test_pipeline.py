"""The LLM over pipeline stages (DeepSpeed's pipeline engine) equals one process.

One 2-rank launch (PP=2, dp=1) trains each case 3 steps inside the ranks; the oracle
(`tests/oracle.py`: plain PyTorch, one process, global batches built independently) must match
the loss (1e-6 relative), the first step's reduced gradients and the final parameters (1e-5
relative, fp32). Each stage returns its own parameters under the OmniModel's names; together they
must be the whole model. The data mixes captioned pictures with plain sentences, so some
micro-batches carry no image and token counts differ from one micro-batch to the next.
"""

import pytest

from tests import oracle
from tests.fixtures import ds_config, text_source, tiny_config
from tests.harness import run_on_ranks

STEPS = 3
LR = 1e-3
PARAM_ATOL = 2e-3 * LR * STEPS  # as in test_parity: reduction-order noise through Adam


def _config(case: dict, out_dir: str):
    from ds_omni.config import ParallelConfig, SourceConfig, from_dict
    cfg = tiny_config(out_dir, steps=STEPS)
    cfg.data.sources = [from_dict(SourceConfig, s) for s in case["sources"]]
    cfg.parallel = ParallelConfig(pp=2, encoder_placement=case["placement"])
    return cfg


def _train_ranks(rank, world, cases, out_dir):
    return {name: oracle.train_on_rank(rank, world, _config(case, f"{out_dir}/{name}"),
                                       ds_config(case["zero"]), STEPS)
            for name, case in cases.items()}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    mixed = [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]
    return {"llava_stage0": {"placement": "stage0", "zero": 0, "sources": mixed},
            "llava_uniform": {"placement": "uniform", "zero": 1, "sources": mixed}}


@pytest.mark.dist
def test_pipeline_matches_single_process(cases, tmp_path):
    from ds_omni.model.build import build_model
    results = run_on_ranks(_train_ranks, 2, args=(cases, str(tmp_path / "pp")), timeout=300)
    for name, case in cases.items():
        cfg = _config(case, str(tmp_path / f"ref_{name}"))
        step_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), 1, STEPS)
        for r in results:
            assert [sorted(k) for k in r[name]["keys"]] == step_keys, name
        stages = [r[name] for r in results]
        _check_replicas(case, *stages)
        got = {"losses": stages[0]["losses"],
               "grads": {**stages[0]["grads"], **stages[1]["grads"]},
               "params": {**stages[0]["params"], **stages[1]["params"]}}
        assert stages[1]["losses"] == got["losses"], name
        ref = oracle.run_reference(cfg, step_keys)
        oracle.assert_matches(ref, got, f"{name} PP=2", param_atol=PARAM_ATOL)
        oracle.assert_moved(ref, name)
        assert sum(r[name]["nothing_to_encode"] for r in results) > 0, name


def _check_replicas(case, first, second) -> None:
    """Only "uniform" holds a parameter on two stages: the encoders, every copy the same."""
    import torch
    shared = set(first["params"]) & set(second["params"])
    if case["placement"] == "stage0":
        assert not shared, f"a parameter on 2 stages: {sorted(shared)[:3]}"
        return
    assert shared and all(k.startswith("encoders.") for k in shared), sorted(shared)[:3]
    assert {k for k in first["params"] if k.startswith("encoders.")} == shared
    for key in shared:
        assert torch.equal(first["params"][key], second["params"][key]), key
