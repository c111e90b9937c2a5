"""The encoder pool's pure plan (`ds_omni.parallelize.encoder_pool`), ranks simulated in one process:
who encodes what, and that the embedding exchange delivers every row to its placeholder."""

import numpy as np
import pytest

from ds_omni.config import ParallelConfig
from ds_omni.errors import ConfigError
from ds_omni.parallelize.encoder_pool import EncoderPool, HomeRow, PoolItem, assign_pool, plan_round


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


def test_evenly_loaded_groups_keep_their_items():
    """dp 2 x sp 2, each SP group's row holds 4 equal images: every rank encodes 2 of its own
    group's, none crosses to the other group (placed one by one, the first group's images used to
    fill all 4 ranks and push the second group's into the first: 8 images swapped for nothing)."""
    items = [PoolItem(home, "vision", k, 4, 1.0, shards=(4, 0) if k % 2 else (2, 2))
             for home in (0, 2) for k in range(4)]
    owner = assign_pool(items, 4)
    assert all(o in it.group for o, it in zip(owner, items)), owner
    assert np.bincount(owner, minlength=4).tolist() == [2, 2, 2, 2]


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


def _exchange(plan, rows: dict[int, HomeRow]) -> None:
    """Simulate `ReshardEmbeddings` over the plans of all pool ranks: every rank must end up with
    exactly the rows of its shard's placeholders, whoever encoded them. A row is named (home,
    encoder, index, j): the j-th embedding of that item."""
    plans = [plan.reshard(r, rows[r]) for r in range(plan.ranks)]
    outputs = []
    for r, row in rows.items():
        # what the model yields: per encoder, whole items in `encodes` order, then its pieces
        out = []
        for enc in plan.encoder_order:
            out += [(plan.items[i].home, enc, plan.items[i].index, j) for i in plan.encodes(r)
                    if plan.items[i].encoder == enc for j in range(plan.items[i].rows)]
            out += [(row.start, enc, k, j) for k, b in row.split.get(enc, [])
                    for j in range(b[r - row.start], b[r - row.start + 1])]
        assert len(out) == sum(plans[r].encode_rows.values()) == plans[r].rows_out
        outputs.append([out[k] for k in plans[r].send_order])  # grouped by destination
    for r, row in rows.items():
        received = []
        for s in range(plan.ranks):
            start = sum(plans[s].send_counts[:r])
            assert plans[s].send_counts[r] == plans[r].recv_counts[s]
            received += outputs[s][start:start + plans[s].send_counts[r]]
        got = dict(zip(plans[r].recv_positions, received))
        assert len(got) == len(received)  # no position filled twice
        j0 = (r - row.start) * row.shard_len
        want = {int(p) - j0: (row.start, e, k, j) for (e, k), pos in row.positions.items()
                for j, p in enumerate(pos) if j0 <= p < j0 + row.shard_len}
        assert got == want


def test_exchange_puts_every_row_on_its_placeholder():
    per_rank = [[("vision", 3, 5.0), ("audio", 2, 1.0), ("vision", 2, 4.0)], [],
                [("audio", 4, 2.0)]]
    items = _items(per_rank)
    plan = plan_round(items, 3, ["vision", "audio"])
    assert plan.moved()
    # placeholder positions of each rank's items in its row (rank-specific, interleaved)
    rows = {r: HomeRow(r, 1, 1000, {}) for r in range(3)}
    for r in range(3):
        at = 10 * r
        for it in items:
            if it.home == r:
                rows[r].positions[(it.encoder, it.index)] = np.arange(at, at + it.rows)
                at += it.rows + 1
    _exchange(plan, rows)


def _sp_round(seed: int, dp: int, sp: int, shard_len: int = 24):
    """A random round at dp x sp: each row's items at random positions of its padded row (some
    straddle shards), some of them long (split over the row's group): (plan, HomeRow per rank)."""
    return _mixed_round(seed, [sp] * dp, shard_len)


