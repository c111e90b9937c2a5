"""The pipeline composed with tensor and sequence parallelism inside its stages, against one process.

One 4-rank launch (ranks started once, the cases in a loop): the tiny LLaVA over 2 stages with
AutoTP's layers over 2 TP ranks in each stage (pp2 x tp2), and with Ulysses over 2 SP ranks in
each stage (pp2 x sp2), ZeRO-1, encoders "uniform", 2 steps of 4 micro-batches each with
text-only rows among them. The oracle (`tests/oracle/`: one process, plain PyTorch, global
batches built there) must match the losses (1e-6 relative), every step's reduced gradients (TP
shards gathered whole) and the final parameters (relative to their update). Evidence each axis
ran: every rank of a stage holds AutoTP's layers and half of each MLP (pp x tp); every SP rank
makes one Ulysses call per decoder layer of its stage for each row, the SP ranks of a row hold
different shards, each target is trained on one SP rank of each TP rank, and stage 0's
resharding all-to-all ran for every row with items (pp x sp). Planted errors
(`tests/plants/pipeline.py`): stage 0's column-parallel input gradients not summed over TP, and
stage 0's SP shards sending their activations to the other SP shard of stage 1; the oracle
fails on each (`test_plant_*`).

The slow tier (`test_pipeline_composed_8_ranks`): pp2 x tp2 x sp2 on 8 ranks, LLaVA and Qwen2-VL
(M-RoPE), ZeRO-1, the three encoder placements ("uniform" and "bubbles": each SP shard's column
of stages encodes the items its reshard plan gives it), 3 steps each, checked the same way. Also slow, 4 ranks:
pp2 x tp2 and pp2 x sp2 under "bubbles" (the image+audio composition in loader order), checked
the same way, with evidence its encoder work ran (an item's forward in an idle slot, and rows a
later stage encoded received by every rank of stage 0: `BubbleSetup.rows_received`); a plant
delivering those rows to stage 0's first rank alone (TP rank 0, SP shard 0) must fail it.
"""

import pytest

from tests import oracle, plants
from tests.dist import pipeline
from tests.fixtures import ds_config, text_source, tiny_config
from tests.harness import run_on_ranks

pytestmark = pytest.mark.timeout(1500)

STEPS = 3
BATCH = {"global_batch_size": 4, "micro_batch_size": 1}  # 4 micro-batches a step


def _config(case: dict, out_dir: str):
    from ds_omni.config import (ModelConfig, ParallelConfig, ReorderConfig, SourceConfig,
                                from_dict)
    cfg = tiny_config(out_dir, steps=case.get("steps", STEPS), weight_decay=0.1,
                      **case.get("batch", BATCH))
    cfg.parallel = ParallelConfig(pp=2, tp=case.get("tp", 1), sp=case.get("sp", 1),
                                  encoder_placement=case.get("placement", "stage0"),
                                  encoder_pool="dp" if case.get("pool") else "off",
                                  stage_split=case.get("stage_split", "cost"))
    if case.get("pool"):  # loader order: the ranks' keys are the global batches to replay
        cfg.data.reorder = ReorderConfig(mode="loader_order")
    if case.get("model_dir"):
        cfg.model.pretrained, cfg.model.tokenizer = case["model_dir"], None
        cfg.model.vision = cfg.model.llm = None
    cfg.data.sources = [from_dict(SourceConfig, s) for s in case["sources"]]
    if case.get("reorder"):  # "bubbles": in loader order, so items sit in later micro-batches
        cfg.data.reorder = from_dict(ReorderConfig, case["reorder"])
    if case.get("model"):  # "bubbles": the image+audio composition (tests/dist/pipeline.py)
        cfg.model = from_dict(ModelConfig, case["model"], "model")
        cfg.data.max_seq_len = case["max_seq_len"]
    return cfg


def _train_ranks(rank, world, cases, out_dir):
    return {name: oracle.train_on_rank(rank, world, _config(case, f"{out_dir}/{name}"),
                                       ds_config(case["zero"]), case.get("steps", STEPS),
                                       case.get("plant"))
            for name, case in cases.items()}


