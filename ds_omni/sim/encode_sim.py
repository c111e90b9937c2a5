"""A round's encoder work on simulated ranks, placed by the planners training runs:
- "reshard": a row's items over its group by `parallel.reshard.plan_reshard` (long items split by
  long-short SP), then one uneven all-to-all to the placeholders' shards;
- "split_all" (VeOmni): every item split over the row's group;
- "replicated" (HF Ulysses as shipped): every rank of a row's group encodes all its items;
- "pool": short items over all ranks by `encoder_pool.plan_round`, long ones over their group.
Under parallel.tp: tp alone with "reshard" encodes apart (`plan_tp_encode`, then one all-gather
over TP, `tp_gathers`); otherwise every TP rank runs its SP group's or pool's plan, run once with
tp folded away (`_per_tp_rank`) and copied to each TP rank. A row packs its samples in order
(each sample's item rows, then its text); a group of g ranks cuts it into g shards of
ceil(T / g) tokens. More: docs/simulator.md.

Dims: W ranks, K items of a row, T tokens of a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ds_omni.parallel import reshard
from ds_omni.parallel.long_short import LongItems, split_rows
from ds_omni.parallel.reshard import ItemSlots
from ds_omni.parallel.tp_encode import assign_tp_items, first_rank
from ds_omni.parallelize import encoder_pool
from ds_omni.parallelize.encoder_pool import PoolItem
from ds_omni.sim import comm
from ds_omni.sim.workload import Samples

ENCODER_MODES = ("reshard", "split_all", "replicated", "pool")
INPUT_BYTES = {"vision": 3 * 14 * 14 * 2, "audio": 2 * 128 * 4}
"""Input bytes per encoder position moved by the pool: a 14 x 14 RGB patch in bf16, two fp32
mel frames of 128 bins (the encoder's conv stride 2)."""


@dataclass(frozen=True)
class Row:
    ranks: np.ndarray  # [g] global ranks of the row's group, in shard order
    samples: np.ndarray  # global sample indices, packed in this order


@dataclass
class RoundWork:
    """One round's encoder work over W ranks."""

    flops: np.ndarray  # [W] encoder training FLOPs each rank runs
    positions: np.ndarray  # [W] encoder positions each rank runs (activations)
    split_positions: list = field(default_factory=list)  # (ranks [g], positions per rank, encoder)
    sends: list = field(default_factory=list)  # (src, dst, bytes) embedding rows, forward
    inputs: list = field(default_factory=list)  # (src, dst, bytes) pool: moved items' inputs
    groups: list = field(default_factory=list)  # rank arrays that meet at the resharding
    present: dict = field(default_factory=dict)  # encoder -> [W] bool: the rank runs an item
    tp_gathers: list = field(default_factory=list)  # (src, dst, bytes) rows over TP, forward
    tp_groups: list = field(default_factory=list)  # TP groups (rank arrays) that gather rows
    pooled: tuple = ()  # "pool": (its short items' ids, their owners), as `pool_round` gives them
    memo: dict = field(default_factory=dict)
    """What the step derives from this placement alone (its collectives' seconds on the
    cluster, the bytes they add), kept for the plans of a search that share it (`step.py`)."""

    def ran(self, encoder: str, ranks) -> None:
        if encoder not in self.present:  # not setdefault: it would make a [W] array each call
            self.present[encoder] = np.zeros(self.flops.size, dtype=bool)
        self.present[encoder][ranks] = True


class RowLayout:
    """The step's samples with their items, and each item's cost (the cost model's)."""

    def __init__(self, samples: Samples, item_cost: np.ndarray, hidden: int):
        self.s, self.cost, self.hidden = samples, item_cost, hidden
        order = np.argsort(samples.item_sample, kind="stable")
        bounds = np.searchsorted(samples.item_sample[order], np.arange(len(samples) + 1))
        self.items_of = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]  # [N] item ids
        # each sample's items as plain Python (encoder, rows, cost, id) and its tokens: `slots`
        # runs ~10^6 times in a 4,096-GPU search, and numpy scalars cost most of it
        enc, rows = samples.item_encoder.tolist(), samples.item_rows.tolist()
        cost = item_cost.tolist()
        self._items = [[(str(enc[i]), int(rows[i]), cost[i], i) for i in ids.tolist()]
                       for ids in self.items_of]
        self._tokens = samples.tokens.tolist()

    def slots(self, row: Row) -> tuple[list[ItemSlots], list[int], int]:
        """(the row's items as ItemSlots in text order, their item ids, the row's tokens)."""
        slots, ids, offset, count = [], [], 0, {}
        for n in row.samples.tolist():
            at = offset
            for enc, rows, cost, i in self._items[n]:
                index = count.get(enc, 0)
                slots.append(ItemSlots(enc, index, np.arange(at, at + rows), cost))
                count[enc] = index + 1
                ids.append(i)
                at += rows
            offset += int(self._tokens[n])
        return slots, ids, offset


