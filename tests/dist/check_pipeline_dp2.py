"""DP2 x PP2 on 4 ranks against one process, both placements (a manual check, outside the suite:
4 ranks take about 3 minutes on 2 cores, past the suite's budget).

    PYTHONPATH=. .venv/bin/python tests/dist/check_pipeline_dp2.py

Same oracle and tolerances as `tests/dist/test_pipeline.py`; the reference trains the global
batches of 2 data-parallel loaders.
"""
import time

from tests.dist import test_pipeline as tp

def ranks(rank, world, models, out_dir, cases):
    from tests import oracle
    from tests.fixtures import ds_config
    return {name: oracle.train_on_rank(rank, world, tp._config(models[m], p, f"{out_dir}/{name}"),
                                       ds_config(z), tp.STEPS) for name, m, p, z in cases}

if __name__ == "__main__":
    import tempfile
    from pathlib import Path
    from tests import oracle
    from tests.fixtures import text_source
    from tests.harness import run_on_ranks
    from ds_omni.model.build import build_model
    tmp = Path(tempfile.mkdtemp())
    text = text_source(tmp)
    models = {"llava": {"sources": [{"name": "shapes", "path": "builtin:shapes"}, text]}}
    cases = [("s0", "llava", "stage0", 1), ("uni", "llava", "uniform", 0)]
    t = time.time()
    res = run_on_ranks(ranks, 4, args=(models, str(tmp / "pp"), cases), timeout=900)
    print("ranks", time.time() - t)
    cfg = tp._config(models["llava"], "stage0", str(tmp / "ref"))
    keys = oracle.reference_step_keys(cfg, build_model(cfg.model), 2, tp.STEPS)
    ref = oracle.run_reference(cfg, keys)
    for name, _, placement, _ in cases:
        got_keys = [sorted(res[0][name]["keys"][s] + res[1][name]["keys"][s]) for s in range(tp.STEPS)]
        assert got_keys == keys, name
        a, b = res[0][name], res[2][name]  # dp rank 0 of stage 0 and stage 1
        tp._check_replicas(placement, a, b)
        got = {"losses": a["losses"], "grads": {**a["grads"], **b["grads"]},
               "params": {**a["params"], **b["params"]}}
        assert all(r[name]["losses"] == a["losses"] for r in res)
        oracle.assert_matches(ref, got, f"{name} DP2xPP2", param_atol=tp.PARAM_ATOL)
        print(name, "OK", a["losses"], ref.losses)