def _cases(tmp) -> dict:
    """The quick tier's launch: pp2 x tp2 and pp2 x sp2 ("uniform", ZeRO-1), and their plants."""
    sources = [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]
    # "uniform": the encoders' placement composed with tp and with sp in the quick tier too
    # (tests/unit/config/test_composition_coverage.py)
    honest = {"pp2_tp2": {"tp": 2, "zero": 1, "sources": sources, "steps": 2,
                          "placement": "uniform"},
              "pp2_sp2": {"sp": 2, "zero": 1, "sources": sources, "steps": 2,
                          "placement": "uniform"}}
    planted = {"pp_tp_grad_not_summed": "pp2_tp2", "pp_sp_wrong_peer": "pp2_sp2"}
    assert sorted(planted) == plants.for_launch("pp_composed")
    return {**honest, **{p: {**honest[base], "steps": 1, "plant": p}
                         for p, base in planted.items()}}


def _slow_cases(tmp) -> dict:
    """The slow tier's 8-rank launch: pp2 x tp2 x sp2, LLaVA and Qwen2-VL (M-RoPE), ZeRO-1,
    the three encoder placements."""
    from tests import family_dirs
    sources = [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]
    qwen = str(family_dirs.make_qwen2_vl_dir(tmp / "q"))
    # "bubbles": images alone in loader order, two samples a row, so each SP shard has items in
    # later micro-batches
    data = {"stage0": {"sources": sources}, "uniform": {"sources": sources},
            "bubbles": {"sources": sources[:1], "reorder": {"mode": "loader_order"},
                        "batch": {"global_batch_size": 8, "micro_batch_size": 2}}}
    return {f"{name}_{placement}": {"tp": 2, "sp": 2, "zero": 1, "placement": placement,
                                    **data[placement], **model}
            for name, model in (("llava", {}), ("qwen2_vl", {"model_dir": qwen}))
            for placement in ("stage0", "uniform", "bubbles")}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp_composed")
    cases = _cases(tmp)
    return cases, run_on_ranks(_train_ranks, 4, args=(cases, str(tmp / "runs")), timeout=600)


def check(name: str, case: dict, results: list, cfg) -> None:
    """Case `name` (results: one dict per rank) equals the oracle of `cfg`, each axis shown to
    run."""
    from ds_omni.model.build import build_model
    from ds_omni.parallel.plan import ParallelPlan
    plan = ParallelPlan.from_config(cfg.parallel, len(results), cfg.data.reorder)
    steps = case.get("steps", STEPS)
    whole = build_model(cfg.model)
    step_keys = oracle.reference_step_keys(cfg, whole, plan.dp, steps)
    per_stage = len(results) // plan.pp
    firsts = [results[s * per_stage][name] for s in range(plan.pp)]
    readers = [results[d * plan.sp * plan.tp][name] for d in range(plan.dp)]  # stage 0's
    got_keys = [sorted(k for r in readers for k in r["keys"][s]) for s in range(steps)]
    assert got_keys == step_keys, f"{name}: the ranks trained another global batch"
    assert all(r[name]["losses"] == firsts[0]["losses"] for r in results), name
    got = oracle.merge_stages(firsts)
    ref = oracle.run_reference(cfg, step_keys)
    oracle.assert_matches(ref, got, f"{name} pp={plan.pp} tp={plan.tp} sp={plan.sp}")
    oracle.assert_moved(ref, name)
    if plan.tp_enabled:
        _check_tp_ran(name, results, whole.model)
    if plan.sp_enabled:
        _check_sp_ran(name, results, plan, ref)
    if case.get("placement") == "bubbles":
        _check_bubbles_ran(name, results, plan)


def _check_bubbles_ran(name, results, plan) -> None:
    """"bubbles": some item's forward ran in an idle slot, and every rank of stage 0 (each TP
    rank, each SP shard) received rows a later stage of its column encoded."""
    assert sum(r[name]["items_in_gaps"] for r in results) > 0, name
    per_stage = len(results) // plan.pp
    received = [r[name]["bubble_rows_received"] for r in results[:per_stage]]
    assert all(n > 0 for n in received), (name, received)


