"""LLM Ulysses sequence parallelism with adaptive resharding equals one process, exactly.

The acceptance test of decoupled encoder/LLM parallelism, part 1. Each case trains 3 optimizer
steps through DeepSpeed on 2 ranks (sp=2) or 4 ranks (dp=2 x sp=2) and is compared with the
oracle (`tests/oracle/`): one process, plain PyTorch, on global batches that `dp` loaders in
loader order produce there (not the ranks' keys). Loss (rel 1e-6), the full reduced gradients of
every step, and the parameters after the last step (each tensor to 0.1 % of its update) must
agree; `oracle.assert_split_work` checks that the SP work really was split.

One module of `tests/dist/sequence_parallel/` a feature, each its cases, what its ranks train and
its checks (a case is added there): `static.py` (sp=2, the design that covers every pair of
axes), `encoder_sp.py` (long-short SP inside the encoders), `per_sequence.py`
(`parallel.max_sequence_sp`), `pool.py` (the encoder pool under SP), `planted.py` (the planted
errors of the 2-rank launch); `harness.py` holds what they share. Ranks are started once per
world size and loop over every feature's cases.

The loss and gradients cannot see SP ranks that each compute the whole row (ZeRO sums an SP
group's gradients: doubled targets and a doubled loss cancel), so every case also checks that the
work was split (`oracle.assert_split_work`: targets trained once, different shards per rank, and
the model's counts of Ulysses calls, resharding all-to-alls, rows moved and pieces encoded).
`test_plant_is_caught` shows the checks fail on each planted error of the 2-rank launch.
"""

import pytest

from tests import plants
from tests.dist.sequence_parallel import encoder_sp, per_sequence, planted, pool, static
from tests.dist.sequence_parallel.harness import QWEN2_ONE_KV, WHISPER, Launch, check_case
from tests.fixtures import TINY_VISION, eval_sources, long_source, text_source
from tests.harness import run_on_ranks

# in this order on the ranks: a planted error that breaks a rank ends the launch early
FEATURES = (encoder_sp, planted, static, per_sequence, pool)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    """Family name -> overrides of the tiny config (model and sources)."""
    from tests import family_dirs
    tmp = tmp_path_factory.mktemp("sp_families")
    text = text_source(tmp)
    return {
        "llava": {},
        "qwen2_vl": {"model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q")),
                     "sources": [{"name": "shapes", "path": "builtin:shapes"}, text],
                     "eval_sources": eval_sources(tmp)},
        "gemma3": {"model_dir": str(family_dirs.make_generic_dir(tmp / "g3", "gemma3")),
                   "sources": [{"name": "shapes", "path": "builtin:shapes"}, text]},
        "llava_next": {"model_dir": str(family_dirs.make_llava_next_dir(tmp / "n")),
                       "sources": [{"name": "shapes", "path": "builtin:shapes"}, text]},
        "qwen2_audio": {"model_dir": str(family_dirs.make_qwen2_audio_dir(tmp / "a")),
                        "sources": [{"name": "tones", "path": "builtin:tones",
                                     "schema": {"text": "conversations", "image": None,
                                                "audio": "audio"}}, text],
                        # its processor saved Qwen2-Audio's ChatML template: samples render with it
                        "max_seq_len": 192},
        "composed": {"model": {"tokenizer": "builtin:shapes", "vision": {"config": dict(TINY_VISION)},
                               "audio": {"config": WHISPER}, "llm": {"config": QWEN2_ONE_KV}},
                     "sources": [{"name": "shapes_tones", "path": "builtin:shapes_tones",
                                  "schema": {"text": "conversations", "image": "image",
                                             "audio": "audio"}}, text],
                     "max_seq_len": 160},
    }


def _ranks(rank, world, families, out_dir, launch: Launch) -> dict:
    results = {}
    for feature in FEATURES:
        results.update(feature.train(rank, launch, families, out_dir))
    return results


def start_launch(world: int, tmp_path_factory, fixture) -> Launch:
    """The launch of `world` ranks (the `launches` fixture, tests/dist/conftest.py): the parity
    test and the plants share the 2-rank one."""
    tmp = tmp_path_factory.mktemp(f"sp{world}")
    long = long_source(tmp, weight=0.3, words=300)
    skewed = pool.skewed_sources(tmp) if world == 4 else None
    launch = Launch(world, long, skewed, plants.for_launch(f"sp{world}"))
    launch.results = run_on_ranks(_ranks, world, timeout=900, args=(
        fixture("families"), str(tmp / "sp"), launch))
    return launch


@pytest.mark.dist
# 4 ranks (about 80 s) in the slow tier: the 2-rank launch keeps every family, ZeRO stage,
# reordering and the per-sequence degree in the quick tier, and
# tests/unit/parallelize/test_encoder_pool.py the pool's plans under SP
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sequence_parallel_matches_single_process(world, families, launches, tmp_path):
    """Every feature's cases on `world` ranks: static sp=2 (with its encoder pieces), the
    per-sequence degree, the encoder pool."""
    launch = launches(world)
    for feature in (encoder_sp, static, per_sequence, pool):
        feature.check(launch, families, tmp_path)


def test_design_covers_every_pair():
    from itertools import combinations, product
    design = static.DESIGN + [(family, stage, 4, False) for family, stage in pool.POOL]
    values = [sorted({c[axis] for c in design}) for axis in range(4)]
    assert values == [["composed", "llava", "qwen2_vl"], [0, 1, 2, 3], [2, 4], [False, True]]
    for a, b in combinations(range(4), 2):
        missing = set(product(values[a], values[b])) - {(c[a], c[b]) for c in design}
        assert not missing, (a, b, missing)


def test_every_sp_plant_has_a_case():
    assert sorted(planted.PLANTED) == plants.for_launch("sp2") and not plants.for_launch("sp4")
    assert set(planted.CAUGHT_BY) == set(planted.PLANTED)


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("sp2"))
def test_plant_is_caught(plant, families, launches, tmp_path):
    """The checks of the honest cases fail on a planted error, and name what differs."""
    launch = launches(2)
    per_rank = [r[f"plant-{plant}"] for r in launch.results]
    kind, family, _ = planted.PLANTED[plant]
    cfg = planted.planted_config(families, plant, str(tmp_path / "ref"), launch.long)
    with pytest.raises(AssertionError, match=planted.CAUGHT_BY[plant]):
        if kind == "per_sequence":
            per_sequence.check_per_sequence(plant, cfg, 2, per_rank, steps=1)
        else:
            check_case(plant, cfg, 1, per_rank, steps=1)
