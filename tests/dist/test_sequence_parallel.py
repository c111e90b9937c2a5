"""LLM Ulysses sequence parallelism with adaptive resharding equals one process, exactly.

The acceptance test of decoupled encoder/LLM parallelism, part 1. Each case trains 3 optimizer
steps through DeepSpeed on 2 ranks (sp=2) or 4 ranks (dp=2 x sp=2) and is compared with the
oracle (`tests/oracle/`): one process, plain PyTorch, on global batches that `dp` loaders in
loader order produce there (not the ranks' keys). Loss (rel 1e-6), the full reduced gradients of
every step, and the parameters after the last step (each tensor to 0.1 % of its update) must
agree; `oracle.assert_split_work` checks that the SP work really was split.

The 11 design cases and the encoder pool's 2 (POOL) cover every pair of values of every two axes
(family x stage, family x world, family x reordering, stage x world, stage x reordering, world x
reordering) at least once, with only 5 cases on 4 ranks; `test_design_covers_every_pair` checks
that.
- llava: the demo composition (CLIP + Llama, 4 query / 2 KV heads);
- qwen2_vl: an HF directory (native-resolution images, 3-D M-RoPE positions), with a text-only
  source mixed in, so that some rows have no image at all;
- composed: CLIP + Whisper + Qwen2 with ONE KV head (fewer KV heads than sp ranks), images and
  audio clips in the same rows, plus text-only rows.
llava_next, qwen2_audio and gemma3 (bidirectional image blocks, sliding windows) add one case
each.

Long-short SP inside the encoders (`parallel.encoder_sp`): SPLIT_ALL cases encode every image and
clip over both ranks of its SP group, the others run the "auto" threshold; the 2-rank launch first
checks each encoder kind's split item against the item encoded whole (tests/encoder_pieces.py).

The per-sequence SP degree (`parallel.max_sequence_sp`, ByteScale's hybrid data parallelism) is
checked the same way in the same launches (PER_SEQUENCE, at the end of this file): no static SP,
long sequences on blocks of 2 or 4 ranks; and the encoder pool (`parallel.encoder_pool`) under
static SP (POOL) and under the per-sequence degree (POOL_PER_SEQUENCE) in the 4-rank launch. Ranks are started once per world size and loop over all their cases.

The loss and gradients cannot see SP ranks that each compute the whole row (ZeRO sums an SP
group's gradients: doubled targets and a doubled loss cancel), so every case also checks that the
work was split (`oracle.assert_split_work`: targets trained once, different shards per rank, and
the model's counts of Ulysses calls, resharding all-to-alls, rows moved and pieces encoded).
`test_plant_is_caught` shows the checks fail on each planted error of the 2-rank launch
(`tests/plants/`: two resharded rows swapped, a block's `sp_block` ignored, whole rows on every
SP rank), one step each.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import pytest

from tests import oracle, plants
from tests.fixtures import (TINY_VISION, ds_config, eval_sources, long_source, text_source,
                            tiny_config)
from tests.harness import run_on_ranks

STEPS = 3
LR = 1e-3

WHISPER = {"model_type": "whisper", "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2,
           "encoder_ffn_dim": 64, "decoder_layers": 1, "decoder_attention_heads": 2,
           "decoder_ffn_dim": 32, "num_mel_bins": 80, "max_source_positions": 50}
QWEN2_ONE_KV = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                "max_position_embeddings": 512, "tie_word_embeddings": False}

#          family      ZeRO world reorder   (4-rank cases are the costly ones: as few as cover)
# (composed, ZeRO-1, 4 ranks) is the encoder pool case POOL below, which counts towards the pairs
DESIGN = [("llava", 3, 4, False), ("qwen2_vl", 0, 4, True),
          ("llava", 2, 4, True),
          ("llava", 0, 2, False), ("llava", 1, 2, True),
          ("qwen2_vl", 1, 2, False), ("qwen2_vl", 2, 2, False), ("qwen2_vl", 3, 2, True),
          ("composed", 0, 2, True), ("composed", 2, 2, True), ("composed", 3, 2, False)]
# ZeRO-3 + Ulysses + recomputed decoder layers (the all-to-alls run again in backward)
CHECKPOINTED = {("llava", 3, 4, False)}
# validation under ZeRO-3 + SP after the last step: equal to one process evaluating the whole set
EVALUATED = {("qwen2_vl", 3, 2, True)}
# the other two families train under SP too (any-resolution tiles; Whisper clips)
EXTRA = [("llava_next", 2, 2, False), ("qwen2_audio", 3, 2, True),
         # Gemma 3 through the generic adapter: image blocks attended both ways and 4-token
         # sliding windows, over the whole row that Ulysses gathers per head
         ("gemma3", 1, 2, False)]
# long-short SP for encoders with threshold 0: EVERY image and clip is encoded by both ranks of its
# SP group, a piece each (Ulysses inside the tower); under ZeRO-3 the other groups' ranks top up
# with dummy encoder runs. The other cases run the default "auto" threshold.
SPLIT_ALL = {("llava", 3, 4, False), ("qwen2_vl", 1, 2, False), ("composed", 3, 2, False),
             ("qwen2_audio", 3, 2, True)}


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


def make_config(family: dict, out_dir: str, *, sp: int, reorder: bool, evaluate: bool = False):
    from ds_omni.config import ModelConfig, ReorderConfig, SourceConfig, from_dict
    cfg = tiny_config(out_dir, steps=STEPS)
    cfg.parallel.sp = sp
    if reorder:
        cfg.data.reorder = ReorderConfig(mode="fixed", group_size=2)
    if family.get("model_dir"):
        cfg.model = ModelConfig(pretrained=family["model_dir"])
    if family.get("model"):
        cfg.model = from_dict(ModelConfig, family["model"], "model")
    if family.get("sources"):
        cfg.data.sources = [from_dict(SourceConfig, s) for s in family["sources"]]
    cfg.data.max_seq_len = family.get("max_seq_len", cfg.data.max_seq_len)
    if evaluate:
        cfg.data.eval_sources = [from_dict(SourceConfig, s) for s in family["eval_sources"]]
    return cfg


def _case_name(case) -> str:
    family, stage, world, reorder = case
    return f"{family}-zero{stage}-w{world}-{'fixed' if reorder else 'loader_order'}"


def _encoder_pieces(families, out_dir) -> dict:
    """Every encoder kind, one long item split over 2 ranks against the item encoded whole
    (tests/encoder_pieces.py); the Qwen2-VL tower also with its layers recomputed in backward."""
    import numpy as np
    import torch
    from PIL import Image
    import torch.distributed as dist
    from pathlib import Path
    from ds_omni.model.build import build_model
    from tests.data_files import write_video
    from tests.encoder_pieces import check_pieces
    rng = np.random.default_rng(0)
    raw = {"image": Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)),
           "audio": {"array": 0.1 * rng.standard_normal(16000).astype(np.float32),
                     "sampling_rate": 16000}}
    out = {}
    for family in ("llava", "composed", "qwen2_vl", "qwen2_audio"):
        torch.manual_seed(0)  # the same random towers on both ranks
        built = build_model(make_config(families[family], out_dir, sp=1, reorder=False).model)
        for name, encoder in built.model.encoders.items():
            out[f"{family}/{name}"] = check_pieces(built, name, raw[encoder.modality])
        if family == "qwen2_vl":
            out["qwen2_vl/vision/recomputed"] = check_pieces(built, "vision", raw["image"],
                                                             checkpointed=True)
            # a video: 6 temporal patches, whose frames the pieces' attention keeps apart
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            video = write_video(Path(out_dir) / f"long_rank{dist.get_rank()}.mp4", 12, 40, 24)
            out["qwen2_vl/video"] = check_pieces(built, "vision", str(video), processor="video")
        if family == "llava":
            out["llava/vision/frozen"] = check_pieces(built, "vision", raw["image"], frozen=True)
    return out


def _ranks(rank, world, cases, families, out_dir, per_sequence_cases, long, skewed=None,
           planted=()):
    results = {"pieces": _encoder_pieces(families, out_dir) if world == 2 else {}}
    for plant in planted:  # first: a planted error that breaks a rank ends the launch early
        results[f"plant-{plant}"] = oracle.train_on_rank(
            rank, world, planted_config(families, plant, f"{out_dir}/plant-{plant}", long),
            ds_config(PLANTED[plant][2]), 1, plant)
    for case in cases:
        family, stage, _, reorder = case
        cfg = make_config(families[family], f"{out_dir}/{_case_name(case)}", sp=2, reorder=reorder,
                          evaluate=case in EVALUATED)
        cfg.model.activation_checkpointing = case in CHECKPOINTED
        if case in SPLIT_ALL:
            cfg.parallel.encoder_sp = 0.0
        results[_case_name(case)] = oracle.train_on_rank(rank, world, cfg, ds_config(stage), STEPS)
    for family, stage, _ in per_sequence_cases:  # the same launch: ranks start once per world
        name = f"per_sequence-{family}-zero{stage}-w{world}"
        cfg = per_sequence_config(families, family, f"{out_dir}/{name}", world, long)
        results[name] = oracle.train_on_rank(rank, world, cfg, ds_config(stage), STEPS)
    for family, stage in POOL if skewed else ():
        name = f"pool-{family}-zero{stage}"
        cfg = pool_config(families, family, f"{out_dir}/{name}", skewed)
        results[name] = oracle.train_on_rank(rank, world, cfg, ds_config(stage), STEPS)
    for family, stage in POOL_PER_SEQUENCE if skewed else ():
        name = f"pool_per_sequence-{family}-zero{stage}"
        cfg = pool_per_sequence_config(families, family, f"{out_dir}/{name}", skewed)
        with _plans_seen() as plans:
            results[name] = oracle.train_on_rank(rank, world, cfg, ds_config(stage), STEPS)
        results[name]["block_items_moved"] = sum(  # a block row's items encoded outside it
            len(p.items[i].group) > 1 for p in plans for i in p.moved())
    return results


@dataclass
class Launch:
    """One launch of `world` ranks over all its cases: the data it was given, what each rank
    returned."""

    world: int
    long: dict  # the long-sequence source of PER_SEQUENCE
    skewed: dict | None  # the encoder pool's sources (4 ranks)
    results: list[dict]


@pytest.fixture(scope="module")
def launches(families, tmp_path_factory):
    """world -> its `Launch`, started at the first test that asks (the parity test and the
    plants share the 2-rank one)."""
    done: dict[int, Launch] = {}

    def launch(world: int) -> Launch:
        if world not in done:
            tmp = tmp_path_factory.mktemp(f"sp{world}")
            long = long_source(tmp, weight=0.3, words=300)
            skewed = skewed_sources(tmp) if world == 4 else None
            results = run_on_ranks(_ranks, world, timeout=900, args=(
                [c for c in DESIGN + EXTRA if c[2] == world], families, str(tmp / "sp"),
                [c for c in PER_SEQUENCE if c[2] == world], long, skewed,
                plants.for_launch(f"sp{world}")))
            done[world] = Launch(world, long, skewed, results)
        return done[world]
    return launch


@pytest.mark.dist
# 4 ranks (about 80 s) in the slow tier: the 2-rank launch keeps every family, ZeRO stage,
# reordering and the per-sequence degree in the quick tier, and tests/unit/parallelize/test_encoder_pool.py
# the pool's plans under SP
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sequence_parallel_matches_single_process(world, families, launches, tmp_path):
    """Static sp=2 (DESIGN + EXTRA) and the per-sequence degree (PER_SEQUENCE) on `world` ranks."""
    cases = [c for c in DESIGN + EXTRA if c[2] == world]
    per_sequence = [c for c in PER_SEQUENCE if c[2] == world]
    launch = launches(world)
    results, long, skewed = launch.results, launch.long, launch.skewed
    dp = world // 2
    for name, got in results[0]["pieces"].items():
        assert got["piece_rows"] < got["rows"], name  # the item really was split
        assert got["row_diff"] <= 1e-6 * got["row_scale"], (name, got)
        assert got["grad_diff"] <= 1e-5 * got["grad_scale"], (name, got)
    assert len(results[0]["pieces"]) == (8 if world == 2 else 0)
    for case in cases:
        name = _case_name(case)
        cfg = make_config(families[case[0]], str(tmp_path / f"ref_{name}"), sp=1, reorder=False,
                          evaluate=case in EVALUATED)
        _check_case(name, cfg, dp, [r[name] for r in results])
        if case in SPLIT_ALL:  # items really were split over the group
            assert sum(r[name]["long_items"] for r in results) > 0, name
    for family, stage, _ in per_sequence:
        name = f"per_sequence-{family}-zero{stage}-w{world}"
        cfg = per_sequence_config(families, family, str(tmp_path / f"ref_{name}"), world, long)
        _check_per_sequence(name, cfg, world, [r[name] for r in results])
    for family, stage in POOL if skewed else ():
        name = f"pool-{family}-zero{stage}"
        _check_pool(name, pool_config(families, family, str(tmp_path / f"ref_{name}"), skewed),
                    [r[name] for r in results])
    for family, stage in POOL_PER_SEQUENCE if skewed else ():
        name = f"pool_per_sequence-{family}-zero{stage}"
        cfg = pool_per_sequence_config(families, family, str(tmp_path / f"ref_{name}"), skewed)
        _check_pool_per_sequence(name, cfg, [r[name] for r in results])


def _check_case(name, cfg, dp, per_rank, steps: int = STEPS) -> None:
    from ds_omni.model.build import build_model
    want_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), dp, steps)
    for step in range(steps):
        # ranks of one SP group (consecutive: 0-1, 2-3) train on the same samples
        assert per_rank[0]["keys"][step] == per_rank[1]["keys"][step], name
        got = sorted(k for r in per_rank[::2] for k in r["keys"][step])
        assert got == want_keys[step], f"{name} step {step}: the ranks trained another batch"
    ref = oracle.run_reference(cfg, want_keys)
    oracle.assert_matches(ref, per_rank[0], name)
    for r in per_rank[1:]:
        assert r["losses"] == per_rank[0]["losses"], name
    oracle.assert_split_work(ref, per_rank, name)
    _check_one_reader(name, cfg, per_rank)
    if cfg.data.eval_sources:  # each rank evaluated its shard of its dp rank's rows
        assert all(r["eval"] == per_rank[0]["eval"] for r in per_rank), name
        (want,) = oracle.reference_eval_losses(cfg, [per_rank[0]["params"]])
        assert per_rank[0]["eval"]["eval_loss"] == pytest.approx(want, rel=1e-6), name
    oracle.assert_moved(ref, name)
    if not name.startswith("llava"):
        # rows with no image or audio at all, and ranks with nothing to encode, really happened
        assert sum(r["row_without_items"] for r in per_rank) > 0, name
        assert sum(r["nothing_to_encode"] for r in per_rank) > 0, name


def _check_one_reader(name, cfg, per_rank, sp: int = 2) -> None:
    """One reader per SP group (`data.shared_reading`): the first rank of each group (0, 2)
    read the rows and decoded the images; its peers read and decoded nothing."""
    for rank, r in enumerate(per_rank):
        rows, _, items = r["read_counts"]
        if rank % sp:
            assert rows == items == 0, f"{name}: SP peer rank {rank} read {rows} rows, {items} items"
        else:
            assert rows > 0 and items > 0, f"{name}: reader rank {rank} read {rows} rows, {items} items"


def test_design_covers_every_pair():
    from itertools import combinations, product
    design = DESIGN + [(family, stage, 4, False) for family, stage in POOL]
    values = [sorted({c[axis] for c in design}) for axis in range(4)]
    assert values == [["composed", "llava", "qwen2_vl"], [0, 1, 2, 3], [2, 4], [False, True]]
    for a, b in combinations(range(4), 2):
        missing = set(product(values[a], values[b])) - {(c[a], c[b]) for c in design}
        assert not missing, (a, b, missing)


# ------------------------------------------------------------------ per-sequence SP degree
# Every rank runs ordinary sequences alone; a sequence longer than a micro-batch (here: more than
# PACK tokens, an image inside it) runs on a block of 2 or 4 ranks with Ulysses attention, its
# image encoded by one block member and resharded to the shard that holds its placeholders.
# Fixed-count reordering, so the global batch is the one plain loaders give in loader order.
PACK, MAX_LEN = 300, 512  # long samples have ~380 tokens: they need 2 ranks' micro-batches
# ZeRO stages 1 and 3, both world sizes and every (stage, world) pair, each family at least once;
# POOL_PER_SEQUENCE adds LLaVA, ZeRO-3, 4 ranks with the encoder pool on
#               family      ZeRO world
PER_SEQUENCE = [("llava", 1, 2), ("qwen2_vl", 3, 2), ("qwen2_vl", 1, 4), ("composed", 3, 4)]


def per_sequence_config(families, family: str, out_dir: str, world: int, long: dict):
    from ds_omni.config import ReorderConfig, SourceConfig, from_dict
    cfg = make_config(families[family], out_dir, sp=1, reorder=False)
    cfg.data.sources.append(from_dict(SourceConfig, long))
    cfg.data.max_seq_len, cfg.data.pack_tokens = MAX_LEN, PACK
    cfg.data.reorder = ReorderConfig(mode="fixed", group_size=world)
    cfg.parallel.max_sequence_sp = world
    return cfg


def _check_per_sequence(name, cfg, world, per_rank, steps: int = STEPS, pooled=False) -> None:
    from ds_omni.model.build import build_model
    want = oracle.reference_step_keys(cfg, build_model(cfg.model), world, steps)
    for step in range(steps):
        got = [k for r in per_rank for k in r["keys"][step]]
        assert sorted(got) == want[step], f"{name} step {step}: another batch (or a sample twice)"
    # long sequences really ran on blocks, with their images resharded inside the block
    assert sum(r["block_rows"] for r in per_rank) >= 2, name
    assert sum(r["block_rows_with_items"] for r in per_rank) >= 1, name
    ref = oracle.run_reference(cfg, want)
    oracle.assert_matches(ref, per_rank[0], name)
    oracle.assert_split_work(ref, per_rank, name, pooled=pooled)
    oracle.assert_moved(ref, name)


# ------------------------------------------------------------------ the encoder pool under SP
# parallel.encoder_pool="dp" at dp2 x sp2 (the 4-rank launch): the rows of data-parallel rank 0
# (ranks 0-1) hold every image (and clip); ranks 2-3's are text. Each rank packs one row of 4
# samples a step. Step 0's row of ranks 0-1 has one sample with media (skew8), whose image (the
# costlier item) "auto" long-short splits over ranks 0-1, while the composed model's clip, short,
# goes to rank 2 or 3; steps 1-2 have 4 images (and 4 clips) a row, spread over all 4 ranks.
# Every short item's rows go to the shard(s) holding its placeholders. Loader order: the pool
# moves encoder work, never samples, so the ranks' own keys are the global batches to replay.
POOL = [("llava", 3), ("composed", 1)]


def skewed_sources(tmp_path) -> dict:
    from tests.data_files import skewed_source
    alone = (9, 10, 11)  # rank 0 reads rows 8-11, 12-15, 20-23 in its first three steps
    (tmp_path / "long_images").mkdir()
    return {"llava": skewed_source(tmp_path / "skewed", text_rows=alone),
            "composed": skewed_source(tmp_path / "skewed_audio", audio=True, text_rows=alone),
            # POOL_PER_SEQUENCE: long sequences of 4 and of 1 image, in turn
            "long_images": long_source(tmp_path / "long_images", weight=0.15, words=300,
                                       images=(4, 1))}


def pool_config(families, family: str, out_dir: str, skewed: dict):
    from ds_omni.config import ReorderConfig, SourceConfig, from_dict
    cfg = make_config(families[family], out_dir, sp=2, reorder=False)
    cfg.data.sources = [from_dict(SourceConfig, skewed[family])]
    cfg.data.reorder = ReorderConfig(mode="loader_order")
    cfg.parallel.encoder_pool = "dp"
    cfg.train.micro_batch_size = 4
    return cfg


def _check_pool(name, cfg, per_rank) -> None:
    for step in range(STEPS):  # ranks of one SP group (0-1, 2-3) train on the same samples
        assert per_rank[0]["keys"][step] == per_rank[1]["keys"][step], name
        assert per_rank[2]["keys"][step] == per_rank[3]["keys"][step], name
    steps = [sorted(per_rank[0]["keys"][s] + per_rank[2]["keys"][s]) for s in range(STEPS)]
    assert all(len(keys) == len(set(keys)) > 0 for keys in steps), name
    ref = oracle.run_reference(cfg, steps)
    oracle.assert_matches(ref, per_rank[0], name)
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), name
    oracle.assert_split_work(ref, per_rank, name, pooled=True)
    oracle.assert_moved(ref, name)
    # the skew was real: ranks 2-3 had nothing of their own to encode, yet encoded rank 0-1's
    # items; and a long item was split over ranks 0-1 in the same rounds
    assert [r["nothing_to_encode"] == STEPS for r in per_rank] == [False, False, True, True]
    assert [r["pool_items_moved"] > 0 for r in per_rank] == [False, False, True, True], name
    assert per_rank[0]["long_items"] > 0 and per_rank[2]["long_items"] == 0, name


# ------------------------------------------------- the encoder pool under the per-sequence degree
# parallel.encoder_pool="dp" with max_sequence_sp=2 on 4 ranks (the 4-rank launch): long
# sequences with 4 images (mid-row, across the shard boundary) and with 1 image, in turn, run on
# blocks of 2 ranks (step 1: two rounds on blocks 0-1 and 2-3), the other sequences alone. Group
# sizes thus change from round to round, and the pool spreads each round's short items over all
# 4 ranks: when a 4-image row's block meets a 1-image row's, some of the first's images are
# encoded outside its block, their rows sent to the block member(s) holding their placeholders
# (evenly loaded blocks keep their own). Rounds that mix a block with lone or idle ranks are checked by the
# pure tests (tests/unit/parallelize/test_encoder_pool.py). Fixed-count reordering, as in PER_SEQUENCE.
POOL_PER_SEQUENCE = [("llava", 3)]


def pool_per_sequence_config(families, family: str, out_dir: str, skewed: dict):
    cfg = per_sequence_config(families, family, out_dir, 4, skewed["long_images"])
    cfg.parallel.max_sequence_sp = 2
    cfg.parallel.encoder_pool = "dp"
    return cfg


@contextmanager
def _plans_seen():
    """Every round's pool plan this rank computes, while inside."""
    from ds_omni.parallelize.encoder_pool import EncoderPool
    plans, plan_step = [], EncoderPool.plan_step

    def spy(self, micro_batches):
        out = plan_step(self, micro_batches)
        plans.extend(out)
        return out
    with mock.patch.object(EncoderPool, "plan_step", spy):
        yield plans


