"""Encoder pool: every micro-batch round, the encoder items of ALL data-parallel ranks are spread
over those ranks by modelled cost, independently of which rank holds their text.

Why: the budget planner (`data/reorder`) evens each rank's modelled cost over a whole step, but a
rank whose micro-batch holds many images still runs its encoder longer in that round. Under ZeRO-3
the ranks meet at every module's parameter gather, so each round waits for its busiest encoder;
with sp = 1 nothing else spreads that work (resharding, `parallel.reshard`, balances only inside a
row's SP group).

Which ranks pool: the data-parallel group (at sp = pp = 1, the world), not the reorder group. The
straggler that ZeRO-3 waits for is the busiest of ALL the ranks that gather together, which is the
whole data-parallel group; pooling inside reorder groups of G ranks would leave the imbalance
between groups. The price is one all-to-all over that group per round (inputs) plus the embedding
exchange; the locality slack keeps items at home unless moving one evens the round, so most of the
group's items never move.

Per step: one all-gather of the items' metadata (encoder, rows, cost, input shapes and dtypes) over
the group; every rank then computes the same plan of every round (pure, `plan_round`). Per round:
1. `exchange_inputs`: the inputs of items that move travel to their encoding rank, all tensors of
   the round as bytes in ONE uneven all-to-all (any family's per-item inputs: CLIP pixels, Qwen2-VL
   patches + grid, Whisper features + mask, LLaVA-NeXT tiles + sizes);
2. the rank encodes its items (collated by the family's own `collate`; one encoder call each, so
   ZeRO-3 keeps equal call counts), and `ReshardEmbeddings` (the SP resharding's autograd
   all-to-all, over this group) sends every embedding row to the rank whose row holds its
   placeholder; backward sends the gradients back to the encoding rank.
A round whose plan moves nothing runs as without the pool (no exchange).

Dims: N rows (embeddings) of the round's items, N_r those rank r encodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from math import prod

import numpy as np
import torch
import torch.distributed as dist

from ds_omni.model.family import EncodedItem
from ds_omni.parallel.reshard import BALANCE_SLACK, RankReshard, item_slots


# ------------------------------------------------------------------------------------- pure
@dataclass(frozen=True)
class PoolItem:
    """One encoder item of a round: the rank whose row holds its placeholders, its encoder, its
    place among that row's items of that encoder, the embedding rows it yields, its cost, and
    its inputs' (key, shape, dtype) so a receiving rank can rebuild them."""

    home: int
    encoder: str
    index: int
    rows: int
    cost: float
    inputs: tuple[tuple[str, tuple[int, ...], str], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(prod(shape) * _dtype(dtype).itemsize for _, shape, dtype in self.inputs)


def assign_pool(items: list[PoolItem], ranks: int, slack: float = BALANCE_SLACK) -> list[int]:
    """The encoding rank of each item: costliest first (LPT), onto a rank whose load is within
    `slack` x the mean rank load of the least loaded, preferring the item's home rank (its
    inputs and rows then stay put), then the least loaded, then the lowest rank.

    The busiest rank's load stays <= mean + costliest item + slack x mean. Deterministic: every
    rank computes the same owners from the same items.
    """
    load = np.zeros(ranks)
    owner = [0] * len(items)
    tolerance = slack * sum(it.cost for it in items) / ranks
    for i in sorted(range(len(items)), key=lambda i: (-items[i].cost, i)):
        ok = np.flatnonzero(load <= load.min() + tolerance * (1 + 1e-9))
        owner[i] = int(min(ok, key=lambda r: (r != items[i].home, load[r], r)))
        load[owner[i]] += items[i].cost
    return owner


@dataclass(frozen=True)
class PoolPlan:
    """One round: every rank's items (home-rank-major, then encoder order, then index) and the
    rank that encodes each."""

    items: list[PoolItem]
    owner: list[int]
    ranks: int
    encoder_order: list[str]

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
        """Items encoded away from home."""
        return [i for i, it in enumerate(self.items) if self.owner[i] != it.home]

    def moved_to(self, rank: int) -> int:
        """How many items `rank` encodes for another rank."""
        return sum(self.owner[i] == rank for i in self.moved())

    def loads(self) -> list[float]:
        out = [0.0] * self.ranks
        for it, o in zip(self.items, self.owner):
            out[o] += it.cost
        return out

    def sends(self, src: int, dst: int) -> list[int]:
        """Items whose inputs go from home `src` to encoding rank `dst` (dst's output order)."""
        return [i for i in self.encodes(dst) if self.items[i].home == src and src != dst]

    def reshard(self, rank: int, positions: dict[tuple[str, int], np.ndarray]) -> RankReshard:
        """`rank`'s part of the embedding exchange; `positions[(encoder, index)]` are the row
        positions of this rank's own items' placeholders."""
        mine = self.encodes(rank)
        dest = np.array([self.items[i].home for i in mine for _ in range(self.items[i].rows)],
                        dtype=np.int64)
        received = [[i for i in self.encodes(src) if self.items[i].home == rank]
                    for src in range(self.ranks)]
        recv_positions = [positions[(self.items[i].encoder, self.items[i].index)]
                          for part in received for i in part]
        encode_rows: dict[str, int] = {}
        encode: dict[str, list[int]] = {}
        for i in mine:
            it = self.items[i]
            encode_rows[it.encoder] = encode_rows.get(it.encoder, 0) + it.rows
            encode.setdefault(it.encoder, []).append(i)
        return RankReshard(
            rank=rank, order=list(self.encoder_order), encode=encode, encode_rows=encode_rows,
            group_rows=sum(it.rows for it in self.items),
            send_order=np.argsort(dest, kind="stable").tolist(),
            send_counts=np.bincount(dest, minlength=self.ranks).tolist(),
            recv_counts=[sum(self.items[i].rows for i in part) for part in received],
            recv_positions=(np.concatenate(recv_positions).astype(np.int64).tolist()
                            if recv_positions else []))


def plan_round(items: list[PoolItem], ranks: int, encoder_order: list[str],
               slack: float = BALANCE_SLACK) -> PoolPlan:
    return PoolPlan(items, assign_pool(items, ranks, slack), ranks, encoder_order)


def item_meta(home: int, encoder: str, index: int, item, cost: float) -> PoolItem:
    """The metadata of an `EncodedItem` that other ranks need (no tensor data)."""
    inputs = tuple((k, tuple(v.shape), str(v.dtype).removeprefix("torch."))
                   for k, v in sorted(item.inputs.items()))
    return PoolItem(home, encoder, index, item.num_embeddings, float(cost), inputs)


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
    """The encoder pool of one rank (module docstring): plans a step, places each round."""

    def __init__(self, group, rank: int, size: int, processors: dict, placeholder_ids: dict,
                 item_cost, device, slack: float = BALANCE_SLACK):
        self.group, self.rank, self.size = group, rank, size
        self.processors, self.placeholder_ids = processors, placeholder_ids
        self.item_cost, self.device, self.slack = item_cost, device, slack
        self.encoder_order = list(placeholder_ids)
        self.items_moved = 0  # items this rank encoded for another rank, since start
        self.step_moved = 0  # the same, in the last planned step (metrics: data_pool_moved)
        self.step_moved_group = 0  # items encoded away from home by any rank, last step

    def _metadata(self, micro_batches: list) -> list[list[PoolItem]]:
        return [[item_meta(self.rank, enc, k, it, self.item_cost(enc, it))
                 for enc in self.encoder_order for k, it in enumerate(mb.items.get(enc, []))]
                for mb in micro_batches]

    def plan_step(self, micro_batches: list) -> list[PoolPlan]:
        """Every round's plan, from one all-gather of the group's item metadata."""
        mine = self._metadata(micro_batches)
        everyone = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        rounds = {len(r) for r in everyone}
        if len(rounds) != 1:
            raise RuntimeError(f"parallel.encoder_pool: the ranks have {sorted(rounds)} "
                               "micro-batches this step; the pool needs the same number on each")
        plans = [plan_round([it for r in everyone for it in r[m]], self.size, self.encoder_order,
                            self.slack) for m in range(len(mine))]
        self.step_moved = sum(p.moved_to(self.rank) for p in plans)
        self.step_moved_group = sum(len(p.moved()) for p in plans)  # every rank's, same plans
        return plans

    def place(self, mb, plan: PoolPlan):
        """`mb` with the inputs of the items this rank encodes in `plan`, and the embedding
        exchange that brings its own placeholders' rows home (collective); `mb` itself when no
        item of the round moves (every rank knows: no exchange at all)."""
        if not plan.moved():
            return mb
        received = exchange_inputs(plan, self.rank, mb.items, self.group, self.device)
        mine = plan.encodes(self.rank)
        self.items_moved += sum(plan.items[i].home != self.rank for i in mine)
        inputs = {}
        for enc in self.encoder_order:
            items = [_encoded(plan.items[i], mb.items, received.get(i), self.rank)
                     for i in mine if plan.items[i].encoder == enc]
            if items:
                inputs[enc] = self.processors[enc].collate(items)
        return dataclasses.replace(mb, encoder_inputs=inputs, pooled=True,
                                   reshard=plan.reshard(self.rank, self._positions(mb)))

    def _positions(self, mb) -> dict[tuple[str, int], np.ndarray]:
        items = {e: its for e, its in mb.items.items() if its}
        slots = item_slots((mb.host or mb).input_ids[0].numpy(),
                           {e: self.placeholder_ids[e] for e in items},
                           {e: [it.num_embeddings for it in its] for e, its in items.items()},
                           {e: [0.0] * len(its) for e, its in items.items()})
        return {(s.encoder, s.index): s.positions for s in slots}


def _encoded(item: PoolItem, local: dict[str, list], received, rank: int):
    """The `EncodedItem` to collate: this rank's own, or one rebuilt from received inputs."""
    if item.home == rank:
        return local[item.encoder][item.index]
    return EncodedItem(inputs=received, num_embeddings=item.rows)
