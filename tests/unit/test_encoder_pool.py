"""The encoder pool's pure plan (`ds_omni.parallel.encoder_pool`), ranks simulated in one process:
who encodes what, and that the embedding exchange delivers every row to its placeholder."""

import numpy as np
import pytest

from ds_omni.config import ParallelConfig
from ds_omni.errors import ConfigError
from ds_omni.parallel.encoder_pool import EncoderPool, PoolItem, assign_pool, plan_round


def _items(per_rank: list[list[tuple[str, int, float]]]) -> list[PoolItem]:
    """(encoder, rows, cost) of each rank's items -> PoolItems, indexed per (rank, encoder)."""
    out = []
    for home, items in enumerate(per_rank):
        seen: dict[str, int] = {}
        for enc, rows, cost in items:
            out.append(PoolItem(home, enc, seen.get(enc, 0), rows, cost))
            seen[enc] = seen.get(enc, 0) + 1
    return out


def test_skewed_round_spreads_over_all_ranks():
    # rank 0 holds every image of the round: 8 equal items over 4 ranks -> 2 each
    items = _items([[("vision", 4, 1.0)] * 8, [], [], []])
    plan = plan_round(items, 4, ["vision"])
    assert plan.loads() == [2.0, 2.0, 2.0, 2.0]
    assert len(plan.moved()) == 6  # two stay home, the rest travel
    assert [plan.moved_to(r) for r in range(4)] == [0, 2, 2, 2]  # metrics: data_pool_moved


def test_balanced_round_keeps_items_home():
    items = _items([[("vision", 4, 1.0)], [("vision", 4, 1.0)], [("audio", 3, 1.02)]])
    assert assign_pool(items, 3) == [0, 1, 2]
    # nothing moves: the micro-batch runs as without the pool, with no collective
    pool = EncoderPool(None, 0, 3, {}, {"vision": (5,), "audio": (6,)}, None, "cpu")
    batch = object()
    assert pool.place(batch, plan_round(items, 3, ["vision", "audio"])) is batch


def test_busiest_rank_bound_and_determinism():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ranks = int(rng.integers(2, 9))
        per_rank = [[("vision", 1, float(c)) for c in rng.pareto(1.5, int(rng.integers(0, 6))) + 0.1]
                    for _ in range(ranks)]
        items = _items(per_rank)
        if not items:
            continue
        owner = assign_pool(items, ranks)
        assert owner == assign_pool(items, ranks)
        loads = np.bincount(owner, weights=[it.cost for it in items], minlength=ranks)
        mean = loads.sum() / ranks
        assert loads.max() <= mean + max(it.cost for it in items) + 0.05 * mean + 1e-9


def test_exchange_puts_every_row_on_its_placeholder():
    """Simulate `ReshardEmbeddings` over the plans of all ranks: every rank's row ends up with the
    rows of its own items at their placeholder positions, whoever encoded them."""
    per_rank = [[("vision", 3, 5.0), ("audio", 2, 1.0), ("vision", 2, 4.0)], [],
                [("audio", 4, 2.0)]]
    items = _items(per_rank)
    plan = plan_round(items, 3, ["vision", "audio"])
    assert plan.moved()
    # placeholder positions of each rank's items in its row (rank-specific, interleaved)
    positions = {}
    for r in range(3):
        at = 10 * r
        for it in items:
            if it.home == r:
                positions[(r, it.encoder, it.index)] = np.arange(at, at + it.rows)
                at += it.rows + 1
    plans = [plan.reshard(r, {(e, k): p for (h, e, k), p in positions.items() if h == r})
             for r in range(3)]
    # encoders yield rows in their collate order: per encoder, items in plan.encodes order
    outputs = []
    for r in range(3):
        rows = [(plan.items[i].home, plan.items[i].encoder, plan.items[i].index, j)
                for i in plan.encodes(r) for j in range(plan.items[i].rows)]
        assert len(rows) == sum(plans[r].encode_rows.values())
        outputs.append([rows[k] for k in plans[r].send_order])  # grouped by destination
    for r in range(3):
        received = []
        for s in range(3):
            start = sum(plans[s].send_counts[:r])
            assert plans[s].send_counts[r] == plans[r].recv_counts[s]
            received += outputs[s][start:start + plans[s].send_counts[r]]
        got = dict(zip(plans[r].recv_positions, received))
        want = {int(p): (r, e, k, j) for (h, e, k), pos in positions.items() if h == r
                for j, p in enumerate(pos)}
        assert got == want


def test_config_refuses_pool_with_model_parallelism():
    assert ParallelConfig(encoder_pool="dp").encoder_pool == "dp"
    for bad in ({"sp": 2}, {"pp": 2}, {"max_sequence_sp": 2}):
        with pytest.raises(ConfigError, match="encoder_pool.*set encoder_pool to"):
            ParallelConfig(encoder_pool="dp", **bad)
    with pytest.raises(ConfigError, match="encoder_pool must be"):
        ParallelConfig(encoder_pool="world")



def test_metric_is_the_items_encoded_for_others(monkeypatch):
    """`plan_step` (its all-gather simulated) counts what this rank encodes for others: the
    `data_pool_moved` of metrics.jsonl."""
    from types import SimpleNamespace

    from ds_omni.parallel import encoder_pool
    from ds_omni.train.engine import pool_metrics
    rank0 = [[PoolItem(0, "vision", k, 4, 1.0) for k in range(n)] for n in (8, 1)]

    def all_gather_object(out, mine, group):
        out[:] = [rank0, mine, [[], []], [[], []]]
    monkeypatch.setattr(encoder_pool.dist, "all_gather_object", all_gather_object)
    pool = EncoderPool(None, 1, 4, {}, {"vision": (5,)}, None, "cpu")
    # round 1: 2 of rank 0's 8 items come to rank 1; round 2: rank 0 keeps its one item
    pool.plan_step([SimpleNamespace(items={}), SimpleNamespace(items={})])
    assert pool_metrics(SimpleNamespace(encoder_pool=pool)) == {"data_pool_moved": 2,
                                                                "data_pool_moved_group": 6}
    assert pool_metrics(SimpleNamespace(encoder_pool=None)) == {}
