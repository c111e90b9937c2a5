"""The per-sequence SP degree (`parallel.max_sequence_sp`, ByteScale's hybrid data parallelism):
no static SP; every rank runs ordinary sequences alone, and a sequence longer than a micro-batch
(here: more than PACK tokens, an image inside it) runs on a block of 2 or 4 ranks with Ulysses
attention, its image encoded by one block member and resharded to the shard that holds its
placeholders. Fixed-count reordering, so the global batch is the one plain loaders give in
loader order.
"""

from tests import oracle
from tests.dist.sequence_parallel.harness import STEPS, make_config
from tests.fixtures import ds_config

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


def check_per_sequence(name, cfg, world, per_rank, steps: int = STEPS, pooled=False) -> None:
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


def cases(world: int) -> list:
    return [c for c in PER_SEQUENCE if c[2] == world]


def train(rank, launch, families, out_dir) -> dict:
    results = {}
    for family, stage, _ in cases(launch.world):
        name = f"per_sequence-{family}-zero{stage}-w{launch.world}"
        cfg = per_sequence_config(families, family, f"{out_dir}/{name}", launch.world, launch.long)
        results[name] = oracle.train_on_rank(rank, launch.world, cfg, ds_config(stage), STEPS)
    return results


def check(launch, families, tmp_path) -> None:
    world, results = launch.world, launch.results
    for family, stage, _ in cases(world):
        name = f"per_sequence-{family}-zero{stage}-w{world}"
        cfg = per_sequence_config(families, family, str(tmp_path / f"ref_{name}"), world,
                                  launch.long)
        check_per_sequence(name, cfg, world, [r[name] for r in results])
