"""DP2 x PP2 on 4 ranks against one process, both placements (a manual check, outside the suite:
4 ranks take about 3 minutes on 2 cores, past the suite's budget).

    PYTHONPATH=. .venv/bin/python tests/dist/check_pipeline_dp2.py

Same oracle and tolerances as the pipeline cases of `tests/dist/test_parity.py`
(`tests/dist/pipeline.py`); the reference trains the global batches of 2 data-parallel loaders.
"""

CASES = {"dp2_llava_stage0": {"placement": "stage0", "zero": 1, "steps": 3},
         "dp2_llava_uniform": {"placement": "uniform", "zero": 0, "steps": 3}}


def config(case: dict, sources: list, out_dir: str):
    from ds_omni.config import ParallelConfig, SourceConfig, from_dict
    from tests.fixtures import tiny_config
    cfg = tiny_config(out_dir, steps=case["steps"])
    cfg.data.sources = [from_dict(SourceConfig, s) for s in sources]
    cfg.parallel = ParallelConfig(pp=2, encoder_placement=case["placement"])
    return cfg


def ranks(rank, world, sources, out_dir):
    from tests import oracle
    from tests.fixtures import ds_config
    return {name: oracle.train_on_rank(rank, world, config(case, sources, f"{out_dir}/{name}"),
                                       ds_config(case["zero"]), case["steps"])
            for name, case in CASES.items()}


def main() -> None:
    import tempfile
    import time
    from pathlib import Path
    from tests.dist import pipeline
    from tests.fixtures import text_source
    from tests.harness import run_on_ranks
    tmp = Path(tempfile.mkdtemp(prefix="ds_omni_pp_dp2_"))
    sources = [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]
    t0 = time.perf_counter()
    results = run_on_ranks(ranks, 4, args=(sources, str(tmp / "pp")), timeout=900)
    for name, case in CASES.items():
        pipeline.check(name, case, results, config(case, sources, str(tmp / f"ref_{name}")), dp=2)
        print(f"{name}: DP2 x PP2 equals one process (losses {results[0][name]['losses']})")
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
