"""Data-parallel training equals one process running the same global batches.

Oracle (`tests/oracle/`): plain PyTorch in one process (no DeepSpeed), the same init, global
batches made there by dp loaders in loader order (not taken from the ranks), loss = sum of token
losses / global target tokens, torch AdamW, the same clipping. After two steps with gradient
accumulation the losses, the full reduced gradients of every step (a later step's at the
parameters the ranks made it at) and every parameter must agree to fp32 precision, each parameter
tensor to 0.1 % of its own update. Every case trains with weight decay and DeepSpeed's WarmupCosineLR (the shipped configs'
scheduler) over `train.warmup_steps` = 2, the reference running the schedule as the test writes it
(`oracle.warmup_cosine_lr`): 2-step cases warm up, 3-step ones also decay. `test_plant_is_caught`
and `test_plant_pipeline_is_caught` show the oracle fails on each planted error of
`tests/plants/parity.py` (a loss scaled 2x, one dropped sample, weight decay dropped, the schedule a
step late, placeholders trained on, pool rows filed under the wrong rank, a skipped encoder
broadcast, a gradient norm counting replicas twice, "bubbles" rows received late and an encoder
backward skipped), each a 1-step case of this launch.

Dropout: the "dropout" case turns the vision tower's attention dropout to 1.0 (in train mode
every attention weight dropped: the tower's attention adds nothing). Masks of a dropout below 1
come from each rank's random stream over its own micro-batches, which no one-process reference
draws alike; at 1.0 the result is exact on both sides, so the case keeps the full parity check,
and its reference must differ from the dropout-free one (the setting reached the kernel, in
train mode, on both sides).

Cases: the demo composition (LLaVA) under ZeRO 0, 2, 3 (ZeRO-1: the pool case below), with a
validation set of 5 rows evaluated after the last step over both ranks (its loss equals one process evaluating the whole set); every other family under ZeRO-3 (the
generic adapter through LLaVA-OneVision; images of
several sizes, M-RoPE positions, audio clips), with text-only samples mixed in so that some ranks
have micro-batches with nothing to encode (where DeepSpeed's ZeRO-3 would otherwise hang). The
same launch trains the pipeline cases (PP=2, both encoder placements; `tests/dist/pipeline.py`),
which also save a checkpoint before their last step, resume from it and export it to HF (and
evaluate the validation set through the pipeline engine's eval_batch), and the
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
WEIGHT_DECAY = 0.1
WARMUP = 2  # DeepSpeed's warm-up takes at least 2 steps
# what users write (ds_configs/zero2.json); warm-up, total steps and LR follow from `train`. A
# warm-up that starts above 0: the first step learns, and a schedule a step late (at lr 0) shows
SCHEDULER = {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1, "cos_min_ratio": 0.1,
                                                  "warmup_type": "linear"}}
# pipeline cases: 4 micro-batches of one sample a step (text-only ones among them)
PP_BATCH = {"global_batch_size": 4, "micro_batch_size": 1}


def _config(case: dict, out_dir: str):
    cfg = tiny_config(out_dir, **{"steps": case.get("steps", STEPS), "weight_decay": WEIGHT_DECAY,
                                  "warmup_steps": WARMUP, **case.get("train", {})})
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
    if case.get("dropout"):
        cfg.model.vision.config["attention_dropout"] = case["dropout"]
    cfg.data.max_seq_len = case.get("max_seq_len", cfg.data.max_seq_len)
    return cfg


def _lr_at(cfg):
    """Step -> LR of the test's schedule (`SCHEDULER`) for `cfg`, written in the test."""
    params = SCHEDULER["params"]
    return lambda step: oracle.warmup_cosine_lr(step, cfg.train.lr, cfg.train.warmup_steps,
                                                cfg.train.steps, params["warmup_min_ratio"],
                                                params["cos_min_ratio"])


def _train_ranks(rank, world, cases, out_dir):
    results = {}
    for name, case in cases.items():
        for stage in case["stages"]:
            cfg = _config(case, f"{out_dir}/{name}{stage}")
            clip = {"gradient_clipping": case["clip"]} if "clip" in case else {}
            results[(name, stage)] = oracle.train_on_rank(
                rank, world, cfg, ds_config(stage, scheduler=SCHEDULER, **clip),
                case.get("steps", STEPS),
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
    honest = {
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
                            "train": PP_BATCH, "resume_at": 2, "eval_sources": eval_sources(tmp)},
        # Megatron's even split: [0, 2, 5] (the cost model's would be [0, 3, 5]); a
        # gradient_clipping that clips every step: the norm counts each encoder parameter once,
        # on the stage that owns it (and steps it)
        "pp_composed_uniform": {"stages": [0], "placement": "uniform", "model": pipeline.COMPOSED,
                                "sources": [pipeline.SHAPES_TONES, text], "max_seq_len": 160,
                                "steps": 3, "train": PP_BATCH, "resume_at": 2,
                                "split": "layers", "parts": [0, 2, 5], "clip": pipeline.CLIP},
        # the encoders' work inside the schedule's idle slots ("bubbles"), split by cost; in
        # loader order, so items sit in later micro-batches (stage 1 encodes them in its warm-up)
        "pp_composed_bubbles": {"stages": [0], "placement": "bubbles", "model": pipeline.COMPOSED,
                                "sources": [pipeline.SHAPES_TONES, text], "max_seq_len": 160,
                                "steps": 3, "train": PP_BATCH, "clip": pipeline.CLIP,
                                "reorder": {"mode": "loader_order"}},
        # the vision tower's attention dropout at 1.0 (see the module docstring)
        "dropout": {"stages": [2], "dropout": 1.0},
    }
    # planted errors: the oracle must fail on these (one step is enough to see them), each in a
    # case where its mechanism runs (else the demo composition under ZeRO-2)
    return {**honest, **{plant: {**{k: v for k, v in honest[PLANTED_IN.get(plant, "demo")].items()
                                    if k not in ("resume_at", "eval_sources")},
                                 **({} if plant in PLANTED_IN else {"stages": [2]}),
                                 "plant": plant, "steps": 1}
                         for plant in plants.for_launch("dp") + plants.for_launch("pp")}}