def _mixed_round(seed: int, groups: list[int], shard_len: int = 24):
    """A random round whose rows sit on consecutive groups of the given sizes (per-sequence SP:
    a block of 2 or 4 ranks, or a rank alone); a group of 0 stands for a rank alone with an
    empty micro-batch (a round it sits out, or a filler): (plan, HomeRow per rank)."""
    rng = np.random.default_rng(seed)
    items, long, rows, start = [], [], {}, 0
    for d, size in enumerate(groups):
        if size == 0:
            rows[start] = HomeRow(start, 1, shard_len, {})
            start += 1
            continue
        sp, positions, split = size, {}, {}
        free = rng.permutation(sp * shard_len)
        at = 0
        for k in range(int(rng.integers(0, 4 if d else 7))):  # row 0 carries the most
            enc = ["vision", "audio"][int(rng.integers(0, 2))]
            index = sum(e == enc for e, _ in positions)
            n = int(rng.integers(sp, 6))
            positions[(enc, index)] = np.sort(free[at:at + n])
            at += n
            cost = float(rng.uniform(0.5, 3.0))
            if sp > 1 and rng.random() < 0.25:  # long: every group member encodes a piece
                bounds = tuple(np.linspace(0, n, sp + 1).astype(int).tolist())
                split.setdefault(enc, []).append((index, bounds))
                long.append(PoolItem(start, enc, index, n, cost, shards=(0,) * sp))
            else:
                shards = tuple(np.bincount(positions[(enc, index)] // shard_len,
                                           minlength=sp).tolist()) if sp > 1 else ()
                items.append(PoolItem(start, enc, index, n, cost, shards=shards))
        for enc in split:
            split[enc].sort()
        for r in range(start, start + sp):
            rows[r] = HomeRow(start, sp, shard_len, positions, split)
        start += sp
    return plan_round(items, start, ["vision", "audio"], long=long), rows


def test_sp_exchange_puts_every_row_on_its_shard():
    """dp x sp: short items anywhere in the pool, long items' pieces from their group; each
    rank receives exactly its shard's rows (items straddling shards land on both)."""
    moved = 0
    for seed in range(18):
        dp, sp = [(2, 2), (3, 2), (2, 4)][seed % 3]
        plan, rows = _sp_round(seed, dp, sp)
        _exchange(plan, rows)
        moved += len(plan.moved())
        assert plan.group_rows() == sum(len(p) for row in {r.start: r for r in rows.values()}
                                        .values() for p in row.positions.values())
    assert moved > 0


def test_mixed_block_sizes_exchange_puts_every_row_on_its_shard():
    """Per-sequence SP: one round's rows on a block of 2 or 4 ranks and on ranks alone, some
    ranks idle (an empty micro-batch or a filler): each rank receives exactly its shard's rows."""
    moved = 0
    layouts = [[2, 1, 1], [1, 0, 2], [4, 1, 0, 2], [2, 0, 0], [0, 4, 1, 1, 2]]
    for seed in range(10):
        plan, rows = _mixed_round(seed, layouts[seed % len(layouts)])
        _exchange(plan, rows)
        moved += sum(len(plan.items[i].group) > 1 for i in plan.moved())
    assert moved > 0  # some block row's items were encoded outside the block


def test_idle_ranks_take_a_block_rows_items():
    # a long sequence on the block (0, 2) holds 4 equal images; ranks 2 and 3 sit the round out
    items = [PoolItem(0, "vision", k, 4, 1.0, shards=(4, 0) if k < 2 else (0, 4))
             for k in range(4)]
    plan = plan_round(items, 4, ["vision"])
    assert plan.loads() == [1.0, 1.0, 1.0, 1.0]
    # each block member keeps one image whose placeholders it holds (its rows stay put); the
    # other two go to the idle ranks
    assert plan.owner == [0, 2, 1, 3]
    assert [plan.moved_to(r) for r in range(4)] == [0, 0, 1, 1]
    rows = {r: HomeRow(0, 2, 8, {("vision", k): np.arange(4 * k, 4 * k + 4) for k in range(4)})
            for r in (0, 1)} | {r: HomeRow(r, 1, 1, {}) for r in (2, 3)}
    _exchange(plan, rows)


def test_home_row_takes_the_block_of_the_micro_batch():
    """The pool's view of a micro-batch: a per-sequence block's shard (sp_block), a sequence
    alone, and (static SP) the pool's own group size."""
    from types import SimpleNamespace

    import torch

    from ds_omni.batch import Route
    positions = {("vision", 0): np.arange(3, 7)}
    shard = SimpleNamespace(rank=1, split={})
    block = SimpleNamespace(route=Route(reshard=shard, sp_block=(4, 2), row_positions=positions),
                            input_ids=torch.zeros(1, 16))
    pool = EncoderPool(None, 5, 8, {}, {"vision": (5,)}, None, "cpu")
    row = pool.home_row(block)
    assert (row.start, row.size, row.shard_len) == (4, 2, 16) and row.positions is positions
    alone = SimpleNamespace(route=Route(), host=None, items={},
                            input_ids=torch.zeros(1, 9, dtype=torch.long))
    assert (pool.home_row(alone).start, pool.home_row(alone).size) == (5, 1)
    static = EncoderPool(None, 5, 8, {}, {"vision": (5,)}, None, "cpu", sp=4)
    shard4 = SimpleNamespace(route=Route(reshard=SimpleNamespace(rank=1, split={}),
                                         row_positions=positions), input_ids=torch.zeros(1, 16))
    assert (static.home_row(shard4).start, static.home_row(shard4).size) == (4, 4)


