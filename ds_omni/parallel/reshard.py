"""Adaptive resharding: encoder outputs -> the LLM sequence shards that hold their placeholders.

Under LLM sequence parallelism every item of the packed row is encoded by one rank of the SP group,
chosen by modelled cost (LPT), not by where its placeholders sit; one uneven all-to-all then sends
each embedding row to the rank whose shard holds its placeholder (backward the same way back), an
item cut by a shard boundary going to two ranks. The naive schemes move far more: every rank
encoding every item, or an all-gather of all embeddings. Long items (`long_short`) are encoded by
every rank of the group, each piece sent on like a short item. The plan is a pure function of the
packed row, which every rank of the group has; only `ReshardEmbeddings` talks.
More: docs/parallelism.md, "Sequence parallelism".

Dims: T padded row length (a multiple of sp), S = T / sp tokens per shard, N embedding rows of the
row, N_r rows rank r encodes, D LLM hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ds_omni.parallel.long_short import LongItems, split_rows


@dataclass(frozen=True)
class ItemSlots:
    """One encoder item of the packed row: which encoder, its cost, its placeholder positions."""

    encoder: str
    index: int  # position of the item among its encoder's items, in text order
    positions: np.ndarray  # [n] global token positions its n embeddings replace, ascending
    cost: float  # modelled encoder cost


@dataclass(frozen=True)
class RankReshard:
    """What one SP rank does in the step's resharding (all lists are plain ints)."""

    rank: int
    order: list[str]  # encoders whose rows are concatenated, in this order, before sending
    encode: dict[str, list[int]]  # encoder -> indices of the items this rank encodes, text order
    encode_rows: dict[str, int]  # encoder -> embedding rows those items (and its pieces) yield
    group_rows: int  # rows of the whole row, all ranks: 0 means nothing to exchange
    send_order: list[int]  # [N_r] local output rows, reordered by destination rank (stable)
    send_counts: list[int]  # [sp] rows sent to each rank (self included)
    recv_counts: list[int]  # [sp] rows received from each rank
    recv_positions: list[int]  # [sum(recv_counts)] shard-local position of each received row
    split: dict[str, list[tuple[int, tuple[int, ...]]]] = field(default_factory=dict)
    """encoder -> its long items (index, row bounds [sp + 1]), text order: every rank of the group
    encodes its piece of each; a rank's rows are its whole items', then its pieces', per encoder."""
    group_rank: int | None = None
    """Under the encoder pool (`parallel.encoder_pool`), where `rank` is a rank of the whole pool:
    this rank's place in its row's SP group, whose piece of each long item it encodes; None: `rank`."""

    @property
    def piece_rank(self) -> int:
        """The rank's place in the group that splits its row's long items."""
        return self.rank if self.group_rank is None else self.group_rank

    @property
    def rows_out(self) -> int:
        return sum(self.send_counts)

    @property
    def rows_in(self) -> int:
        return sum(self.recv_counts)

    def rows_moved(self) -> int:
        """Rows that leave this rank (the ones sent to itself are a local copy)."""
        return self.rows_out - self.send_counts[self.rank]


def item_slots(input_ids: np.ndarray, placeholder_ids: dict[str, int | tuple[int, ...]],
               item_sizes: dict[str, list[int]], item_costs: dict[str, list[float]]) -> list[ItemSlots]:
    """Placeholder positions of every item: encoder e's k-th item owns the next n_k of e's slots
    (tokens equal to any of e's placeholder ids: Qwen2-VL's images and videos share an encoder).

    input_ids [T] (the whole padded row); item_sizes[e][k] = embeddings of e's k-th item.
    """
    slots = []
    for enc, sizes in item_sizes.items():
        where = np.flatnonzero(np.isin(input_ids, placeholder_ids[enc]))
        if len(where) != sum(sizes):
            raise ValueError(f"encoder {enc!r}: the row has {len(where)} placeholder tokens but its "
                             f"items yield {sum(sizes)} embeddings ({sizes})")
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        for k, n in enumerate(sizes):
            slots.append(ItemSlots(enc, k, where[offsets[k]:offsets[k] + n], item_costs[enc][k]))
    return slots


BALANCE_SLACK = 0.05
"""How far above the least-loaded rank (as a fraction of the mean rank load) an item may still be
placed so that it stays where its placeholders are: 0 is plain LPT. benchmarks/sequence_parallel.py
measured plain LPT moving most rows of image-heavy rows (it breaks only exact ties by locality)."""


