"""The encoder pool (`parallel.encoder_pool`) under static SP (POOL) and under the per-sequence
degree (POOL_PER_SEQUENCE), in the 4-rank launch."""

from contextlib import contextmanager
from unittest import mock

from tests import oracle
from tests.dist.sequence_parallel.harness import STEPS, make_config
from tests.dist.sequence_parallel.per_sequence import check_per_sequence, per_sequence_config
from tests.fixtures import ds_config, long_source

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
    check_per_sequence(name, cfg, 4, per_rank, pooled=True)
    # the pool moved images of a block's row to ranks outside the block (every rank's plans agree)
    assert len({r["block_items_moved"] for r in per_rank}) == 1, name
    assert per_rank[0]["block_items_moved"] > 0, name


def train(rank, launch, families, out_dir) -> dict:
    results, skewed = {}, launch.skewed
    for family, stage in POOL if skewed else ():
        name = f"pool-{family}-zero{stage}"
        cfg = pool_config(families, family, f"{out_dir}/{name}", skewed)
        results[name] = oracle.train_on_rank(rank, launch.world, cfg, ds_config(stage), STEPS)
    for family, stage in POOL_PER_SEQUENCE if skewed else ():
        name = f"pool_per_sequence-{family}-zero{stage}"
        cfg = pool_per_sequence_config(families, family, f"{out_dir}/{name}", skewed)
        with _plans_seen() as plans:
            results[name] = oracle.train_on_rank(rank, launch.world, cfg, ds_config(stage), STEPS)
        results[name]["block_items_moved"] = sum(  # a block row's items encoded outside it
            len(p.items[i].group) > 1 for p in plans for i in p.moved())
    return results


def check(launch, families, tmp_path) -> None:
    results, skewed = launch.results, launch.skewed
    for family, stage in POOL if skewed else ():
        name = f"pool-{family}-zero{stage}"
        _check_pool(name, pool_config(families, family, str(tmp_path / f"ref_{name}"), skewed),
                    [r[name] for r in results])
    for family, stage in POOL_PER_SEQUENCE if skewed else ():
        name = f"pool_per_sequence-{family}-zero{stage}"
        cfg = pool_per_sequence_config(families, family, str(tmp_path / f"ref_{name}"), skewed)
        _check_pool_per_sequence(name, cfg, [r[name] for r in results])
