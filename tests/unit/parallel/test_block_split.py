"""Per-sequence blocks past the heads (`ParallelPlan.block_split`): Ulysses over the largest
degree dividing the heads, a ring across, by the rule the simulator prices
(`hdp.ulysses_ring_split`); the block's groups agree with the zigzag layout the loader cuts its
row by; `plan_run` plans such blocks and refuses what cannot run them, naming the fix. The
exactness of training under them: tests/dist/test_per_sequence_ring.py (slow tier)."""

import pytest

from ds_omni.config import ParallelConfig, ReorderConfig
from ds_omni.errors import ModelError
from ds_omni.parallel.hdp import ulysses_ring_split
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallel.zigzag import zigzag_layout
from tests import plants
from tests.fixtures import TINY_LLAMA, ds_config, tiny_config


def _plan(heads: int | None, world: int = 8, tp: int = 1) -> ParallelPlan:
    cfg = ParallelConfig(max_sequence_sp=world // tp, tp=tp)
    plan = ParallelPlan.from_config(cfg, world, ReorderConfig(mode="fixed", group_size=world))
    return plan if heads is None else plan.with_heads(heads)


@pytest.mark.parametrize("heads,size,split", [
    (2, 2, (2, 1)), (2, 4, (2, 2)), (2, 8, (2, 4)), (6, 4, (2, 2)), (32, 32, (32, 1)),
    (32, 64, (32, 2)), (None, 8, (8, 1))])
def test_block_split_is_the_simulators_rule(heads, size, split):
    plan = _plan(heads, world=max(size, 2))
    assert plan.block_split(size) == split == ulysses_ring_split(size, heads)


def test_ds_omni_plan_prints_the_blocks_rings():
    layout = _plan(2).layout()  # blocks of 2 (Ulysses alone), 4 and 8 (rings of 2 and 4)
    assert layout["sequence_block_ring_groups"] == [[0, 2], [1, 3], [4, 6], [5, 7],
                                                    [0, 2, 4, 6], [1, 3, 5, 7]]
    assert "sequence_block_ring_groups" not in _plan(8).layout()  # every block fits the heads


def test_heads_are_counted_per_tp_rank():
    assert _plan(8, world=8, tp=2).heads == 4
    assert _plan(2).sp_degrees == [2]  # Ulysses' part of the largest block; the ring is not sp


def test_block_groups_follow_the_zigzag_layout():
    """Sequence rank s of a block holds slots [s S, (s + 1) S) of the zigzag order, s = cp rank x
    ulysses + Ulysses rank: a Ulysses group must hold one cp rank's consecutive pieces, a ring
    the same Ulysses rank of every cp rank (the loader and the model agree)."""
    plan = _plan(2)
    members = [8, 9, 10, 11]  # global ranks of a block, in sequence-rank order
    ulysses, rings = plan.block_ring_ranks(members)
    u, cp = plan.block_split(len(members))
    assert sorted(map(len, ulysses)) == [u] * cp and sorted(map(len, rings)) == [cp] * u
    for group in ulysses:  # one cp rank each
        assert len({members.index(r) // u for r in group}) == 1, ulysses
    for ring in rings:  # one Ulysses rank each, in cp-rank order
        positions = [members.index(r) for r in ring]
        assert len({p % u for p in positions}) == 1 and positions == sorted(positions), rings
    layout = zigzag_layout([380], cp, u)  # the loader's cut of a block's long row
    assert layout.ring_index().shape == (cp, len(layout.order) // cp)


@pytest.mark.parametrize("plant", plants.for_launch("ring_block"))
def test_plant_is_caught(plant):
    """The layout check passes honestly and fails with the planted error."""
    test_block_groups_follow_the_zigzag_layout()
    with plants.applied(plant, 0), pytest.raises(AssertionError):
        test_block_groups_follow_the_zigzag_layout()


def _config(tmp_path, **llm):
    from ds_omni.config import ReorderConfig as Reorder
    cfg = tiny_config(str(tmp_path))
    cfg.model.llm.config = {**TINY_LLAMA, "num_attention_heads": 2, "num_key_value_heads": 1,
                            **llm}
    cfg.parallel = ParallelConfig(max_sequence_sp=4)
    cfg.data.reorder, cfg.data.max_seq_len = Reorder(mode="fixed", group_size=4), 64
    return cfg


def test_plan_run_plans_blocks_past_the_heads(tmp_path):
    from ds_omni.train.setup import plan_run
    plan, _ = plan_run(_config(tmp_path), ds_config(2), 4)
    assert plan.heads == 2 and plan.block_split(4) == (2, 2) and plan.block_split(2) == (2, 1)


@pytest.mark.parametrize("llm,match", [
    ({"attention_dropout": 0.1}, r"parallel.max_sequence_sp=4 \(blocks past the LLM's 2 heads "
     r"per TP rank run a ring of 2\): model.llm has attention_dropout 0.1, .*set it to 0 in the "
     r"LLM's config, or set parallel.max_sequence_sp to at most 2"),
    ({"num_local_experts": 4, "model_type": "mixtral"}, r"is an MoE LLM with 4 experts.*set "
     r"parallel.max_sequence_sp to at most 2"),
])
def test_a_block_past_the_heads_needs_a_ring_the_llm_can_run(tmp_path, llm, match):
    from ds_omni.train.setup import plan_run
    with pytest.raises(ModelError, match=match):
        plan_run(_config(tmp_path, **llm), ds_config(2), 4)


def test_beside_tp_a_block_must_still_fit_the_heads(tmp_path):
    from ds_omni.train.setup import plan_run
    cfg = _config(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    cfg.parallel = ParallelConfig(tp=2, max_sequence_sp=4)
    with pytest.raises(ModelError, match=r"parallel.tp=2 x parallel.max_sequence_sp=4"):
        plan_run(cfg, ds_config(2), 8)
