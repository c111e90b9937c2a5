"""Samples -> one packed micro-batch row, so no sample attends to another.

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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ds_omni.data.processing import Sample
from ds_omni.model.family import EncodedItem, ItemProcessor, placeholder_ids
from ds_omni.model.omni import IGNORE_INDEX
from ds_omni.parallel.long_short import LongItems
from ds_omni.parallel.reshard import RankReshard, item_slots, plan_reshard

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class SeqShard:
    """This rank's place in its Ulysses group, and the modelled cost of an encoder item."""

    rank: int
    size: int
    item_cost: Callable[[str, EncodedItem], float]
    long_items: LongItems | None = None  # which items the whole group encodes (None: none)


@dataclass
class MicroBatch:
    """One packed row: what `OmniModel.forward` consumes."""

    input_ids: torch.Tensor  # [1, T]
    targets: torch.Tensor  # [1, T] next token, or IGNORE_INDEX
    position_ids: torch.Tensor  # [1, T] or [3, 1, T]
    cu_seqlens: torch.Tensor  # [n + 1] int32
    max_seqlen: int
    encoder_inputs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    sample_ids: list[str] = field(default_factory=list)
    reshard: RankReshard | None = None  # under SP: what this rank encodes, sends and receives
    pad_tokens: int = 0  # padding tokens in this row (or shard)
    sp_block: tuple[int, int] | None = None
    """Per-sequence SP: (first rank, size) of the block of ranks that splits this row, whose
    Ulysses group the model uses for it; None: the static plan's (no SP, or parallel.sp)."""
    host: "MicroBatch | None" = field(default=None, repr=False)  # the CPU batch `to` moved
    split_inputs: dict[str, list[dict[str, torch.Tensor]]] = field(default_factory=dict)
    """Under SP: encoder -> inputs of each long item of the row (`reshard.split`), one by one; every
    rank of the group has them all and encodes its piece of each."""
    encode_calls: dict[str, int] | None = None
    """ZeRO-3: how many times each encoder runs on this micro-batch, the same on every rank
    (`train_step` sets it; the model tops up with zero-weight dummy runs). None: no top-up."""
    blocks: torch.Tensor | None = None
    """[m, 2] (start, end) spans of the whole row whose tokens attend to each other both ways
    (Gemma 3's images); host tensor, the same on every rank of an SP group. None: causal."""
    items: dict[str, list[EncodedItem]] = field(default_factory=dict, repr=False)
    """The row's encoder items (host tensors), by encoder, in placeholder order: what a rank that
    encodes only some of them (the joint pipeline's uniform placement, the encoder pool) collates
    from; under SP the whole row's items."""
    row_positions: dict[tuple[str, int], "np.ndarray"] | None = None
    """Under SP: (encoder, index) -> the item's placeholder positions in the whole padded row
    (`reshard.item_slots`), for the encoder pool; None: the row is `input_ids` itself."""
    pooled: bool = False
    """`parallel.encoder_pool`: `encoder_inputs` are the items the pool gave this rank (any
    rank's), and `reshard` brings this row's rows home over the model's pool group."""

    @property
    def num_tokens(self) -> int:
        """Real tokens (padding excluded)."""
        return int(self.input_ids.shape[1]) - self.pad_tokens

    @property
    def num_targets(self) -> int:
        return int(((self.host or self).targets != IGNORE_INDEX).sum())

    def positions_of(self, token_ids: int | tuple[int, ...]) -> torch.Tensor:
        """[n] indices into the row where `input_ids` is one of `token_ids`, ascending, on this
        batch's device.

        Found on the host copy, so a batch on a GPU needs no device-to-host sync (a boolean mask
        on the device would: its count decides the shapes that follow).
        """
        ids = (self.host or self).input_ids[0]
        return self._host_positions(torch.isin(ids, torch.tensor(token_ids).reshape(-1)))

    def target_positions(self) -> torch.Tensor:
        """[n] indices of the positions that carry a target, on this batch's device (no sync)."""
        return self._host_positions((self.host or self).targets[0] != IGNORE_INDEX)

    def _host_positions(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.nonzero().squeeze(1).to(self.input_ids.device, non_blocking=True)

    def to(self, device) -> "MicroBatch":
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> "MicroBatch":
        """The same on page-locked host memory (CUDA only), so `to` copies asynchronously."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, move) -> "MicroBatch":
        return MicroBatch(
            input_ids=move(self.input_ids), targets=move(self.targets),
            position_ids=move(self.position_ids), cu_seqlens=self.cu_seqlens,  # stays on CPU
            max_seqlen=self.max_seqlen, sample_ids=self.sample_ids, reshard=self.reshard,
            pad_tokens=self.pad_tokens, sp_block=self.sp_block, host=self.host or self,
            items=self.items, blocks=self.blocks,
            encoder_inputs={e: {k: move(v) for k, v in d.items()}
                            for e, d in self.encoder_inputs.items()},
            split_inputs={e: [{k: move(v) for k, v in d.items()} for d in items]
                          for e, items in self.split_inputs.items()},
            encode_calls=self.encode_calls, row_positions=self.row_positions, pooled=self.pooled)


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
    if shard is None or shard.size == 1:
        mb.encoder_inputs = {e: processors[e].collate(items) for e, items in by_encoder.items()}
        mb.items = by_encoder
        return mb
    return shard_row(mb, by_encoder, processors, shard)


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
    """Rank `shard.rank`'s part of the whole `row` (every rank of the group computes the same plan)."""
    row = pad_row(row, shard.size, pad_id=_pad_id(processors))
    t = row.input_ids.shape[1]
    s = t // shard.size
    slots = item_slots(row.input_ids[0].numpy(), {e: placeholder_ids(processors, e) for e in items},
                       {e: [it.num_embeddings for it in its] for e, its in items.items()},
                       {e: [shard.item_cost(e, it) for it in its] for e, its in items.items()})
    plan = plan_reshard(slots, shard.size, s, list(items), shard.long_items)[shard.rank]
    lo, hi = shard.rank * s, (shard.rank + 1) * s
    real_end = t - row.pad_tokens
    return MicroBatch(
        input_ids=row.input_ids[:, lo:hi], targets=row.targets[:, lo:hi],
        position_ids=row.position_ids[..., lo:hi], cu_seqlens=row.cu_seqlens,
        max_seqlen=row.max_seqlen, sample_ids=row.sample_ids, reshard=plan, blocks=row.blocks,
        pad_tokens=max(0, hi - max(lo, real_end)),
        encoder_inputs={e: processors[e].collate([items[e][k] for k in idx])
                        for e, idx in plan.encode.items()},
        split_inputs={e: [processors[e].collate([items[e][k]]) for k, _ in long]
                      for e, long in plan.split.items()},
        items=items, row_positions={(sl.encoder, sl.index): sl.positions for sl in slots})


def pad_row(row: MicroBatch, multiple: int, pad_id: int) -> MicroBatch:
    """`row` padded to a multiple of `multiple` tokens by one more "sample" with no targets."""
    t = row.input_ids.shape[1]
    pad = -t % multiple
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


def empty_micro_batch(family, processors: dict[str, ItemProcessor] | None = None,
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
