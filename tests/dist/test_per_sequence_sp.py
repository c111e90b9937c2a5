"""Per-sequence SP degree (ByteScale's hybrid data parallelism) equals one process, exactly.

Every rank runs alone on ordinary sequences; a sequence longer than a micro-batch (here: more
than `PACK` tokens, an image inside it) runs on a block of 2 or 4 ranks with Ulysses attention,
its image encoded by one block member and resharded to the shard that holds its placeholders.
Each case trains 3 optimizer steps through DeepSpeed (fixed-count reordering, so the global batch
is the one `dp` plain loaders give in loader order) and is compared with the oracle
(`tests/oracle.py`): one process, plain PyTorch. Loss (rel 1e-6), the full reduced gradients
after the first backward, the parameters after the last step (rel 1e-5).
"""

import pytest

from tests import oracle
from tests.dist.test_sequence_parallel import families, make_config  # noqa: F401 (fixture)
from tests.fixtures import ds_config, long_source
from tests.harness import run_on_ranks

STEPS = 3
LR = 1e-3
PARAM_ATOL = 2e-3 * LR * STEPS  # see test_parity.py: Adam and reduction-order noise
PACK, MAX_LEN = 300, 512  # long samples have ~380 tokens: they need 2 ranks' micro-batches
# every family, ZeRO stage and world size, and every (stage, world) pair, in 4 cases (the suite's
# time is scarce; all 6 family x world cases pass too)
#        family      ZeRO world
CASES = [("llava", 1, 2), ("qwen2_vl", 3, 2), ("composed", 3, 4), ("qwen2_vl", 1, 4)]


def per_sequence_config(families, family: str, out_dir: str, world: int, long: dict):
    from ds_omni.config import ReorderConfig, SourceConfig, from_dict
    cfg = make_config(families[family], out_dir, sp=1, reorder=False)
    cfg.data.sources.append(from_dict(SourceConfig, long))
    cfg.data.max_seq_len, cfg.data.pack_tokens = MAX_LEN, PACK
    cfg.data.reorder = ReorderConfig(mode="fixed", group_size=world)
    cfg.parallel.max_sequence_sp = world
    return cfg


def _ranks(rank, world, cases, families, out_dir, long):
    results = {}
    for family, stage, _ in cases:
        name = f"{family}-zero{stage}-w{world}"
        cfg = per_sequence_config(families, family, f"{out_dir}/{name}", world, long)
        results[name] = oracle.train_on_rank(rank, world, cfg, ds_config(stage), STEPS)
    return results


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_per_sequence_sp_matches_single_process(world, families, tmp_path):  # noqa: F811
    from ds_omni.model.build import build_model
    cases = [c for c in CASES if c[2] == world]
    long = long_source(tmp_path, weight=0.3, words=300)
    results = run_on_ranks(_ranks, world, timeout=900, args=(
        cases, families, str(tmp_path / "hdp"), long))
    for family, stage, _ in cases:
        name = f"{family}-zero{stage}-w{world}"
        per_rank = [r[name] for r in results]
        cfg = per_sequence_config(families, family, str(tmp_path / f"ref_{name}"), world, long)
        want = oracle.reference_step_keys(cfg, build_model(cfg.model), world, STEPS)
        for step in range(STEPS):
            got = [k for r in per_rank for k in r["keys"][step]]
            assert sorted(got) == want[step], f"{name} step {step}: another batch (or a sample twice)"
        # long sequences really ran on blocks, with their images resharded inside the block
        assert sum(r["block_rows"] for r in per_rank) >= 2, name
        assert sum(r["block_rows_with_items"] for r in per_rank) >= 1, name
        ref = oracle.run_reference(cfg, want)
        oracle.assert_matches(ref, per_rank[0], name, param_atol=PARAM_ATOL)
        oracle.assert_moved(ref, name)