def test_sp_skewed_round_spreads_over_every_rank_of_every_group():
    # dp2 x sp2: row 0 (ranks 0-1) holds 8 equal items, row 1 (ranks 2-3) none
    items = [PoolItem(0, "vision", k, 4, 1.0, shards=(4, 0) if k < 4 else (0, 4))
             for k in range(8)]
    plan = plan_round(items, 4, ["vision"])
    assert plan.loads() == [2.0, 2.0, 2.0, 2.0]
    # the row's own group keeps what it can, first on the shard holding the placeholders
    assert sum(plan.owner[i] in (0, 1) for i in range(8)) == 4
    assert plan.owner[0] == 0 and plan.owner[4] == 1
    assert [plan.moved_to(r) for r in range(4)] == [0, 0, 2, 2]  # data_pool_moved
    # rank 2 gets its inputs from rank 0, rank 3 from rank 1: the group shares the sends
    assert {plan.sender(i) for i in plan.moved() if plan.owner[i] == 2} == {0}
    assert {plan.sender(i) for i in plan.moved() if plan.owner[i] == 3} == {1}


def test_long_items_weigh_on_their_group():
    # row 0's group splits a long item of cost 4 (2 per member): short items go to row 1's group
    long = [PoolItem(0, "vision", 0, 6, 4.0, shards=(0, 0))]
    items = [PoolItem(0, "vision", k, 2, 1.0, shards=(2, 0)) for k in (1, 2)]
    plan = plan_round(items, 4, ["vision"], long=long)
    assert sorted(plan.owner) == [2, 3] and plan.loads() == [2.0, 2.0, 1.0, 1.0]


def test_sp_planner_is_deterministic_and_bounded():
    for seed in range(30):
        plan, _ = _sp_round(seed, 2, 2)
        again, _ = _sp_round(seed, 2, 2)
        assert plan.owner == again.owner
        if plan.items and not plan.long:
            loads = plan.loads()
            mean = sum(loads) / len(loads)
            assert max(loads) <= mean + max(it.cost for it in plan.items) + 0.05 * mean + 1e-9


def test_config_takes_the_pool_beside_model_parallelism():
    assert ParallelConfig(encoder_pool="dp").encoder_pool == "dp"
    assert ParallelConfig(encoder_pool="dp", sp=2).sp == 2  # static SP: pooled over dp x sp
    # per-sequence SP: pooled over the round's groups of mixed sizes
    assert ParallelConfig(encoder_pool="dp", max_sequence_sp=4).max_sequence_sp == 4
    # under pp each encoding stage pools its ranks, whatever the encoders' placement
    for placement in ("stage0", "uniform", "bubbles"):
        assert ParallelConfig(encoder_pool="dp", pp=2, encoder_placement=placement).pp == 2
    with pytest.raises(ConfigError, match="encoder_pool must be"):
        ParallelConfig(encoder_pool="world")



def test_metric_is_the_items_encoded_for_others(monkeypatch):
    """`plan_step` (its all-gather simulated) counts what this rank encodes for others: the
    `data_pool_moved` of metrics.jsonl."""
    from types import SimpleNamespace

    from ds_omni.parallelize import encoder_pool
    from ds_omni.train.loop import pool_metrics
    rank0 = [([PoolItem(0, "vision", k, 4, 1.0) for k in range(n)], []) for n in (8, 1)]

    def all_gather_object(out, mine, group):
        out[:] = [rank0, mine, [([], [])] * 2, [([], [])] * 2]
    monkeypatch.setattr(encoder_pool.dist, "all_gather_object", all_gather_object)
    pool = EncoderPool(None, 1, 4, {}, {"vision": (5,)}, None, "cpu")
    # round 1: 2 of rank 0's 8 items come to rank 1; round 2: rank 0 keeps its one item
    pool.plan_step([SimpleNamespace(items={}), SimpleNamespace(items={})])
    model = SimpleNamespace(router=SimpleNamespace(encoder_pool=pool))  # `parallelize` attached
    assert pool_metrics(model) == {"data_pool_moved": 2, "data_pool_moved_group": 6}
    assert pool_metrics(SimpleNamespace(router=SimpleNamespace(encoder_pool=None))) == {}
    assert pool_metrics(SimpleNamespace()) == {}  # a pipeline stage: no router