def step_costs(model, samples: Samples, cache: dict | None) -> tuple:
    """(sample costs [N], item costs [M], LLM costs [N], RowLayout) of `model` (a `ModelSpec`)
    on `samples`, kept in `cache` (with the model and samples: their ids stay theirs) for the
    plans of a search, which share them (`step.simulate`'s cache)."""
    key, cm = ("costs", id(model), id(samples)), model.cost
    if cache is not None and key in cache:
        return cache[key][2]
    item_cost = np.zeros(samples.item_len.size)  # [M]
    for name in cm.encoder_names:
        mask = samples.item_encoder == name
        item_cost[mask] = cm.encoder_cost(name, samples.item_len[mask])
    out = (cm.sample_costs(samples.tokens, samples.item_sample, samples.item_encoder,
                           samples.item_len), item_cost, cm.llm_cost(samples.tokens),
           RowLayout(samples, item_cost, model.dims.hidden))
    if cache is not None:
        cache[key] = (model, samples, out)
    return out


def round_work(rows: list[Row], layout: RowLayout, world: int, mode: str, long_items: bool,
               heads: dict[str, int], encoder_order: list[str], tp: int = 1) -> RoundWork:
    """The encoder work of one round whose rows are `rows` (every rank in at most one); `tp`:
    the TP degree (a row's ranks are its sp x tp ranks, tp innermost)."""
    if tp > 1:
        if mode == "reshard" and all(len(r.ranks) == tp for r in rows):  # sp = 1
            return _tp_apart(rows, layout, world, tp, encoder_order)
        return _per_tp_rank(rows, layout, world, mode, long_items, heads, encoder_order, tp)
    work = RoundWork(np.zeros(world), np.zeros(world))
    if mode == "pool":
        _pool(rows, layout, world, long_items, heads, encoder_order, work)
        return work
    for row in rows:
        slots, ids, tokens = layout.slots(row)
        g = len(row.ranks)
        if g == 1 or mode == "replicated":
            work.flops[row.ranks] += sum(s.cost for s in slots)
            work.positions[row.ranks] += sum(int(layout.s.item_len[i]) for i in ids)
            for sl in slots:
                work.ran(sl.encoder, row.ranks)
            continue
        threshold = 0.0 if mode == "split_all" else None
        long = LongItems(threshold, heads) if (long_items or mode == "split_all") else None
        shard = math.ceil(tokens / g)
        _charge(reshard.place_items(slots, g, shard, encoder_order, long), shard, slots, ids,
                row, layout, work)
        work.groups.append(row.ranks)
    return work


def _charge(placed, shard: int, slots, ids, row: Row, layout: RowLayout,
            work: RoundWork) -> None:
    """Per rank of a row's group: the items it encodes whole, its pieces of the split ones, and
    the embedding rows it sends to each member: `plan_reshard`'s `send_counts`, from its
    decisions (`place_items`) without building the receive side (most of its time). The
    additions run in `plan_reshard`'s order (rank by rank, then the split items), so the sums
    are the same to the last bit."""
    owner, pieces, in_order = placed
    g = len(row.ranks)
    counts: dict[tuple[int, int], int] = {}  # (i, j): rows member i sends member j
    for k in in_order:
        sl = slots[k]
        lo = int(sl.positions[0]) if len(sl.positions) else 0  # contiguous (`RowLayout.slots`)
        if k in pieces:
            b = pieces[k]
            for r in range(g):
                _add_rows(counts, r, lo + b[r], b[r + 1] - b[r], shard)
            continue
        r = row.ranks[owner[k]]
        work.flops[r] += sl.cost
        work.positions[r] += layout.s.item_len[ids[k]]
        work.ran(sl.encoder, r)
        _add_rows(counts, owner[k], lo, len(sl.positions), shard)
    for i, j in sorted(counts):  # member by member, as the [g, g] matrix's nonzero cells
        if i != j and counts[i, j]:
            work.sends.append((row.ranks[i], row.ranks[j], counts[i, j] * layout.hidden * 2))
    for k in (k for k in in_order if k in pieces):
        work.flops[row.ranks] += slots[k].cost / g
        length = int(layout.s.item_len[ids[k]])
        work.positions[row.ranks] += length / g
        work.split_positions.append((row.ranks, length / g, slots[k].encoder))
        work.ran(slots[k].encoder, row.ranks)


