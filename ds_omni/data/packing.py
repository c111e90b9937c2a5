"""Samples -> one packed micro-batch row (`ds_omni.batch.MicroBatch`), so no sample attends to
another.

Positions restart at each sample, `cu_seqlens` marks sample boundaries for the attention kernel,
and targets are shifted inside each sample (the last token of a sample predicts nothing).

Under Ulysses sequence parallelism (`SeqShard`), every rank of the SP group packs the same row and
keeps its own contiguous shard of it: the row is padded to a multiple of sp with a padding
"sample" that has no targets (it attends only to itself), positions and targets are cut like the
tokens, `cu_seqlens` stays global, and the rank collates only the encoder items the reshard plan
(`ds_omni.parallel.reshard`) gives it to encode.

Dims: T packed tokens (sum of sample lengths; padded to a multiple of sp under SP), S = T / sp,
n samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ds_omni.batch import (IGNORE_INDEX, EncodedItem, ItemProcessor, MicroBatch, Route,
                           SampleFamily, placeholder_ids)
from ds_omni.data.processing import Sample
from ds_omni.parallel.long_short import LongItems
from ds_omni.parallel.reshard import item_slots, plan_reshard
from ds_omni.parallel.tp_encode import first_rank, plan_tp_encode
from ds_omni.parallel.row_cut import RowCut


@dataclass(frozen=True)
class SeqShard:
    """This rank's place in its Ulysses group, and the modelled cost of an encoder item."""

    rank: int
    size: int
    item_cost: Callable[[str, EncodedItem], float]
    long_items: LongItems | None = None  # which items the whole group encodes (None: none)
    block: tuple[int, int] | None = None  # per-sequence SP: the row's block (`Route.sp_block`)
    cut: RowCut | None = None  # how the row is cut over the `size` ranks (None: contiguous)

    @property
    def row_cut(self) -> RowCut:
        return self.cut or RowCut(self.size)


def sample_targets(sample: Sample) -> torch.Tensor:
    """[L] next-token targets of one sample: token t+1 where it is trained on, else IGNORE_INDEX."""
    targets = torch.full_like(sample.input_ids, IGNORE_INDEX)
    nxt = sample.input_ids[1:]
    targets[:-1] = torch.where(sample.loss_mask[1:], nxt, torch.full_like(nxt, IGNORE_INDEX))
    return targets


def pack(samples: list[Sample], processors: dict[str, ItemProcessor],
         shard: SeqShard | None = None) -> MicroBatch:
    """Concatenate `samples` into one row [1, T] with per-sample positions and targets.

    With `shard` (sp > 1): this rank's shard [1, S] of the padded row (module docstring).
    """
    mb, by_encoder = _whole_row(samples)
    if shard is None or shard.size == 1:
        mb.encoder_inputs = {e: processors[e].collate(items) for e, items in by_encoder.items()}
        mb.items = by_encoder
        return mb
    return shard_row(mb, by_encoder, processors, shard)


def pack_shards(samples: list[Sample], processors: dict[str, ItemProcessor],
                shard: SeqShard) -> list[MicroBatch]:
    """Every rank's shard of the packed row [1, S] each, in group-rank order: what each rank of
    the group would pack itself (`pack` with its `shard`), made from one processing of the
    samples (one reader per SP group, `ds_omni.data.shared_read`)."""
    mb, by_encoder = _whole_row(samples)
    return [shard_row(mb, by_encoder, processors, dataclasses.replace(shard, rank=r))
            for r in range(shard.size)]


def _whole_row(samples: list[Sample]) -> tuple[MicroBatch, dict[str, list[EncodedItem]]]:
    """The row [1, T] of `samples` without encoder inputs, and its items by encoder."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    lengths = [s.length for s in samples]
    by_encoder: dict[str, list[EncodedItem]] = {}
    for s in samples:
        for enc, item in s.items:
            by_encoder.setdefault(enc, []).append(item)
    mb = MicroBatch(
        input_ids=torch.cat([s.input_ids for s in samples]).unsqueeze(0),
        targets=torch.cat([sample_targets(s) for s in samples]).unsqueeze(0),
        # [1, T] or [3, 1, T] (M-RoPE)
        position_ids=torch.cat([s.position_ids for s in samples], dim=-1).unsqueeze(-2),
        cu_seqlens=_cu_seqlens(lengths), max_seqlen=max(lengths),
        sample_ids=[s.sample_id for s in samples], blocks=_row_blocks(samples))
    return mb, by_encoder


def _row_blocks(samples: list[Sample]) -> torch.Tensor | None:
    """The samples' bidirectional spans moved to row positions [m, 2], or None if none has one."""
    spans, offset = [], 0
    for s in samples:
        spans += [(offset + a, offset + b) for a, b in s.blocks]
        offset += s.length
    return torch.tensor(spans, dtype=torch.long) if spans else None


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu


