"""Data-parallel training equals one process running the same global batches.

Oracle (`tests/oracle.py`): plain PyTorch in one process (no DeepSpeed), the same init, global
batches made there by dp loaders in loader order (not taken from the ranks), loss = sum of token
losses / global target tokens, torch AdamW, the same clipping. After two steps with gradient
accumulation the losses, the full reduced gradients of the first step and every parameter must
agree to fp32 precision. `test_plant_is_caught` shows it fails on each planted error of
`tests/plants.py` (a loss scaled 2x, one dropped sample, ...).

Cases: the demo composition (LLaVA) under ZeRO 0, 2, 3 (ZeRO-1: the pool case below), with a
validation set of 5 rows evaluated after the last step over both ranks (its loss equals one process evaluating the whole set); every other family under ZeRO-3 (the
generic adapter through LLaVA-OneVision; images of
several sizes, M-RoPE positions, audio clips), with text-only samples mixed in so that some ranks
have micro-batches with nothing to encode (where DeepSpeed's ZeRO-3 would otherwise hang). The
same launch trains the pipeline cases (PP=2, both encoder placements; `tests/dist/pipeline.py`),
which also save a checkpoint before their last step, resume from it and export it to HF, and the
encoder pool cases (`parallel.encoder_pool: "dp"`, LLaVA ZeRO-1 and the image+audio composition
ZeRO-3, 3 steps): rank 0's rows hold every image and clip, rank 1's are text alone, so each round
rank 1 encodes some of rank 0's items and sends their rows back. A 4-rank launch trains budget
mode in two reorder groups and DP2 x PP2 in both placements.
"""

import pytest

from tests import oracle, plants
from tests.data_files import skewed_source
from tests.dist import pipeline
from tests.fixtures import ds_config, eval_sources, text_source, tiny_config
from tests.harness import run_on_ranks

STEPS = 2
LR = 1e-3  # tiny_config's learning rate
# Adam turns reduction-order noise in near-zero gradients into updates of up to the step size:
# parameters must agree to within 0.2% of the total step size (4e-6)
PARAM_ATOL = 2e-3 * LR * STEPS
# pipeline cases: 4 micro-batches of one sample a step (text-only ones among them)
PP_BATCH = {"global_batch_size": 4, "micro_batch_size": 1}


def _config(case: dict, out_dir: str):
    cfg = tiny_config(out_dir, steps=STEPS, **case.get("train", {}))
    if case.get("reorder"):
        from ds_omni.config import ReorderConfig
        cfg.data.reorder = ReorderConfig(**case["reorder"])
    if case.get("model_dir"):
        cfg.model.pretrained, cfg.model.tokenizer = case["model_dir"], None
        cfg.model.vision = cfg.model.llm = None
    if case.get("model"):
        from ds_omni.config import ModelConfig, from_dict
        cfg.model = from_dict(ModelConfig, case["model"], "model")
    if case.get("placement"):  # the LLM over 2 pipeline stages (or case["pp"])
        from ds_omni.config import ParallelConfig
        cfg.parallel = ParallelConfig(pp=case.get("pp", 2), encoder_placement=case["placement"],
                                      stage_split=case.get("split", "cost"))
    if case.get("layers"):  # decoder layers of the tiny LLaVA's LLM
        cfg.model.llm.config["num_hidden_layers"] = case["layers"]
    if case.get("pool"):
        cfg.parallel.encoder_pool = "dp"
    if case.get("sources"):
        from ds_omni.config import SourceConfig, from_dict
        cfg.data.sources = [from_dict(SourceConfig, s) for s in case["sources"]]
    if case.get("eval_sources"):
        from ds_omni.config import SourceConfig, from_dict
        cfg.data.eval_sources = [from_dict(SourceConfig, s) for s in case["eval_sources"]]
    cfg.data.max_seq_len = case.get("max_seq_len", cfg.data.max_seq_len)
    return cfg


