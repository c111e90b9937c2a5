"""Encoder pool (`parallel.encoder_pool`): every micro-batch round, the encoder items of all
data-parallel ranks are spread over those ranks by modelled cost, whatever rank holds their text.

Under ZeRO-3 the ranks meet at every parameter gather, so a round waits for its busiest encoder
even when the step's total cost is even. Per step, one all-gather of the items' metadata; every
rank computes the same plan of each round (`plan_round`, pure LPT with a locality slack that keeps
items home unless moving evens the round). Per round, `exchange_inputs` sends moved items' inputs
in one uneven all-to-all of bytes, the rank encodes its items (one call per encoder, as ZeRO-3
needs), and `ReshardEmbeddings` sends every row to the shard holding its placeholder. Under sp > 1
the pool is every rank (long items stay split over their group); under max_sequence_sp a round's
groups are its blocks and idle ranks take short items. The pool is the whole data-parallel group,
not the reorder group: ZeRO-3 waits for the busiest of all ranks that gather together.
More: docs/parallelism.md, "Encoder pool".

Dims: N rows (embeddings) of the round's items, N_r those rank r encodes, S a shard's tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import cached_property
from math import prod

import numpy as np
import torch
import torch.distributed as dist

from ds_omni.batch import EncodedItem
from ds_omni.parallel.dist import comm_device
from ds_omni.parallel.reshard import BALANCE_SLACK, RankReshard, item_slots

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- pure
@dataclass(frozen=True)
class PoolItem:
    """One encoder item of a round: its home (the first pool rank of the group holding its row:
    at sp = 1 the rank itself), its encoder, its place among that row's items of that encoder,
    the embedding rows it yields, its cost, its inputs' (key, shape, dtype) so a receiving rank
    can rebuild them, and under SP how many of its rows sit on each shard of the home group."""

    home: int
    encoder: str
    index: int
    rows: int
    cost: float
    inputs: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    shards: tuple[int, ...] = ()
    """[size of the home group] its rows on each shard, in order (placeholders may straddle a
    shard boundary); () stands for (rows,): a group of one rank."""
    seqs: tuple[int, ...] = ()
    """Its `EncodedItem.encoder_seqs`: a rebuilt item is priced as its home prices it (under pp)."""

    @property
    def nbytes(self) -> int:
        return sum(prod(shape) * _dtype(dtype).itemsize for _, shape, dtype in self.inputs)

    @property
    def group(self) -> range:
        """The pool ranks of its row's group (they all hold its inputs)."""
        return range(self.home, self.home + max(1, len(self.shards)))

    def held(self, rank: int) -> int:
        """Its rows whose placeholders sit on `rank`'s shard."""
        if rank not in self.group:
            return 0
        return self.shards[rank - self.home] if self.shards else self.rows

    def destinations(self) -> np.ndarray:
        """[rows] the pool rank whose shard holds each of its rows, in row order."""
        return np.repeat(np.asarray(self.group), self.shards or (self.rows,)).astype(np.int64)


def assign_pool(items: list[PoolItem], ranks: int, slack: float = BALANCE_SLACK,
                base: np.ndarray | None = None) -> list[int]:
    """The encoding rank of each item, in two passes, each costliest first (LPT):
    1. stay: an item stays on the member of its home group (its inputs are there) that holds most
       of its placeholders (its rows then stay put), if that keeps the member's load within the
       round's mean rank load plus `slack` x the mean;
    2. the others go to a rank whose load is within `slack` x the mean of the least loaded,
       preferring the home group, then its placeholders, then the least loaded, the lowest rank.
    `base` [ranks]: load the ranks carry before (their pieces of long items).

    Two passes, because items placed one by one in a single pass let the first group's items
    fill every rank and push the next group's items into the first group's place: evenly loaded
    groups would swap their items for nothing.
    Without `base`, the busiest rank's load stays <= mean + costliest item + slack x mean.
    Deterministic: every rank computes the same owners from the same items.
    """
    load = np.zeros(ranks) if base is None else np.array(base, dtype=np.float64)
    owner = [0] * len(items)
    mean = (sum(it.cost for it in items) + load.sum()) / ranks
    tolerance = slack * mean
    order = sorted(range(len(items)), key=lambda i: (-items[i].cost, i))
    moving = []
    for i in order:
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
        bound = load.min() + tolerance * (1 + 1e-9)
        home = [r for r in it.group if load[r] <= bound]
        if home:  # the home group first: its placeholders, then the least loaded
            owner[i] = int(min(home, key=lambda r: (-it.held(r), load[r], r)))
        else:  # the least loaded of the ranks within bound (np.argmin: the lowest rank on ties)
            ok = np.flatnonzero(load <= bound)
            owner[i] = int(ok[np.argmin(load[ok])])
        load[owner[i]] += it.cost
    return owner


