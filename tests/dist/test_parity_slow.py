"""The slow tier of `test_parity.py`: more families, ranks and ZeRO stages through its config,
launch and checks (against the one-process oracle of tests/oracle/: loss 1e-6 rel, every
step's gradients, each parameter tensor to 0.1 % of its update), one start of the ranks per world
size.

2 ranks:
- the encoder pool (`parallel.encoder_pool: "dp"`) for Qwen2-VL (a variable number of patches per
  image; `image_grid_thw` travels with the patches) and LLaVA-NeXT (tiles + `image_sizes`),
  ZeRO-3, and for the demo LLaVA under ZeRO-2. The quick tier's pool cases (LLaVA ZeRO-1, the
  image+audio composition ZeRO-3, test_parity.py) cover the mechanism;
- a tiny Qwen3.5 (a gated delta net layer, run once per sample of each packed row, and an
  attention layer) on 2 data-parallel ranks under ZeRO-3, where the per-sample layer runs several
  times in one forward, each time gathering its parameters; the planted error
  "per_sample_whole_row" (tests/plants/) must fail the check. The quick tier checks one process
  (tests/unit/model/test_per_sample.py: a training step on a packed row equals HF per sample);
- the joint pipeline's "uniform" placement under ZeRO-1 at PP=2, as the quick tier's ZeRO-0 case
  (clipped every step, saved before its last step, resumed, exported; tests/dist/pipeline.py).
  The pipeline under ZeRO-2 or 3 is refused before any process group exists: DeepSpeed's pipeline
  engine runs ZeRO 0/1 only (tests/unit/parallelize/test_pipeline_stages.py).
4 ranks:
- the encoder pool for the demo LLaVA, ZeRO-3, micro-batches of 4 samples (so rank 0's 4 images
  a round spread one to each rank);
- PP=4 in both placements (ZeRO-1): the tiny LLaVA with 6 decoder layers (so the cost model
  chooses the boundaries: 4 layers would force one a stage), 4 micro-batches of one sample a
  step (text-only samples among them); and "bubbles" on the image+audio composition (6 layers);
- "bubbles" under ZeRO-1 at PP=2 (the quick tier's case is ZeRO-0). The quick tier's PP=2 and DP2 x PP2 cases cover the
  mechanism.
Every pool case reads a skewed source: the rows of data-parallel rank 0 hold every image, the
other ranks' rows are text alone, so each round the pool moves most of rank 0's items away; the
check also asserts that every other rank encoded some of them.
"""

from __future__ import annotations

import pytest

from tests import plants
from tests.data_files import skewed_source
from tests.dist import pipeline
from tests.dist.test_parity import PP_BATCH, _check, _check_pipeline, _train_ranks
from tests.fixtures import text_source
from tests.harness import run_on_ranks

# a test's time includes the launch its fixture makes (a few minutes on 2 busy cores)
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1500)]

POOL = {"pool": True, "steps": 3, "reorder": {"mode": "loader_order"}}
# each plant of this launch trains the case it is planted in, for one step
PLANTED_IN = {"per_sample_whole_row": "per_sample_qwen3_5"}


def two_rank_cases(tmp) -> dict:
    from tests import family_dirs
    skewed = skewed_source(tmp / "skewed", dp=2)
    text = text_source(tmp)
    vision = [{"name": "shapes", "path": "builtin:shapes"}, text]
    cases = {
        "pool_qwen2_vl": {"stages": [3], "sources": [skewed], **POOL,
                          "model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q"))},
        "pool_llava_next": {"stages": [3], "sources": [skewed], **POOL,
                            "model_dir": str(family_dirs.make_llava_next_dir(tmp / "n"))},
        "pool_llava_zero2": {"stages": [2], "sources": [skewed], **POOL},
        "per_sample_qwen3_5": {"stages": [3], "sources": vision, "steps": 3, "model_dir": str(
            family_dirs.make_generic_dir(tmp / "q35", "qwen3_5"))},
        # test_parity's pp_composed_uniform under ZeRO-1 (whose optimizer holds flat partitions)
        "pp_composed_uniform_zero1": {
            "stages": [1], "placement": "uniform", "model": pipeline.COMPOSED,
            "sources": [pipeline.SHAPES_TONES, text], "max_seq_len": 160, "steps": 3,
            "train": PP_BATCH, "resume_at": 2, "split": "layers", "parts": [0, 2, 5],
            "clip": pipeline.CLIP},
        # "bubbles" under ZeRO-1 (the quick tier's ZeRO-0 case), items in later micro-batches
        "pp_composed_bubbles_zero1": {
            "stages": [1], "placement": "bubbles", "model": pipeline.COMPOSED,
            "sources": [pipeline.SHAPES_TONES, text], "max_seq_len": 160, "steps": 3,
            "train": PP_BATCH, "clip": pipeline.CLIP, "reorder": {"mode": "loader_order"},
            "resume_at": 2},
    }
    return {**cases, **{plant: {**cases[PLANTED_IN[plant]], "plant": plant, "steps": 1}
                        for plant in plants.for_launch("dp_slow")}}


