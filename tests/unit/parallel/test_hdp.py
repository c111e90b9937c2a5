"""Per-sequence SP degree: the pure placement math (`ds_omni.parallel.hdp`) and its use by the
reordering planners (`ds_omni.data.reorder`)."""

import numpy as np
import pytest

from ds_omni.data.reorder import BudgetPlanner, assign_fixed
from ds_omni.errors import DataError
from ds_omni.parallel.hdp import Block, assign_rounds, check_degree, degree_for, place_blocks, \
    rank_rounds


def test_degree_is_the_smallest_power_of_two_under_both_limits():
    assert degree_for(0.5, 10, rank_budget=1.0, token_cap=100, max_degree=8) == 1
    assert degree_for(1.5, 10, 1.0, 100, 8) == 2
    assert degree_for(2.0, 10, 1.0, 100, 8) == 2  # exactly two ranks' worth
    assert degree_for(2.01, 10, 1.0, 100, 8) == 4
    assert degree_for(0.1, 350, 1.0, 100, 8) == 4  # tokens decide
    assert degree_for(50.0, 10, 1.0, 100, 8) == 8  # capped: the block's ranks are overfull
    with pytest.raises(DataError, match="max_sequence_sp"):
        degree_for(0.1, 801, 1.0, 100, 8)


def test_degree_limit_must_be_a_power_of_two_dividing_the_pool():
    check_degree(4, 8)
    with pytest.raises(ValueError, match="power of two"):
        check_degree(3, 6)
    with pytest.raises(ValueError, match="group_size"):
        check_degree(8, 4)  # a group larger than the pool (e.g. the world)


def test_blocks_are_aligned_least_loaded_and_split_the_cost():
    loads = np.array([0.0, 0.0, 0.5, 0.0])
    blocks = assign_rounds(place_blocks(np.array([3.0, 1.6]), np.array([10, 10]), loads,
                                        rank_budget=1.0, token_cap=100, max_degree=4))
    # the costlier first: 3.0 needs 4 ranks (all of them), 1.6 then 2, on the less loaded pair
    assert blocks[0] == Block(0, 4, 0)
    assert blocks[1].size == 2 and blocks[1].start == 0 and blocks[1].round == 1
    np.testing.assert_allclose(loads, [0.75 + 0.8, 0.75 + 0.8, 1.25, 0.75])


def test_a_sequence_that_does_not_fit_waits_unless_forced():
    loads = np.array([0.9, 0.9])
    kept = place_blocks(np.array([1.5]), np.array([1]), loads.copy(), 1.0, 100, 2, limit=1.0)
    assert kept == {}
    forced = place_blocks(np.array([1.5]), np.array([1]), loads.copy(), 1.0, 100, 2,
                          forced=np.array([True]), limit=1.0)
    assert forced == {0: (0, 2)}


def test_rounds_never_put_one_rank_in_two_blocks_at_once():
    placed = {0: (0, 2), 1: (2, 2), 2: (0, 4), 3: (2, 2), 4: (0, 2)}
    blocks = assign_rounds(placed)
    by_round = {}
    for b in blocks.values():
        taken = by_round.setdefault(b.round, set())
        assert not taken & set(b.ranks)
        taken |= set(b.ranks)
    assert [b.round for b in blocks.values()] == [0, 0, 1, 2, 2]
    assert rank_rounds(blocks, 3) == [1, 2, 3]
    assert rank_rounds(blocks, 0) == [0, 2, 4]


def _skewed(rng, n):
    """Many short sequences and a few very long ones (cost ~ tokens^1.5)."""
    tokens = np.where(rng.random(n) < 0.01, rng.integers(10000, 30000, n), rng.integers(50, 400, n))
    return tokens ** 1.5, tokens


def test_fixed_mode_places_every_sample_once_and_evens_the_ranks():
    rng = np.random.default_rng(0)
    cost, tokens = _skewed(rng, 256)
    plain = assign_fixed(cost, tokens, 8, 4)  # (no token cap: the long ones would not fit)
    hdp = assign_fixed(cost, tokens, 8, 4, 8192, max_degree=8)
    ratio = lambda a: a.rank_sums(cost).max() / a.rank_sums(cost).mean()  # noqa: E731
    assert ratio(plain) > 1.3  # the long ones alone set the step time
    assert ratio(hdp) < 1.05
    assert hdp.blocks  # and they got blocks
    seen = [int(i) for r in range(8) for mb in hdp.members(r) for i in mb] + list(hdp.blocks)
    assert sorted(seen) == list(range(256))


def test_budget_mode_blocks_outliers_and_overlong_sequences_without_loss():
    rng = np.random.default_rng(1)
    planner = BudgetPlanner(8, 4, max_wait=2, lookahead=2.0)
    cost, tokens = _skewed(rng, 5000)
    budget = float(cost.mean() * 32)
    added, planned, ratios = 0, [], []
    for step in range(12):
        while planner.wants_more(budget) and added < cost.size:
            planner.add(list(range(added, added + 64)), cost[added:added + 64],
                        tokens[added:added + 64])
            added += 64
        # a micro-batch holds 8192 tokens: the longest sequences need 2-4 ranks for tokens alone
        plan = planner.plan(budget, 8192, max_degree=8)
        planned += plan.keys
        if step >= 2:
            loads = plan.assignment.rank_sums(plan.cost)
            ratios.append(loads.max() / loads.mean())
    assert len(set(planned)) == len(planned)  # nothing twice
    assert sorted(planned + list(planner.state_dict()["buffer"]["keys"])) == list(range(added))
    assert planner.delay_stats()["outliers"] > 0
    assert np.median(ratios) < 1.05


def test_budget_mode_without_blocks_still_refuses_overlong_sequences():
    planner = BudgetPlanner(2, 1)
    planner.add([0], np.array([1.0]), np.array([500]))
    with pytest.raises(DataError, match="token budget"):
        planner.plan(10.0, 400)
    assert planner.plan(10.0, 400, max_degree=2).assignment.blocks[0] == Block(0, 2, 0)


def test_bad_plans_are_clear_errors_before_any_process_group():
    from ds_omni.config import OmniConfig, from_dict
    from ds_omni.parallel.plan import check_per_sequence
    from ds_omni.errors import ConfigError
    from tests.fixtures import tiny_config_dict

    def config(parallel: dict, data: dict | None = None):
        d = tiny_config_dict("/tmp/unused")
        d["parallel"] = parallel
        d["data"].update(data or {})
        return from_dict(OmniConfig, d)

    with pytest.raises(ConfigError, match="power of two"):
        config({"max_sequence_sp": 3})
    with pytest.raises(ConfigError, match="max_sequence_sp=2 cannot be combined with parallel.sp=2"):
        config({"sp": 2, "max_sequence_sp": 2})
    with pytest.raises(ConfigError, match="max_sequence_sp"):  # the hint names the remedy
        config({}, {"max_seq_len": 512, "pack_tokens": 256})
    config({"max_sequence_sp": 2}, {"max_seq_len": 512, "pack_tokens": 256})  # fits on 2 ranks
    with pytest.raises(DataError, match="reorder.mode"):
        check_per_sequence("loader_order", 1, 2)
    with pytest.raises(DataError, match="group_size"):  # a group larger than the world
        check_per_sequence("fixed", 2, 4)