def shard_row(row: MicroBatch, items: dict[str, list[EncodedItem]],
              processors: dict[str, ItemProcessor], shard: SeqShard) -> MicroBatch:
    """Rank `shard.rank`'s part of the whole `row` (every rank of the group computes the same plan).
    The row is padded and laid out as its cut says (`ds_omni.parallel.row_cut`): the shard is a
    slice of that order, and its placeholders' rows are sent where the layout put them."""
    layout = shard.row_cut.layout((row.cu_seqlens[1:] - row.cu_seqlens[:-1]).tolist())
    row = pad_tokens(row, layout.pad, _pad_id(processors))
    if layout.order is None:
        layout = None
    t = row.input_ids.shape[1]
    s = t // shard.size
    slots = item_slots(row.input_ids[0].numpy(), {e: placeholder_ids(processors, e) for e in items},
                       {e: [it.num_embeddings for it in its] for e, its in items.items()},
                       {e: [shard.item_cost(e, it) for it in its] for e, its in items.items()})
    order = np.arange(t) if layout is None else layout.order  # [T'] row position of each slot
    if layout is not None:  # placeholders at the slots the layout gives their row positions
        where = layout.slots_of()
        slots = [dataclasses.replace(sl, positions=where[sl.positions]) for sl in slots]
    plan = plan_reshard(slots, shard.size, s, list(items), shard.long_items)[shard.rank]
    lo, hi = shard.rank * s, (shard.rank + 1) * s
    # this shard's tokens: a slice of the row, or the row positions its slots of the layout hold
    mine = slice(lo, hi) if layout is None else torch.from_numpy(order[lo:hi])
    return MicroBatch(
        input_ids=row.input_ids[:, mine], targets=row.targets[:, mine],
        position_ids=row.position_ids[..., mine], cu_seqlens=row.cu_seqlens,
        max_seqlen=row.max_seqlen, sample_ids=row.sample_ids, blocks=row.blocks,
        pad_tokens=int((order[lo:hi] >= t - row.pad_tokens).sum()),
        encoder_inputs={e: processors[e].collate([items[e][k] for k in idx])
                        for e, idx in plan.encode.items()},
        items=items, route=Route(
            reshard=plan, sp_block=shard.block,
            row_index=None if layout is None else layout.index,
            row_positions={(sl.encoder, sl.index): sl.positions for sl in slots},
            split_inputs={e: [processors[e].collate([items[e][k]]) for k, _ in long]
                          for e, long in plan.split.items()}))


def tp_share(row: MicroBatch, processors: dict[str, ItemProcessor], rank: int, size: int,
             item_cost: Callable[[str, EncodedItem], float]) -> MicroBatch:
    """Under parallel.tp: TP rank `rank`'s copy of the whole `row` (packed by `pack`, with its
    `items`), holding the encoder inputs of only the items it encodes and its part of the
    gather (`Route.tp_encode`, `ds_omni.parallel.tp_encode`). Every rank of the TP group
    computes the same plan; a reader for the group can make all `size` copies from one row."""
    items = {e: its for e, its in row.items.items() if its}
    slots = item_slots((row.host or row).input_ids[0].numpy(),
                       {e: placeholder_ids(processors, e) for e in items},
                       {e: [it.num_embeddings for it in its] for e, its in items.items()},
                       {e: [item_cost(e, it) for it in its] for e, its in items.items()})
    plan = plan_tp_encode(slots, size, list(items), first_rank(row.sample_ids, size))[rank]
    return dataclasses.replace(row, encoder_inputs={
        e: processors[e].collate([items[e][k] for k in idx]) for e, idx in plan.encode.items()
    }).routed(tp_encode=plan)


def pad_tokens(row: MicroBatch, pad: int, pad_id: int) -> MicroBatch:
    """`row` with `pad` more tokens: one more "sample" with no targets (none for 0)."""
    t = row.input_ids.shape[1]
    if pad == 0:
        return row
    positions = torch.arange(pad).expand(*row.position_ids.shape[:-1], pad)  # [1, p] or [3, 1, p]
    cu = torch.cat([row.cu_seqlens, torch.tensor([t + pad], dtype=torch.int32)])
    return MicroBatch(
        input_ids=torch.cat([row.input_ids, torch.full((1, pad), pad_id)], dim=1),
        targets=torch.cat([row.targets, torch.full((1, pad), IGNORE_INDEX)], dim=1),
        position_ids=torch.cat([row.position_ids, positions], dim=-1), cu_seqlens=cu,
        max_seqlen=max(row.max_seqlen, pad), sample_ids=row.sample_ids,
        pad_tokens=row.pad_tokens + pad, blocks=row.blocks)


def _pad_id(processors: dict[str, ItemProcessor]) -> int:
    """A token id that is no placeholder (padding must not be taken for an image)."""
    taken = {i for p in processors.values() for i in (p.placeholder_id, *p.more_placeholder_ids)}
    return min(set(range(len(taken) + 1)) - taken)


def empty_micro_batch(family: SampleFamily, processors: dict[str, ItemProcessor] | None = None,
                      shard: SeqShard | None = None) -> MicroBatch:
    """A one-token micro-batch with nothing to predict, for a rank with no sample left in it.

    It still runs every module (and every encoder on its dummy input), so the number of forward
    and backward passes, and ZeRO-3's parameter gathers, stay the same on all ranks.
    """
    one = torch.zeros(1, 1, dtype=torch.long)
    positions = family.position_ids(one[0], [])  # [1] or [3, 1] (M-RoPE)
    mb = MicroBatch(input_ids=one, targets=torch.full_like(one, IGNORE_INDEX),
                    position_ids=positions.unsqueeze(-2),
                    cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1, pad_tokens=1)
    if shard is None or shard.size == 1:
        return mb
    return shard_row(mb, {}, processors or {}, shard)