def _add_rows(counts: dict, src: int, lo: int, n: int, shard: int) -> None:
    """Add member `src`'s rows at the contiguous positions [lo, lo + n) to `counts` by the
    shard (member) holding them."""
    for j, c in _shard_spans(lo, n, shard):
        counts[src, j] = counts.get((src, j), 0) + c


def _shard_spans(lo: int, n: int, shard: int):
    """(shard, how many) of the contiguous positions [lo, lo + n) in each shard of `shard`
    positions they touch, in order (`positions // shard` counted, without the arrays)."""
    for j in range(lo // shard, (lo + n - 1) // shard + 1):
        c = min(lo + n, (j + 1) * shard) - max(lo, j * shard)
        if c > 0:
            yield j, c


def pool_round(rows, layout, world, long_items, heads, order) -> tuple:
    """(the pool's plan of the round over `world` ranks (`plan_round`), its short items' ids,
    the long items as (row, slot, shard, id)): every row's short items over all ranks, long ones
    over their row's own group."""
    items, long, owners_of_long, item_ids = [], [], [], []
    for row in rows:
        slots, ids, tokens = layout.slots(row)
        g = len(row.ranks)
        shard = math.ceil(tokens / g) if tokens else 1
        total = sum(s.cost for s in slots)
        rule, home = LongItems(None, heads), int(row.ranks[0])
        for s, i in zip(slots, ids):
            n = len(s.positions)
            counts = _shard_counts(int(s.positions[0]) if n else 0, n, shard, g) if g > 1 else ()
            it = PoolItem(home, s.encoder, s.index, n, s.cost, shards=counts)
            if long_items and rule.is_long(s.encoder, s.cost, n, g, total):
                long.append(it)
                owners_of_long.append((row, s, shard, i))
            else:
                items.append(it)
                item_ids.append(i)
    return encoder_pool.plan_round(items, world, order, long=long), item_ids, owners_of_long


def _pool(rows, layout, world, long_items, heads, order, work: RoundWork) -> None:
    """The pool's round (`pool_round`); the rows a rank makes go to the ranks holding their
    placeholders, a moved item's inputs from its home group."""
    plan, item_ids, owners_of_long = pool_round(rows, layout, world, long_items, heads, order)
    work.pooled = (item_ids, plan.owner)
    work.flops += np.asarray(plan.loads())
    _pool_short(plan.items, plan.owner, item_ids, layout, work)
    for row, s, shard, i in owners_of_long:
        g = len(row.ranks)
        bounds = split_rows(len(s.positions), g)
        length = int(layout.s.item_len[i])
        work.positions[row.ranks] += length / g
        work.split_positions.append((row.ranks, length / g, s.encoder))
        work.ran(s.encoder, row.ranks)
        for j in range(g):
            dest = np.bincount(s.positions[bounds[j]:bounds[j + 1]] // shard, minlength=g)
            for k in np.flatnonzero(dest):
                work.sends.append((int(row.ranks[j]), int(row.ranks[k]),
                                   int(dest[k]) * layout.hidden * 2))
    work.groups.append(np.arange(world))


def _shard_counts(lo: int, n: int, shard: int, g: int) -> tuple[int, ...]:
    """[g] `_shard_spans` of the positions [lo, lo + n): `np.bincount(positions // shard,
    minlength=g)[:g]` without the arrays (a 4,096-GPU search asks it of ~10^6 items)."""
    counts = [0] * g
    for j, c in _shard_spans(lo, n, shard):
        if j < g:
            counts[j] = c
    return tuple(counts)


def _pool_short(items, owners, item_ids, layout, work: RoundWork) -> None:
    """The pooled (short) items on their owners: positions, encoders run, the rows sent to the
    placeholders' shards and the inputs sent to an owner outside the item's group. Positions
    are whole numbers, so adding them at once (`np.add.at`) gives the same sums."""
    lens = layout.s.item_len[np.asarray(item_ids, dtype=np.int64)]
    np.add.at(work.positions, np.asarray(owners, dtype=np.int64), lens)
    by_encoder: dict[str, list] = {}
    row_bytes = layout.hidden * 2
    for it, owner, length in zip(items, owners, lens):
        by_encoder.setdefault(it.encoder, []).append(owner)
        for j, count in enumerate(it.shards or (it.rows,)):  # its rows on each member's shard
            if count:
                work.sends.append((owner, it.home + j, count * row_bytes))
        if owner not in it.group:
            sender = it.group[owner % len(it.group)]
            work.inputs.append((sender, owner, length * INPUT_BYTES.get(it.encoder, 1024)))
    for enc, ranks in by_encoder.items():
        work.ran(enc, ranks)


def reshard_seconds(step, work) -> tuple[np.ndarray, np.ndarray]:
    """[W] seconds of each rank in the round's embedding all-to-all (forward; backward sends
    the gradients the same way), and [W] in the pool's input all-to-all (forward only)."""
    n = len(step.llm_ranks())
    (rows_s, rows_moved), (inputs_s, inputs_moved) = exchanges(step.cluster, work)
    for name, moved in (("reshard", rows_moved), ("pool_inputs", inputs_moved)):
        if moved is not None:
            step.a2a_bytes[name] += moved
    return rows_s[:n], inputs_s[:n]


def exchanges(c, work: RoundWork, tp: int = 1) -> list[tuple[np.ndarray, float | None]]:
    """[(seconds [gpus], bytes moved, None without messages)] of the round's embedding rows
    (forward and back) and of the pool's inputs on cluster `c`, of `work` or (`tp` > 1) of
    `over_tp(work, tp)`, its messages in that order: the placement's alone, so the plans sharing
    it share these (`work.memo`)."""
    key = ("reshard", tp)
    if key not in work.memo:
        out = []
        for msgs, times in ((work.sends, 2), (work.inputs, 1)):
            seconds, moved = np.zeros(c.gpus), None
            if msgs:
                src, dst, nbytes = (np.array(x, dtype=np.float64) for x in zip(*msgs))
                if tp > 1:  # TP rank by TP rank, each all the messages (g -> g * tp + t)
                    t = np.arange(tp, dtype=np.float64)[:, None]
                    src, dst = (src * tp + t).reshape(-1), (dst * tp + t).reshape(-1)
                    nbytes = np.tile(nbytes, tp)
                moved = float(nbytes[src != dst].sum()) * times
                seconds = comm.all_to_all_pairs(src.astype(np.int64), dst.astype(np.int64),
                                                nbytes, c)
            out.append((seconds, moved))
        work.memo[key] = out
    return work.memo[key]


# ------------------------------------------------------------------------ tensor parallel
def _tp_apart(rows, layout, world, tp, order) -> RoundWork:
    """Each row's items over its TP ranks by training's plan (`plan_tp_encode`'s owners,
    `assign_tp_items`, ties from `first_rank` of the row's sample ids, here their indices), and
    the gather of the rows: TP rank r sends its N_r rows to each of the tp - 1 others. Read
    from the owners alone (the plan's gathered positions, most of its time, go unused here)."""
    work = RoundWork(np.zeros(world), np.zeros(world))
    rank_of = {enc: i for i, enc in enumerate(order)}
    for row in rows:
        slots, ids, _ = layout.slots(row)
        if not slots:
            continue
        first = first_rank([str(n) for n in row.samples.tolist()], tp)
        owner = assign_tp_items([s.cost for s in slots], tp, first)
        in_order = sorted(range(len(slots)), key=lambda k: (rank_of[slots[k].encoder],
                                                            slots[k].index))
        own = [0] * tp  # rows each TP rank encodes
        for t in range(tp):  # rank by rank, each its items in `plan_tp_encode`'s order
            r = int(row.ranks[t])
            for k in (k for k in in_order if owner[k] == t):
                work.flops[r] += slots[k].cost
                work.positions[r] += layout.s.item_len[ids[k]]
                work.ran(slots[k].encoder, r)
                own[t] += len(slots[k].positions)
            if own[t]:  # bf16 rows of width D
                work.tp_gathers += [(r, int(d), own[t] * layout.hidden * 2)
                                    for d in row.ranks if d != r]
        work.tp_groups.append(row.ranks)
    return work


def _per_tp_rank(rows, layout, world, mode, long_items, heads, order, tp) -> RoundWork:
    """`mode` on the world without its TP axis (rank g -> g // tp: each row's SP group, the
    pool over the dp ranks), then copied to every TP rank t (g -> g * tp + t)."""
    folded = [Row(r.ranks[::tp] // tp, r.samples) for r in rows]
    return over_tp(round_work(folded, layout, world // tp, mode, long_items, heads, order), tp)


def over_tp(w: RoundWork, tp: int) -> RoundWork:
    """`w`, a round's work on the world without its TP axis, copied to every TP rank t (rank
    g -> g * tp + t): what each TP rank runs where they all run their SP group's or pool's plan."""
    out = RoundWork(np.repeat(w.flops, tp), np.repeat(w.positions, tp))
    for t in range(tp):
        out.split_positions += [(g * tp + t, n, e) for g, n, e in w.split_positions]
        out.sends += [(s * tp + t, d * tp + t, b) for s, d, b in w.sends]
        out.inputs += [(s * tp + t, d * tp + t, b) for s, d, b in w.inputs]
        out.groups += [g * tp + t for g in w.groups]
    out.present = {enc: np.repeat(ran, tp) for enc, ran in w.present.items()}
    return out