def _check_tp_ran(name, results, whole) -> None:
    """Every rank's stage holds AutoTP's layers (column and row), each MLP split in half (of the
    `whole` model's)."""
    (width,) = {p.shape[0] for n, p in whole.named_parameters()
                if n.endswith("mlp.up_proj.weight")}
    for rank, r in enumerate(results):
        counts = r[name]["tp_counts"]
        assert counts["column"] > 0 and counts["row"] > 0, (name, rank, counts)
        ups = [s for n, s in r[name]["local_shapes"].items() if n.endswith("mlp.up_proj.weight")]
        assert ups and all(s[0] == width // 2 for s in ups), (name, rank, ups)


def _check_sp_ran(name, results, plan, ref) -> None:
    """Per stage and TP rank: each target trained on exactly one SP rank, the SP ranks of a row
    on different shards, one Ulysses call per decoder layer of the stage for every split row."""
    per_stage = len(results) // plan.pp
    for stage in range(plan.pp):
        for t in range(plan.tp):  # the stage's ranks of TP rank t: rank = first + t + j x tp
            first = stage * per_stage + t
            ranks = [_as_stage(r[name], first, plan.tp, stage)
                     for r in results[first:(stage + 1) * per_stage:plan.tp]]
            oracle.assert_split_work(ref, ranks, f"{name} stage {stage} TP rank {t}")


def _as_stage(r: dict, first: int, tp: int, stage: int) -> dict:
    """A rank's record as `assert_split_work` reads the ranks of one stage and TP rank: numbered
    from `first` in steps of `tp`, Ulysses in the stage's decoder layers only, and encoding (the
    resharding, long items' pieces) on stage 0 only."""
    shards = [(step, i, ((g[0] - first) // tp, g[1]) if g else g, ids, n, real)
              for step, i, g, ids, n, real in r["shards"]]
    encodes = stage == 0
    return {**r, "shards": shards, "ulysses_per_row": r["stage_layers"],
            "rows_with_items": r["rows_with_items"] if encodes else 0,
            "long_items": r["long_items"] if encodes else 0}


def check_honest(cases: dict, results: list, tmp_path, by=None) -> None:
    """Every case of a launch without a plant equals its oracle (`by`, default `check`)."""
    for name, case in cases.items():
        if "plant" not in case:
            (by or check)(name, case, results, _config(case, str(tmp_path / f"ref_{name}")))


def check_caught(plant: str, match: str, cases: dict, results: list, tmp_path, by=None) -> None:
    """The planted case `plant` fails its check (`by`, default `check`) matching `match`."""
    with pytest.raises(AssertionError, match=match):
        (by or check)(plant, cases[plant], results,
                      _config(cases[plant], str(tmp_path / "ref")))


@pytest.mark.dist
def test_pipeline_with_tp_and_sp_matches_single_process(four_ranks, tmp_path):
    cases, results = four_ranks
    check_honest(cases, results, tmp_path)


CAUGHT_BY = {"pp_tp_grad_not_summed": "grad of", "pp_sp_wrong_peer": "losses"}


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("pp_composed"))
def test_plant_pipeline_composed_is_caught(plant, four_ranks, tmp_path):
    cases, results = four_ranks
    check_caught(plant, CAUGHT_BY[plant], cases, results, tmp_path)


def _bubbles_cases(tmp) -> dict:
    """The slow tier's 4-rank "bubbles" launch: pp2 x tp2 and pp2 x sp2 (ZeRO-1, loader order),
    and their plants (a stage's rows reaching one rank of stage 0 alone)."""
    # as the PP=2 "bubbles" case of tests/dist/pipeline.py: stage 1 encodes items in its warm-up
    sources = [pipeline.SHAPES_TONES, text_source(tmp)]
    base = {"zero": 1, "sources": sources, "placement": "bubbles", "model": pipeline.COMPOSED,
            "max_seq_len": 160, "reorder": {"mode": "loader_order"}}
    honest = {"pp2_tp2_bubbles": {**base, "tp": 2}, "pp2_sp2_bubbles": {**base, "sp": 2}}
    planted = {"bubble_rows_tp0_only": "pp2_tp2_bubbles", "bubble_rows_sp0_only": "pp2_sp2_bubbles"}
    assert sorted(planted) == plants.for_launch("pp_bubbles_composed")
    return {**honest, **{p: {**honest[base], "steps": 1, "plant": p}
                         for p, base in planted.items()}}


def _four_rank_launch(tmp_path_factory, name: str, make_cases) -> tuple[dict, list]:
    """(cases, per-rank results) of one 4-rank launch training every case of `make_cases`."""
    tmp = tmp_path_factory.mktemp(name)
    cases = make_cases(tmp)
    return cases, run_on_ranks(_train_ranks, 4, args=(cases, str(tmp / "runs")), timeout=900)


@pytest.fixture(scope="module")
def bubbles_four_ranks(tmp_path_factory):
    return _four_rank_launch(tmp_path_factory, "pp_bubbles", _bubbles_cases)


@pytest.mark.slow
@pytest.mark.dist
def test_pipeline_bubbles_with_tp_and_sp_matches_single_process(bubbles_four_ranks, tmp_path):
    """"bubbles" beside tp and beside sp: exact against one process, its encoder work shown
    to run and to reach every rank of stage 0."""
    cases, results = bubbles_four_ranks
    check_honest(cases, results, tmp_path)


BUBBLES_CAUGHT_BY = {"bubble_rows_tp0_only": "losses", "bubble_rows_sp0_only": "losses"}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("pp_bubbles_composed"))
def test_plant_pipeline_bubbles_composed_is_caught(plant, bubbles_four_ranks, tmp_path):
    cases, results = bubbles_four_ranks
    check_caught(plant, BUBBLES_CAUGHT_BY[plant], cases, results, tmp_path)


@pytest.mark.slow
@pytest.mark.dist
def test_pipeline_composed_8_ranks(tmp_path_factory, tmp_path):
    """pp2 x tp2 x sp2 (dp=1): every rank of a stage holds AutoTP's layers, each TP rank's
    heads split again over its SP group; "uniform" and "bubbles" encode each SP shard's items
    over its column of stages."""
    tmp = tmp_path_factory.mktemp("pp_composed_8")
    cases = _slow_cases(tmp)
    results = run_on_ranks(_train_ranks, 8, args=(cases, str(tmp / "runs")), timeout=1200)
    for name, case in cases.items():
        check(name, case, results, _config(case, str(tmp_path / f"ref_{name}")))


def _pool_cases(tmp) -> dict:
    """The slow tier's pp2 x dp2 launch with the encoder pool: data-parallel rank 0's rows hold
    every image, rank 1's are text; both placements, ZeRO-1, and the plant."""
    from tests.data_files import skewed_source
    sources = [skewed_source(tmp / "skewed")]
    batch = {"global_batch_size": 8, "micro_batch_size": 2}  # 2 images a round on rank 0
    honest = {f"pp2_dp2_pool_{p}": {"pool": True, "placement": p, "zero": 1, "sources": sources,
                                    "steps": 2, "batch": batch}
              for p in ("stage0", "uniform", "bubbles")}
    planted = {"pp_pool_wrong_rank": "uniform", "pp_pool_bubble_rows_unexchanged": "bubbles"}
    assert sorted(planted) == plants.for_launch("pp_pool")
    return {**honest, **{p: {**honest[f"pp2_dp2_pool_{base}"], "steps": 1, "plant": p}
                         for p, base in planted.items()}}


def check_pool(name: str, case: dict, results: list, cfg) -> None:
    """`check`, and the pool moved items across ranks on every stage that encodes: rank 1 (stage
    0, text rows alone) encoded items of rank 0's rows; under "uniform" and "bubbles" so did its
    stage-1 peer (rank 3), whose column splits them; rank 0 kept its own. Under "bubbles" rank 1
    received rows rank 3 encoded: rank 1's rows have no items, so those rows are rank 0's items,
    which only the pool's exchange takes to rank 0."""
    check(name, case, results, cfg)
    moved = [r[name]["pool_items_moved"] > 0 for r in results]
    assert moved == [False, True, False, case["placement"] != "stage0"], (name, moved)
    assert all(r[name]["pool_moved"] for r in results[1:2]), name  # the metric data_pool_moved
    if case["placement"] == "bubbles":
        assert results[1][name]["bubble_rows_received"] > 0, name


@pytest.fixture(scope="module")
def pool_ranks(tmp_path_factory):
    return _four_rank_launch(tmp_path_factory, "pp_pool", _pool_cases)


@pytest.mark.slow
@pytest.mark.dist
def test_pipeline_with_encoder_pool_matches_single_process(pool_ranks, tmp_path):
    """pp2 x dp2 with parallel.encoder_pool "dp" under the three encoder placements (quick: none, a
    4-rank launch; the pool's pure plans: tests/unit/parallelize/test_encoder_pool.py)."""
    cases, results = pool_ranks
    check_honest(cases, results, tmp_path, by=check_pool)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("pp_pool"))
def test_plant_pipeline_pool_is_caught(plant, pool_ranks, tmp_path):
    cases, results = pool_ranks
    check_caught(plant, "losses", cases, results, tmp_path, by=check_pool)