# the honest case a plant's case copies (1 step, no resume)
PLANTED_IN = {"pool_wrong_rank": "pool_llava", "skip_encoder_broadcast": "pp_composed_uniform",
              "grad_norm_replicas_twice": "pp_composed_uniform",
              "bubble_rows_late": "pp_composed_bubbles",
              "bubble_backward_skipped": "pp_composed_bubbles"}


@pytest.fixture(scope="module")
def dp_results(cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    return run_on_ranks(_train_ranks, 2, args=(cases, str(out)), timeout=1200)


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
        if "placement" in case and "plant" not in case:
            _check_pipeline(name, case, dp_results, tmp_path)


def _check_pipeline(name, case, results, tmp_path, dp=1):
    per_rank = [{name: r[(name, case["stages"][0])]} for r in results]
    cfg = _config(case, str(tmp_path / f"ref_{name}"))
    pipeline.check(name, case, per_rank, cfg, dp=dp, lr_at=_lr_at(cfg))
    if case.get("eval_sources"):  # validation through the pipeline engine's eval_batch
        params = oracle.merge_stages([r[name] for r in per_rank[::dp]])["params"]
        (want,) = oracle.reference_eval_losses(cfg, [params])
        evals = [r[name]["eval"] for r in per_rank]
        assert all(e == evals[0] for e in evals), (name, evals)
        assert evals[0]["eval_loss"] == pytest.approx(want, rel=1e-6), (name, evals[0], want)
        assert evals[0]["eval_samples"] == 5, (name, evals[0])


# what the oracle's failure names: 2x loss scaling leaves the reported loss alone and Adam's first
# step nearly so, only the gradient comparison sees it; a dropped sample, and pool rows at the
# wrong placeholders, change the loss itself; weight decay (decoupled) and the LR only move the
# parameters; a norm counted twice clips by another factor
CAUGHT_BY = {"loss_x2": "grad of", "drop_sample": "losses", "pool_wrong_rank": "losses",
             "weight_decay_dropped": "param ", "lr_schedule_late": "param ",
             "placeholders_as_targets": "are targets",
             "skip_encoder_broadcast": "param encoders", "grad_norm_replicas_twice": "clipped by",
             "bubble_rows_late": "losses", "bubble_backward_skipped": "grad of"}
# plants put in the reference's process too: the oracle must see them on both sides
IN_REFERENCE = {"placeholders_as_targets"}


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("dp"))
def test_plant_is_caught(plant, cases, dp_results, tmp_path):
    with pytest.raises(AssertionError, match=CAUGHT_BY[plant]):
        with plants.applied(plant if plant in IN_REFERENCE else None, 0):
            _check(plant, cases[plant], dp_results, tmp_path,
                   dp=None if cases[plant].get("pool") else 2)


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("pp"))
def test_plant_pipeline_is_caught(plant, cases, dp_results, tmp_path):
    with pytest.raises(AssertionError, match=CAUGHT_BY[plant]):
        _check_pipeline(plant, cases[plant], dp_results, tmp_path)


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
             "dp2_pp_uniform": {"stages": [0], "placement": "uniform", **pp,
                                "eval_sources": eval_sources(tmp)}}
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
            _check_pipeline(name, case, results, tmp_path, dp=2)


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
    ref = oracle.run_reference(cfg, step_keys, lr_at=_lr_at(cfg))
    for stage in case["stages"]:
        got = results[0][(name, stage)]
        oracle.assert_matches(ref, got, f"{name} ZeRO-{stage}")
        assert all(r[(name, stage)]["losses"] == got["losses"] for r in results), (name, stage)
        assert bool(got["clip_coefs"]) == (stage == 0), (name, stage)  # ZeRO-0's were checked
    # dropout 1.0 leaves the tower's attention projections without a gradient (21 of 64 tensors)
    oracle.assert_moved(ref, name, 0.6 if case.get("dropout") else 0.7)
    if case.get("dropout"):  # the dropout setting acts: without it the losses differ
        off = oracle.run_reference(_config({**case, "dropout": 0.0}, str(tmp_path / "off")),
                                   step_keys, lr_at=_lr_at(cfg))
        assert abs(off.losses[0] - ref.losses[0]) > 1e-5 * ref.losses[0], (off.losses, ref.losses)
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