PP4_COMPOSED = {**pipeline.COMPOSED, "llm": {"config": {**pipeline.COMPOSED["llm"]["config"],
                                                        "num_hidden_layers": 6}}}


def four_rank_cases(tmp) -> dict:
    skewed = skewed_source(tmp / "skewed", dp=4, rows=64)  # 4 images a round on rank 0
    text = text_source(tmp)
    pp4 = {"stages": [1], "pp": 4, "layers": 6, "steps": 3, "train": PP_BATCH,
           "sources": [{"name": "shapes", "path": "builtin:shapes"}, text]}
    return {"pool_llava_w4": {"stages": [3], "sources": [skewed], **POOL,
                              "train": {"global_batch_size": 16, "micro_batch_size": 4}},
            "pp4_stage0": {**pp4, "placement": "stage0"},
            "pp4_uniform": {**pp4, "placement": "uniform"},
            # the image+audio composition over 4 stages, its encoders in the bubbles (ZeRO-1)
            "pp4_bubbles": {**pp4, "placement": "bubbles", "model": PP4_COMPOSED,
                            "sources": [pipeline.SHAPES_TONES, text],
                            "max_seq_len": 160, "reorder": {"mode": "loader_order"}}}


def _launch(tmp_path_factory, world: int, make_cases) -> tuple[dict, list, object]:
    tmp = tmp_path_factory.mktemp(f"parity_slow_w{world}")
    cases = make_cases(tmp)
    results = run_on_ranks(_train_ranks, world, args=(cases, str(tmp / "dp")), timeout=1200)
    return cases, results, tmp


def _launched(request, world: int):
    """The launch of `world` ranks (only that one is started for a test that needs it)."""
    return request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[world])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 2, two_rank_cases)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 4, four_rank_cases)


@pytest.mark.parametrize("world", [2, 4])
def test_encoder_pool_on_more_families_and_ranks(world, request):
    cases, results, tmp = _launched(request, world)
    pools = [name for name, case in cases.items() if case.get("pool")]
    assert pools
    for name in pools:  # loader order: the ranks' keys are the global batches to replay
        _check(name, cases[name], results, tmp, dp=None)  # asserts ranks 1.. encoded rank 0's


def test_per_sample_layers_on_two_ranks_under_zero3(two_ranks):
    cases, results, tmp = two_ranks
    _check("per_sample_qwen3_5", cases["per_sample_qwen3_5"], results, tmp, dp=2)


@pytest.mark.parametrize("plant", plants.for_launch("dp_slow"))
def test_plant_is_caught(plant, two_ranks):
    cases, results, tmp = two_ranks
    with pytest.raises(AssertionError, match="ZeRO-"):  # the oracle's comparison names the stage
        _check(plant, cases[plant], results, tmp, dp=2)


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_single_process(world, request):
    """"uniform" under ZeRO-1 at PP=2 (2 ranks); PP=4, both placements (4 ranks)."""
    cases, results, tmp = _launched(request, world)
    piped = [name for name, case in cases.items() if "placement" in case]
    assert piped
    for name in piped:
        _check_pipeline(name, cases[name], results, tmp)
