"""Encoder items over the tensor-parallel ranks of a row (parallel.tp): each TP rank encodes a
share of the row's items, and one all-gather gives every TP rank every embedding row.

TP ranks hold the same packed row whole, so unlike the SP resharding every TP rank needs every
row. Encoding every item on every TP rank is exact but tp x the work; this plan gives each item to
one TP rank by modelled cost (LPT: the busiest load <= the mean + the costliest item), and
`GatherTPRows` all-gathers the rows. The plan is a pure function of the row, so all TP ranks
compute it without talking, and a loader reading once for the group can send each peer only the
inputs it encodes. More: docs/parallelism.md, "Tensor parallelism".

Dims: N embedding rows of the row, N_r rows TP rank r encodes, W a row's width ((1 + k) D).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ds_omni.parallel.reshard import ItemSlots


@dataclass(frozen=True)
class TPEncode:
    """What one TP rank does in encoding a row its TP group holds whole (plain ints)."""

    rank: int
    """The rank's place in its TP group."""
    order: list[str]
    """Encoders whose rows a rank concatenates, in this order, before the gather."""
    encode: dict[str, list[int]]
    """encoder -> indices (text order) of the items this rank encodes."""
    encode_rows: dict[str, int]
    """encoder -> embedding rows those items yield."""
    rank_rows: list[int]
    """[tp] rows each TP rank encodes: its part of the all-gather."""
    positions: list[int]
    """[N] row position (the placeholder it replaces) of each gathered row, TP rank by TP rank,
    each rank's rows in its output order (per encoder in `order`, items in text order)."""

    @property
    def group_rows(self) -> int:
        """Rows of the whole row, all ranks: 0 means nothing to gather."""
        return sum(self.rank_rows)

    @property
    def items(self) -> int:
        """Items this rank encodes."""
        return sum(map(len, self.encode.values()))

    @property
    def first_row(self) -> int:
        """Where this rank's rows start among the gathered ones."""
        return sum(self.rank_rows[:self.rank])


def assign_tp_items(costs: list[float], tp: int, first: int = 0) -> list[int]:
    """The TP rank that encodes each item: costliest first onto the least-loaded rank, ties to
    the first of them counting from rank `first` (then first + 1, ... mod tp). No locality to
    prefer: every TP rank holds every placeholder. Deterministic, so every rank of the group
    computes the same owners."""
    load = [0.0] * tp  # plain floats: the same sums as numpy's, without its scalars
    owner = [0] * len(costs)
    turn = [(first + k) % tp for k in range(tp)]  # the ranks in tie-breaking order
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner[i] = min(turn, key=lambda r: load[r])  # min: the first least-loaded in `turn`
        load[owner[i]] += costs[i]
    return owner


def first_rank(sample_ids: list[str], tp: int) -> int:
    """The TP rank a row's ties go to first, from its samples' ids (the same in every process,
    unlike `hash`): rows of one item each then spread over the TP ranks instead of all going
    to rank 0 (the step takes as long either way, but rank 0 would hold all the encoder
    activations and the others run only dummies)."""
    return zlib.crc32("\n".join(sample_ids).encode()) % tp


def plan_tp_encode(slots: list[ItemSlots], tp: int, encoder_order: list[str],
                   first: int = 0) -> list[TPEncode]:
    """Every TP rank's part (pure: identical on all ranks of the group). `slots`: the row's
    items (`reshard.item_slots` of the whole row); `encoder_order`: the order `OmniModel` runs
    its encoders in; `first`: where the ties of `assign_tp_items` start (`first_rank`)."""
    owner = assign_tp_items([s.cost for s in slots], tp, first)
    rank_of_encoder = {enc: i for i, enc in enumerate(encoder_order)}
    in_order = sorted(range(len(slots)), key=lambda i: (rank_of_encoder[slots[i].encoder],
                                                        slots[i].index))
    encode: list[dict[str, list[int]]] = [{} for _ in range(tp)]
    rows: list[dict[str, int]] = [{} for _ in range(tp)]
    positions: list[list[np.ndarray]] = [[] for _ in range(tp)]
    for i in in_order:
        r, s = owner[i], slots[i]
        encode[r].setdefault(s.encoder, []).append(s.index)
        rows[r][s.encoder] = rows[r].get(s.encoder, 0) + len(s.positions)
        positions[r].append(s.positions)
    rank_rows = [sum(rows[r].values()) for r in range(tp)]
    parts = [part for r in range(tp) for part in positions[r]]
    gathered = np.concatenate(parts).astype(np.int64).tolist() if parts else []
    return [TPEncode(rank=r, order=list(encoder_order), encode=encode[r], encode_rows=rows[r],
                     rank_rows=rank_rows, positions=gathered) for r in range(tp)]


# ------------------------------------------------------------------------ the collective
class GatherTPRows(torch.autograd.Function):
    """[N_r, W] rows this TP rank encoded -> [N, W] the rows of every TP rank, rank by rank.

    Forward: one `all_to_all_single` over the TP group that sends this rank's rows to every
    rank (an all-gather with uneven parts, which gloo's and NCCL's all_gather lack).
    Backward: this rank's own slice of the incoming gradient, with NO communication. The
    gradient of the gathered rows is already whole, and the same, on every TP rank: they are
    scattered into the LLM's input embeddings, and everything from there up to the loss is
    either replicated (embeddings, norms, the residual stream, the LM head) or one of AutoTP's
    column-parallel layers, which all-reduce their input gradient over the TP group. A sum over
    the TP ranks would count it tp times.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: TPEncode, group) -> torch.Tensor:
        ctx.plan, ctx.group = plan, group
        tp = len(plan.rank_rows)
        send = rows.repeat(tp, 1).contiguous()  # [tp N_r, W]: the same rows to every rank
        recv = rows.new_empty((plan.group_rows, rows.shape[1]))
        dist.all_to_all_single(recv, send, output_split_sizes=plan.rank_rows,
                               input_split_sizes=[rows.shape[0]] * tp, group=group)
        return recv

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        lo = plan.first_row
        return grad[lo:lo + plan.rank_rows[plan.rank]], None, None