@dataclass(frozen=True)
class HomeRow:
    """What a pool rank knows of its own row (under SP, its group's padded row): the group's
    first pool rank and size, the shard length, every item's placeholder positions in the whole
    row, and the long items its group splits (`RankReshard.split`)."""

    start: int
    size: int
    shard_len: int
    positions: dict[tuple[str, int], np.ndarray]  # (encoder, index) -> [n] ascending positions
    split: dict[str, list[tuple[int, tuple[int, ...]]]] = dataclasses.field(default_factory=dict)

    def piece(self, encoder: str, index: int, bounds: tuple[int, ...], member: int) -> np.ndarray:
        """Positions of the rows group member `member` yields of a long item."""
        return self.positions[(encoder, index)][bounds[member]:bounds[member + 1]]

    def mine(self, positions: np.ndarray, rank: int) -> np.ndarray:
        """Shard-local positions of those of `positions` on `rank`'s shard."""
        j = rank - self.start
        return positions[positions // self.shard_len == j] - j * self.shard_len


@dataclass(frozen=True)
class PoolPlan:
    """One round: every row's short items (home-major, then encoder order, then index), the rank
    that encodes each, and the long items that the rows' own groups split (not placed)."""

    items: list[PoolItem]
    owner: list[int]
    ranks: int
    encoder_order: list[str]
    long: list[PoolItem] = dataclasses.field(default_factory=list)

    @cached_property
    def _by_owner(self) -> list[list[int]]:
        at = {e: k for k, e in enumerate(self.encoder_order)}
        out: list[list[int]] = [[] for _ in range(self.ranks)]
        for i in sorted(range(len(self.items)), key=lambda i: (
                at[self.items[i].encoder], self.items[i].home, self.items[i].index)):
            out[self.owner[i]].append(i)
        return out

    def encodes(self, rank: int) -> list[int]:
        """Items `rank` encodes, in its output order: by encoder, then (home, index)."""
        return self._by_owner[rank]

    def moved(self) -> list[int]:
        """Items encoded away from home (outside their row's group)."""
        return [i for i, it in enumerate(self.items) if self.owner[i] not in it.group]

    def moved_to(self, rank: int) -> int:
        """How many items `rank` encodes for another group's row."""
        return sum(self.owner[i] == rank for i in self.moved())

    def loads(self) -> list[float]:
        """Modelled encoder cost per rank: its items and its pieces of long items."""
        out = list(_base(self.long, self.ranks))
        for it, o in zip(self.items, self.owner):
            out[o] += it.cost
        return out

    def sender(self, i: int) -> int:
        """The member of item i's home group that sends its inputs to an encoding rank outside
        the group: the one at the encoding rank's place in its own group (spreads the sends)."""
        group = self.items[i].group
        return group[self.owner[i] % len(group)]

    def sends(self, src: int, dst: int) -> list[int]:
        """Items whose inputs go from `src` to encoding rank `dst` (dst's output order)."""
        return [i for i in self.encodes(dst)
                if dst not in self.items[i].group and self.sender(i) == src]

    def group_rows(self) -> int:
        return sum(it.rows for it in self.items) + sum(it.rows for it in self.long)

    def reshard(self, rank: int, row: HomeRow) -> RankReshard:
        """`rank`'s part of the embedding exchange over the pool: its output rows (per encoder:
        its whole items in `encodes` order, then its pieces of its row's long items) go to the
        ranks holding their placeholders; it receives its shard's rows from whoever made them."""
        out_dest, encode_rows = [], {}
        for enc in self.encoder_order:
            for i in self.encodes(rank):
                if self.items[i].encoder == enc:
                    out_dest.append(self.items[i].destinations())
                    encode_rows[enc] = encode_rows.get(enc, 0) + self.items[i].rows
            for index, bounds in row.split.get(enc, []):
                piece = row.piece(enc, index, bounds, rank - row.start)
                out_dest.append(row.start + piece // row.shard_len)
                encode_rows[enc] = encode_rows.get(enc, 0) + len(piece)
        dest = np.concatenate(out_dest) if out_dest else np.zeros(0, np.int64)
        received = [self._received(src, rank, row) for src in range(self.ranks)]
        recv = [p for part in received for p in part]
        encode: dict[str, list[int]] = {}
        for i in self.encodes(rank):
            encode.setdefault(self.items[i].encoder, []).append(i)
        return RankReshard(
            rank=rank, order=list(self.encoder_order), encode=encode, encode_rows=encode_rows,
            group_rows=self.group_rows(), send_order=np.argsort(dest, kind="stable").tolist(),
            send_counts=np.bincount(dest, minlength=self.ranks).tolist(),
            recv_counts=[sum(map(len, part)) for part in received],
            recv_positions=np.concatenate(recv).astype(np.int64).tolist() if recv else [],
            split=row.split, group_rank=rank - row.start)

    def _received(self, src: int, rank: int, row: HomeRow) -> list[np.ndarray]:
        """Shard-local positions of the rows `src` sends `rank`, in `src`'s output order."""
        out = []
        for enc in self.encoder_order:
            for i in self.encodes(src):
                it = self.items[i]
                if it.encoder == enc and it.home == row.start:
                    out.append(row.mine(row.positions[(enc, it.index)], rank))
            if src in range(row.start, row.start + row.size):
                out += [row.mine(row.piece(enc, index, bounds, src - row.start), rank)
                        for index, bounds in row.split.get(enc, [])]
        return out


def _base(long: list[PoolItem], ranks: int) -> np.ndarray:
    """[ranks] each rank's share of the long items its group splits (cost / group size each)."""
    load = np.zeros(ranks)
    for it in long:
        load[it.group.start:it.group.stop] += it.cost / len(it.group)
    return load


def plan_round(items: list[PoolItem], ranks: int, encoder_order: list[str],
               slack: float = BALANCE_SLACK, long: list[PoolItem] = ()) -> PoolPlan:
    """One round's plan: `items` are the short items of every row (placed over all `ranks`),
    `long` the items each row's own group splits (they only weigh on its members' loads)."""
    long = list(long)
    return PoolPlan(items, assign_pool(items, ranks, slack, _base(long, ranks)), ranks,
                    encoder_order, long)


def item_meta(home: int, encoder: str, index: int, item, cost: float,
              shards: tuple[int, ...] = ()) -> PoolItem:
    """The metadata of an `EncodedItem` that other ranks need (no tensor data)."""
    inputs = tuple((k, tuple(v.shape), str(v.dtype).removeprefix("torch."))
                   for k, v in sorted(item.inputs.items()))
    return PoolItem(home, encoder, index, item.num_embeddings, float(cost), inputs, shards,
                    tuple(item.encoder_seqs))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# ---------------------------------------------------------------------------------- runtime
def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]


def exchange_inputs(plan: PoolPlan, rank: int, local: dict[str, list], group,
                    device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    """Inputs of the items other ranks send this rank to encode: plan item -> inputs (host).

    One uneven all-to-all of bytes over `group` carries every tensor of every moving item;
    `local` is this rank's items (encoder -> `EncodedItem`s in placeholder order). Every rank
    of the group calls this, also one that sends and receives nothing.
    """
    send_items = [plan.sends(rank, dst) for dst in range(plan.ranks)]
    recv_items = [plan.sends(src, rank) for src in range(plan.ranks)]
    parts = [_as_bytes(local[plan.items[i].encoder][plan.items[i].index].inputs[k])
             for items in send_items for i in items for k, _, _ in plan.items[i].inputs]
    send = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    in_splits = [sum(plan.items[i].nbytes for i in items) for items in send_items]
    out_splits = [sum(plan.items[i].nbytes for i in items) for items in recv_items]
    recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send.to(device), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    recv = recv.cpu()
    out, at = {}, 0
    for items in recv_items:
        for i in items:
            inputs = {}
            for key, shape, dtype in plan.items[i].inputs:
                n = prod(shape) * _dtype(dtype).itemsize
                inputs[key] = recv[at:at + n].clone().view(_dtype(dtype)).reshape(shape)
                at += n
            out[i] = inputs
    return out


class EncoderPool:
    """The encoder pool of one rank (module docstring): plans a step, places each round.

    `rank` and `size` are its place in the pool `group`; `sp` the size of the groups that share
    one row (static SP: consecutive pool ranks, as `ParallelPlan.coords` lays them out; under
    per-sequence SP 1, and a block's micro-batch names its own group in `sp_block`).
    """

    def __init__(self, group, rank: int, size: int, processors: dict, placeholder_ids: dict,
                 item_cost, device, slack: float = BALANCE_SLACK, sp: int = 1):
        self.group, self.rank, self.size, self.sp = group, rank, size, sp
        self.processors, self.placeholder_ids = processors, placeholder_ids
        self.item_cost, self.device, self.slack = item_cost, device, slack
        self.encoder_order = list(placeholder_ids)
        self.items_moved = 0  # items this rank encoded for another group's row, since start
        self.step_moved = 0  # the same, in the last planned step (metrics: data_pool_moved)
        self.step_moved_group = 0  # items encoded away from home by any rank, last step

    def _metadata(self, mb) -> tuple[list[PoolItem], list[PoolItem]]:
        """(short items, long items) of this rank's row in one round; only the first rank of
        the row's group reports them (the others hold the same row)."""
        if not any(mb.items.values()):
            return [], []
        row = self.home_row(mb)
        if row.start != self.rank:
            return [], []
        long = {(e, k) for e, pieces in row.split.items() for k, _ in pieces}
        short, longs = [], []
        for enc in self.encoder_order:
            for k, it in enumerate(mb.items.get(enc, [])):
                cost = self.item_cost(enc, it)
                if (enc, k) in long:
                    longs.append(PoolItem(row.start, enc, k, it.num_embeddings, float(cost),
                                          shards=(0,) * row.size))
                    continue
                shards = (tuple(np.bincount(row.positions[(enc, k)] // row.shard_len,
                                            minlength=row.size).tolist())
                          if row.size > 1 else ())
                short.append(item_meta(row.start, enc, k, it, cost, shards))
        return short, longs

    def plan_step(self, micro_batches: list) -> list[PoolPlan]:
        """Every round's plan, from one all-gather of the group's item metadata."""
        mine = [self._metadata(mb) for mb in micro_batches]
        everyone = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        rounds = {len(r) for r in everyone}
        if len(rounds) != 1:
            raise RuntimeError(f"parallel.encoder_pool: the ranks have {sorted(rounds)} "
                               "micro-batches this step; the pool needs the same number on each")
        plans = [plan_round([it for r in everyone for it in r[m][0]], self.size,
                            self.encoder_order, self.slack,
                            [it for r in everyone for it in r[m][1]]) for m in range(len(mine))]
        self.step_moved = sum(p.moved_to(self.rank) for p in plans)
        self.step_moved_group = sum(len(p.moved()) for p in plans)  # every rank's, same plans
        return plans

    def prepare(self, micro_batches: list):
        """The step's micro-batches placed round by round (`EmbeddingRouter.prepare_step`): the
        step planned when the first is taken, each round placed as the step takes it."""
        for mb, plan in zip(micro_batches, self.plan_step(micro_batches)):
            yield self.place(mb, plan)

    def place(self, mb, plan: PoolPlan):
        """`mb` with the inputs of the items this rank encodes in `plan`, and the embedding
        exchange that brings its shard's rows from wherever they were encoded (collective);
        `mb` itself when no item of the round leaves its group (every rank knows: no pool
        exchange at all; under SP the row's own resharding then runs)."""
        if not plan.moved():
            return mb
        received = exchange_inputs(plan, self.rank, mb.items, self.group, self.device)
        mine = plan.encodes(self.rank)
        self.items_moved += sum(self.rank not in plan.items[i].group for i in mine)
        inputs, items = {}, {}
        for enc in self.encoder_order:
            items[enc] = [_encoded(plan.items[i], mb.items, received.get(i), self.rank)
                          for i in mine if plan.items[i].encoder == enc]
            if items[enc]:
                inputs[enc] = self.processors[enc].collate(items[enc])
        return dataclasses.replace(mb, encoder_inputs=inputs).routed(
            pooled=True, reshard=plan.reshard(self.rank, self.home_row(mb)), pool_items=items)

    def home_row(self, mb) -> HomeRow:
        """This rank's row as the plan needs it: under SP (`mb.route.reshard` from `shard_row`) its
        group's padded row, the group being the micro-batch's per-sequence block (`route.sp_block`)
        or else the static SP group; otherwise (sp = 1, a sequence that runs alone, a filler)
        the micro-batch's own row."""
        route = mb.route
        if route.reshard is not None:
            size = route.sp_block[1] if route.sp_block is not None else self.sp
            return HomeRow(self.rank - route.reshard.rank, size, int(mb.input_ids.shape[1]),
                           route.row_positions, route.reshard.split)
        ids = (mb.host or mb).input_ids[0]
        items = {e: its for e, its in mb.items.items() if its}
        slots = item_slots(ids.numpy(), {e: self.placeholder_ids[e] for e in items},
                           {e: [it.num_embeddings for it in its] for e, its in items.items()},
                           {e: [0.0] * len(its) for e, its in items.items()})
        return HomeRow(self.rank, 1, max(1, int(ids.shape[0])),
                       {(sl.encoder, sl.index): sl.positions for sl in slots})


def _encoded(item: PoolItem, local: dict[str, list], received, rank: int):
    """The `EncodedItem` to collate: its row's own (this rank's group holds it), or one rebuilt
    from received inputs."""
    if rank in item.group:
        return local[item.encoder][item.index]
    return EncodedItem(inputs=received, num_embeddings=item.rows, encoder_seqs=list(item.seqs))


def encoder_pool_for(built, plan, rank: int, group, item_cost) -> EncoderPool | None:
    """`parallel.encoder_pool="dp"`: this rank's pool over `group` (`RankGroups.pool`), every
    rank of its pipeline stage (pp: `PipelineModule.pool`): the data-parallel x SP
    ranks, whose groups are consecutive pool ranks (under max_sequence_sp > 1 a block's
    micro-batch names its group, `sp_block`); priced by the loader's cost model. None (said once)
    when there is one data-parallel rank: the row's SP group (if any) already spreads its items."""
    if plan.dp == 1:
        if rank == 0:
            log.warning("parallel.encoder_pool=\"dp\" with one data-parallel rank: there is no "
                        "other row to share encoder work with; the pool is off")
        return None
    encoders = built.model.encoders
    # its place in the pool: under tp the pool is the dp x sp ranks of one TP rank, tp apart
    return EncoderPool(group, plan.pool_rank(rank), plan.pool_size, built.item_processors,
                       {name: enc.placeholder_ids for name, enc in encoders.items()},
                       item_cost, comm_device(), sp=plan.sp)
