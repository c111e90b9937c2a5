"""The launch harness that every feature of `tests/dist/test_sequence_parallel.py` shares: the
tiny models' configs, the record of one launch, and the checks of a static-SP case.

A feature is a module of this package with `train(rank, launch, families, out_dir) -> dict` (its
cases on the ranks, keyed by case name) and `check(launch, families, tmp_path)` (its cases
against the oracle); the test module lists them, and the ranks of each world size start once
for all of them.
"""

from dataclasses import dataclass, field

import pytest

from tests import oracle
from tests.fixtures import tiny_config

STEPS = 3
LR = 1e-3

WHISPER = {"model_type": "whisper", "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2,
           "encoder_ffn_dim": 64, "decoder_layers": 1, "decoder_attention_heads": 2,
           "decoder_ffn_dim": 32, "num_mel_bins": 80, "max_source_positions": 50}
QWEN2_ONE_KV = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                "max_position_embeddings": 512, "tie_word_embeddings": False}


@dataclass
class Launch:
    """One launch of `world` ranks over all its cases: the data it was given, what each rank
    returned."""

    world: int
    long: dict  # the long-sequence source of PER_SEQUENCE
    skewed: dict | None  # the encoder pool's sources (4 ranks)
    planted: list[str] = field(default_factory=list)  # the plants its ranks train, one step each
    results: list[dict] = field(default_factory=list)  # per rank (empty on the ranks themselves)


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


def case_name(case) -> str:
    family, stage, world, reorder = case
    return f"{family}-zero{stage}-w{world}-{'fixed' if reorder else 'loader_order'}"


def check_case(name, cfg, dp, per_rank, steps: int = STEPS) -> None:
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
    check_one_reader(name, cfg, per_rank)
    if cfg.data.eval_sources:  # each rank evaluated its shard of its dp rank's rows
        assert all(r["eval"] == per_rank[0]["eval"] for r in per_rank), name
        (want,) = oracle.reference_eval_losses(cfg, [per_rank[0]["params"]])
        assert per_rank[0]["eval"]["eval_loss"] == pytest.approx(want, rel=1e-6), name
    oracle.assert_moved(ref, name)
    if not name.startswith("llava"):
        # rows with no image or audio at all, and ranks with nothing to encode, really happened
        assert sum(r["row_without_items"] for r in per_rank) > 0, name
        assert sum(r["nothing_to_encode"] for r in per_rank) > 0, name


def check_one_reader(name, cfg, per_rank, sp: int = 2) -> None:
    """One reader per SP group (`data.shared_reading`): the first rank of each group (0, 2)
    read the rows and decoded the images; its peers read and decoded nothing."""
    for rank, r in enumerate(per_rank):
        rows, _, items = r["read_counts"]
        if rank % sp:
            assert rows == items == 0, f"{name}: SP peer rank {rank} read {rows} rows, {items} items"
        else:
            assert rows > 0 and items > 0, f"{name}: reader rank {rank} read {rows} rows, {items} items"
