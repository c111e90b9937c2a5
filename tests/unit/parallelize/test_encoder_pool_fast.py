"""`assign_pool`'s second pass (items that move) picks with arrays what the rule says with a
key: among the ranks within the tolerance of the least loaded, the home group's members first
(most of the item's placeholders, then the least loaded, then the lowest rank), else the least
loaded, lowest rank. Checked against that key, written out here, on random rounds with ties."""

import numpy as np

from ds_omni.parallelize.encoder_pool import PoolItem, assign_pool


def by_key(items, ranks: int, slack: float, base) -> list[int]:
    """The rule as the key it was first written as (both passes)."""
    load = np.zeros(ranks) if base is None else np.array(base, dtype=np.float64)
    owner, moving = [0] * len(items), []
    mean = (sum(it.cost for it in items) + load.sum()) / ranks
    tolerance = slack * mean
    for i in sorted(range(len(items)), key=lambda i: (-items[i].cost, i)):
        it = items[i]
        stay = [r for r in it.group if it.held(r) and
                load[r] + it.cost <= (mean + tolerance) * (1 + 1e-9)]
        if not stay:
            moving.append(i)
            continue
        owner[i] = int(min(stay, key=lambda r: (-it.held(r), load[r], r)))
        load[owner[i]] += it.cost
    for i in moving:
        it = items[i]
        ok = np.flatnonzero(load <= load.min() + tolerance * (1 + 1e-9))
        owner[i] = int(min(ok, key=lambda r: (r not in it.group, -it.held(r), load[r], r)))
        load[owner[i]] += it.cost
    return owner


def test_the_array_pick_is_the_key_pick():
    rng = np.random.default_rng(0)
    moved = 0
    for trial in range(60):
        ranks = int(rng.choice([2, 4, 8, 16]))
        g = int(rng.choice([1, 2, 4])) if ranks >= 4 else 1
        items = []
        for _ in range(int(rng.integers(0, 40))):
            rows = int(rng.integers(1, 40))
            shards = tuple(np.bincount(rng.integers(0, g, rows), minlength=g).tolist()) \
                if g > 1 else ()
            cost = float(rng.choice([1.0, 2.0, rng.uniform(0, 10)]))  # ties on purpose
            items.append(PoolItem(int(rng.integers(0, ranks // g)) * g, "vision", len(items),
                                  rows, cost, shards=shards))
        base = rng.uniform(0, 5, ranks) if trial % 2 else None
        got = assign_pool(items, ranks, 0.05, base)
        assert got == by_key(items, ranks, 0.05, base), trial
        moved += sum(o not in it.group for o, it in zip(got, items))
    assert moved > 100  # the second pass ran, and often (210 items moved)