def _train_ranks(rank, world, cases, out_dir):
    results = {}
    for name, case in cases.items():
        for stage in case["stages"]:
            cfg = _config(case, f"{out_dir}/{name}{stage}")
            clip = {"gradient_clipping": case["clip"]} if "clip" in case else {}
            results[(name, stage)] = oracle.train_on_rank(
                rank, world, cfg, ds_config(stage, **clip), case.get("steps", STEPS),
                case.get("plant"), case.get("resume_at"))
    return results


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from tests import family_dirs
    tmp = tmp_path_factory.mktemp("families")
    text = text_source(tmp)
    shapes = {"name": "shapes", "path": "builtin:shapes"}
    tones = {"name": "tones", "path": "builtin:tones",
             "schema": {"text": "conversations", "image": None, "audio": "audio"}}
    vision = [shapes, text]
    skewed = skewed_source(tmp / "skewed")
    skewed_audio = skewed_source(tmp / "skewed_audio", audio=True)
    return {
        # ZeRO-1 of the demo composition: pool_llava (the same model, pool on, skewed data)
        "demo": {"stages": [0, 2, 3], "eval_sources": eval_sources(tmp)},
        "llava_next": {"stages": [3], "model_dir": str(family_dirs.make_llava_next_dir(tmp / "n")),
                       "sources": vision},
        "qwen2_vl": {"stages": [3], "model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q")),
                     "sources": vision},
        # the generic adapter: per-image get_image_features, image_newline gathered by ZeRO-3
        "llava_onevision": {"stages": [3], "sources": vision, "model_dir": str(
            family_dirs.make_generic_dir(tmp / "ov", "llava_onevision"))},
        # its processor saved Qwen2-Audio's ChatML template: samples render with it (longer)
        "qwen2_audio": {"stages": [3], "model_dir": str(family_dirs.make_qwen2_audio_dir(tmp / "a")),
                        "sources": [tones, text], "max_seq_len": 192},
        # the encoder pool: rank 0's rows hold every image (and clip), rank 1's are text alone;
        # each round, half of rank 0's items are encoded on rank 1 and their rows sent back
        "pool_llava": {"stages": [1], "pool": True, "sources": [skewed], "steps": 3,
                       "reorder": {"mode": "loader_order"}},
        "pool_composed": {"stages": [3], "pool": True, "model": pipeline.COMPOSED,
                          "sources": [skewed_audio], "steps": 3, "max_seq_len": 160,
                          "reorder": {"mode": "loader_order"}},
        # PP=2 (dp=1): both placements, both models (test_pipeline_matches_single_process)
        "pp_llava_stage0": {"stages": [1], "placement": "stage0", "sources": vision, "steps": 3,
                            "train": PP_BATCH, "resume_at": 2},
        # Megatron's even split: [0, 2, 5] (the cost model's would be [0, 3, 5]); a
        # gradient_clipping that clips every step: the norm counts each encoder parameter once,
        # on the stage that owns it (and steps it)
        "pp_composed_uniform": {"stages": [0], "placement": "uniform", "model": pipeline.COMPOSED,
                                "sources": [pipeline.SHAPES_TONES, text], "max_seq_len": 160,
                                "steps": 3, "train": PP_BATCH, "resume_at": 2,
                                "split": "layers", "parts": [0, 2, 5], "clip": pipeline.CLIP},
        # planted errors: the oracle must fail on these (one step is enough to see them)
        **{plant: {"stages": [2], "plant": plant, "steps": 1} for plant in plants.for_launch("dp")},
    }