def assign_items(slots: list[ItemSlots], sp: int, shard_len: int,
                 slack: float = BALANCE_SLACK) -> list[int]:
    """The rank that encodes each item: costliest first (LPT), onto a rank whose load is within
    `slack` x the mean rank load of the least-loaded one, preferring the rank that holds most of
    the item's placeholders (so its rows need not move), then the least loaded.

    The busiest rank's load stays <= mean + costliest item + slack x mean.
    """
    load = [0.0] * sp  # plain floats: numpy's sums and comparisons, without its scalars
    owner = [0] * len(slots)
    tolerance = slack * sum(s.cost for s in slots) / sp
    for i in sorted(range(len(slots)), key=lambda i: (-slots[i].cost, i)):
        held = np.bincount(slots[i].positions // shard_len, minlength=sp)[:sp].tolist()
        limit = min(load) + tolerance * (1 + 1e-9)
        ok = [r for r in range(sp) if load[r] <= limit]
        owner[i] = min(ok, key=lambda r: (-held[r], load[r], r))
        load[owner[i]] += slots[i].cost
    return owner


def place_items(slots: list[ItemSlots], sp: int, shard_len: int, encoder_order: list[str],
                long_items: LongItems | None = None) -> tuple[dict, dict, list[int]]:
    """`plan_reshard`'s decisions alone: (owner {slot: rank} of the whole items, pieces {slot:
    [sp + 1] row bounds} of the split ones, the slots in every rank's output order). The
    simulator reads only these (it prices the sends, not the receive positions)."""
    total = sum(s.cost for s in slots)
    long = [i for i, s in enumerate(slots) if long_items is not None and long_items.is_long(
        s.encoder, s.cost, len(s.positions), sp, total)]
    pieces = {i: split_rows(len(slots[i].positions), sp) for i in long}
    short = [i for i in range(len(slots)) if i not in pieces]
    owner = dict(zip(short, assign_items([slots[i] for i in short], sp, shard_len)))
    rank_order = {enc: i for i, enc in enumerate(encoder_order)}
    in_order = sorted(range(len(slots)), key=lambda i: (rank_order[slots[i].encoder],
                                                        i in pieces, slots[i].index))
    return owner, pieces, in_order


def plan_reshard(slots: list[ItemSlots], sp: int, shard_len: int, encoder_order: list[str],
                 long_items: LongItems | None = None) -> list[RankReshard]:
    """Every rank's part of the all-to-all (pure: identical on all ranks of the group).

    A rank's output rows, per encoder in `encoder_order` (the order `OmniModel` runs its encoders
    in): its whole items' embeddings in text order, then its pieces of the long items in text order.
    `long_items` None: no item is split.
    """
    owner, pieces, in_order = place_items(slots, sp, shard_len, encoder_order, long_items)
    # rows of rank r in its output order, as global positions
    out_positions = []
    for r in range(sp):
        rows = [slots[i].positions[pieces[i][r]:pieces[i][r + 1]] if i in pieces
                else slots[i].positions for i in in_order if i in pieces or owner[i] == r]
        out_positions.append(np.concatenate(rows).astype(np.int64) if rows
                             else np.zeros(0, np.int64))
    split: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
    for i in in_order:
        if i in pieces:
            split.setdefault(slots[i].encoder, []).append((slots[i].index, tuple(pieces[i])))
    plans = []
    for r in range(sp):
        dest = out_positions[r] // shard_len
        send_order = np.argsort(dest, kind="stable")
        recv_positions = [out_positions[s][out_positions[s] // shard_len == r] - r * shard_len
                          for s in range(sp)]
        encode: dict[str, list[int]] = {}
        encode_rows: dict[str, int] = {}
        for i in in_order:
            enc = slots[i].encoder
            if i in pieces:
                encode_rows[enc] = encode_rows.get(enc, 0) + pieces[i][r + 1] - pieces[i][r]
            elif owner[i] == r:
                encode.setdefault(enc, []).append(slots[i].index)
                encode_rows[enc] = encode_rows.get(enc, 0) + len(slots[i].positions)
        plans.append(RankReshard(
            rank=r, order=list(encoder_order), encode=encode, encode_rows=encode_rows,
            group_rows=sum(len(p) for p in out_positions), send_order=send_order.tolist(),
            send_counts=np.bincount(dest, minlength=sp).tolist(),
            recv_counts=[len(p) for p in recv_positions],
            recv_positions=np.concatenate(recv_positions).tolist(), split=split))
    return plans


def bytes_moved(plans: list[RankReshard], hidden: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes that cross ranks in one row's resharding, against the all-gather baseline.

    all_gather: every rank receives every other rank's rows ((sp - 1) x N rows in all).
    """
    sp = len(plans)
    rows = sum(p.rows_out for p in plans)
    row_bytes = hidden * dtype_bytes
    return {"reshard": sum(p.rows_moved() for p in plans) * row_bytes,
            "all_gather": (sp - 1) * rows * row_bytes}


# ------------------------------------------------------------------------ the collective
class ReshardEmbeddings(torch.autograd.Function):
    """[N_r, D] rows this rank encoded -> [sum(recv_counts), D] rows its shard needs.

    Forward: one `all_to_all_single` with uneven splits over the SP group. Backward: the same
    exchange reversed (gradients of received rows go back to the rank that encoded them).
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: RankReshard, group) -> torch.Tensor:
        ctx.plan, ctx.group = plan, group
        order = torch.as_tensor(plan.send_order, dtype=torch.long, device=rows.device)
        send = rows.index_select(0, order).contiguous()  # [N_r, D] grouped by destination
        recv = rows.new_empty((plan.rows_in, rows.shape[1]))
        dist.all_to_all_single(recv, send, output_split_sizes=plan.recv_counts,
                               input_split_sizes=plan.send_counts, group=group)
        return recv

    @staticmethod
    def backward(ctx, grad_recv: torch.Tensor):
        plan = ctx.plan
        grad_send = grad_recv.new_empty((plan.rows_out, grad_recv.shape[1]))
        dist.all_to_all_single(grad_send, grad_recv.contiguous(),
                               output_split_sizes=plan.send_counts,
                               input_split_sizes=plan.recv_counts, group=ctx.group)
        order = torch.as_tensor(plan.send_order, dtype=torch.long, device=grad_recv.device)
        grad_rows = torch.empty_like(grad_send).index_copy_(0, order, grad_send)  # undo the sort
        return grad_rows, None, None
