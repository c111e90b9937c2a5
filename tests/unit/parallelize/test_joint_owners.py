"""Owner stages of the encoder parameters under "uniform" placement (pure: no process group).

Each trainable encoder parameter is stepped by one stage's optimizer (`owner_stages`); the
collectives around it (`EncoderShards`) run in the pipeline cases of `tests/dist/test_parity.py`.
"""

import numpy as np
import pytest

from ds_omni.parallelize.joint import owner_stages


@pytest.mark.parametrize("seed", range(4))
def test_every_parameter_has_one_owner_and_the_stages_hold_nearly_equal_shares(seed):
    rng = np.random.default_rng(seed)
    numels = [int(n) for n in rng.choice([16, 64, 1024, 4096, 65536], size=40)]
    for stages in (2, 3, 4):
        owners = owner_stages(numels, stages)
        assert len(owners) == len(numels) and set(owners) == set(range(stages))
        load = [sum(n for n, o in zip(numels, owners) if o == s) for s in range(stages)]
        # largest first onto the least loaded stage: the stage that ends heaviest was the
        # lightest when it took its last parameter, so the spread is at most the largest one
        assert max(load) - min(load) <= max(numels)
        assert owner_stages(list(numels), stages) == owners  # every rank computes the same


def test_owners_follow_size_then_parameter_order():
    # 100 alone on stage 0, then 60 and 50 both onto stage 1 (60 first: larger), 40 onto 0
    assert owner_stages([50, 100, 40, 60], 2) == [1, 0, 0, 1]
    assert owner_stages([8, 8, 8, 8], 2) == [0, 1, 0, 1]  # ties: parameter order, lower stage
    assert owner_stages([5], 3) == [0]  # more stages than parameters: some own nothing
    assert owner_stages([], 2) == []


def test_a_vision_tower_splits_evenly_over_four_stages():
    """The benchmark's CLIP tower (6 layers of width 256, MLP 1024): weights, biases and norms of
    very different sizes; no stage steps more than 5 % over its share."""
    width, mlp = 256, 1024
    layer = [width * width, width] * 4 + [mlp * width, mlp, width * mlp, width] + [width] * 4
    numels = [64 * 3 * width, 65 * width] + layer * 6 + [width, width]  # patch, positions, norm
    for stages in (2, 4):
        owners = owner_stages(numels, stages)
        load = [sum(n for n, o in zip(numels, owners) if o == s) for s in range(stages)]
        assert max(load) / (sum(numels) / stages) < 1.05, load