@pytest.fixture(scope="module")
def dp_results(cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    return run_on_ranks(_train_ranks, 2, args=(cases, str(out)), timeout=900)


@pytest.mark.dist
def test_data_parallel_matches_single_process(cases, dp_results, tmp_path):
    for name, case in cases.items():
        if "plant" not in case and "placement" not in case:
            # the pool cases read in loader order, which the ranks' keys are: replay them (the
            # pool moves encoder work, never samples)
            _check(name, case, dp_results, tmp_path, dp=None if case.get("pool") else 2)


@pytest.mark.dist
def test_pipeline_matches_single_process(cases, dp_results, tmp_path):
    for name, case in cases.items():
        if "placement" in case:
            stage = case["stages"][0]
            per_rank = [{name: r[(name, stage)]} for r in dp_results]
            pipeline.check(name, case, per_rank, _config(case, str(tmp_path / f"ref_{name}")))


# what the oracle's failure names: 2x loss scaling leaves the reported loss alone and Adam's first
# step nearly so, only the gradient comparison sees it; a dropped sample changes the loss itself
CAUGHT_BY = {"loss_x2": "grad of", "drop_sample": "ZeRO-2"}


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("dp"))
def test_plant_is_caught(plant, cases, dp_results, tmp_path):
    with pytest.raises(AssertionError, match=CAUGHT_BY.get(plant, "")):
        _check(plant, cases[plant], dp_results, tmp_path, dp=2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One launch of 4 ranks: budget mode in two reorder groups of 2, and DP2 x PP2 in both
    encoder placements (ZeRO-1 with "stage0" split by DeepSpeed's parameter balance, ZeRO-0 with
    "uniform")."""
    tmp = tmp_path_factory.mktemp("four")
    vision = [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]
    pp = {"sources": vision, "steps": 3, "train": PP_BATCH}
    cases = {"budget": {"stages": [2], "reorder": {"mode": "budget", "group_size": 2},
                        "train": {"micro_batch_size": 1}},
             "dp2_pp_stage0": {"stages": [1], "placement": "stage0", "split": "parameters",
                               "parts": [0, 2, 4], **pp},
             "dp2_pp_uniform": {"stages": [0], "placement": "uniform", **pp}}
    return cases, run_on_ranks(_train_ranks, 4, args=(cases, str(tmp / "dp")), timeout=600)


@pytest.mark.dist
def test_budget_mode_in_two_groups_of_two_ranks(four_ranks, tmp_path):
    """4 ranks, reorder groups of 2, budget mode: each rank's share varies per step.

    Budget mode decides which samples make a global batch, so here the reference replays the keys
    the ranks trained on; the checks of loss, gradients and parameters are the same.
    """
    cases, results = four_ranks
    _check("budget", cases["budget"], results, tmp_path, dp=None)


@pytest.mark.dist
def test_dp2_x_pp2_matches_single_process(four_ranks, tmp_path):
    """2 pipelines of 2 stages: the reference trains the global batches of 2 data-parallel
    loaders; every stage's data-parallel ranks must agree."""
    cases, results = four_ranks
    for name, case in cases.items():
        if "placement" in case:
            per_rank = [{name: r[(name, case["stages"][0])]} for r in results]
            pipeline.check(name, case, per_rank, _config(case, str(tmp_path / f"ref_{name}")),
                           dp=2)


def _check(name, case, results, tmp_path, dp):
    """Compare every stage of case `name` with the oracle; dp=None replays the ranks' own keys."""
    from ds_omni.model.build import build_model
    first = case["stages"][0]
    steps = case.get("steps", STEPS)
    rank_keys = [sorted(k for r in results for k in r[(name, first)]["keys"][s]) for s in range(steps)]
    assert all(len(keys) == len(set(keys)) > 0 for keys in rank_keys)
    cfg = _config(case, str(tmp_path / f"ref_{name}"))
    if dp is None:
        step_keys = rank_keys
    else:
        step_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), dp, steps)
        assert rank_keys == step_keys, f"{name}: the ranks trained another global batch"
    ref = oracle.run_reference(cfg, step_keys)
    for stage in case["stages"]:
        got = results[0][(name, stage)]
        oracle.assert_matches(ref, got, f"{name} ZeRO-{stage}", param_atol=PARAM_ATOL)
        assert all(r[(name, stage)]["losses"] == got["losses"] for r in results), (name, stage)
    oracle.assert_moved(ref, name)
    if case.get("eval_sources"):
        _check_eval(cfg, case["stages"], [r[(name, stage)] for r in results for stage in
                                          case["stages"]], len(results))
    if case.get("sources"):  # text-only micro-batches really happened somewhere
        assert sum(r[(name, first)]["nothing_to_encode"] for r in results) > 0, name
    if case.get("pool"):  # the text-only ranks really encoded rank 0's items
        moved = [r[(name, first)]["pool_items_moved"] > 0 for r in results]
        assert moved == [False] + [True] * (len(results) - 1), (name, moved)


def _check_eval(cfg, stages, per_rank_stage, world) -> None:
    """Validation after the last step, over the ranks: each stage's eval loss equals one process
    evaluating the whole set with that stage's final parameters."""
    got = [r["eval"] for r in per_rank_stage]  # rank-major: rank r, stage s at r * len + s
    wants = oracle.reference_eval_losses(cfg, [per_rank_stage[s]["params"]
                                               for s in range(len(stages))])
    for s, (stage, want) in enumerate(zip(stages, wants)):
        evals = got[s::len(stages)]
        assert len(evals) == world and all(e == evals[0] for e in evals), stage
        assert evals[0]["eval_loss"] == pytest.approx(want, rel=1e-6), f"eval, ZeRO-{stage}"
        assert evals[0]["eval_samples"] == 5