def _check_pool_per_sequence(name, cfg, per_rank) -> None:
    _check_per_sequence(name, cfg, 4, per_rank, pooled=True)
    # the pool moved images of a block's row to ranks outside the block (every rank's plans agree)
    assert len({r["block_items_moved"] for r in per_rank}) == 1, name
    assert per_rank[0]["block_items_moved"] > 0, name


# ------------------------------------------------------------------------- planted errors
# One step each, in the 2-rank launch (`tests/plants/`): plant -> (kind of case, family, ZeRO).
# "static": sp=2 on 2 ranks (make_config); "per_sequence": the per-sequence degree (PER_SEQUENCE).
PLANTED = {"reshard_rows_swapped": ("static", "llava", 0),
           "sp_block_ignored": ("per_sequence", "llava", 1),
           "sp_whole_row": ("static", "llava", 0),
           "reader_wrong_pixels": ("static", "llava", 0)}
# what each failure names: swapped rows and a block's row attended shard by shard change the loss
# itself; whole rows on both SP ranks leave loss and gradients exact (ZeRO sums the SP group's
# gradients: doubled targets and loss cancel), only the split-work checks see them
CAUGHT_BY = {"reshard_rows_swapped": "losses .*, the reference's",
             "sp_block_ignored": "losses .*, the reference's",
             "sp_whole_row": "trained on more than one rank",
             "reader_wrong_pixels": "losses .*, the reference's"}


def planted_config(families, plant: str, out_dir: str, long: dict):
    kind, family, _ = PLANTED[plant]
    if kind == "per_sequence":
        return per_sequence_config(families, family, out_dir, 2, long)
    return make_config(families[family], out_dir, sp=2, reorder=False)


def test_every_sp_plant_has_a_case():
    assert sorted(PLANTED) == plants.for_launch("sp2") and not plants.for_launch("sp4")
    assert set(CAUGHT_BY) == set(PLANTED)


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("sp2"))
def test_plant_is_caught(plant, families, launches, tmp_path):
    """The checks of the honest cases fail on a planted error, and name what differs."""
    launch = launches(2)
    per_rank = [r[f"plant-{plant}"] for r in launch.results]
    kind, family, _ = PLANTED[plant]
    cfg = planted_config(families, plant, str(tmp_path / "ref"), launch.long)
    with pytest.raises(AssertionError, match=CAUGHT_BY[plant]):
        if kind == "per_sequence":
            _check_per_sequence(plant, cfg, 2, per_rank, steps=1)
        else:
            _check_case(plant, cfg, 1, per_rank, steps=1)
