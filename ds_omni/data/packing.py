"""Samples -> one packed micro-batch row, so no sample attends to another.

Positions restart at each sample, `cu_seqlens` marks sample boundaries for the attention kernel,
and targets are shifted inside each sample (the last token of a sample predicts nothing).

Dims: T packed tokens (sum of sample lengths), n samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds_omni.data.processing import Sample
from ds_omni.model.family import ItemProcessor
from ds_omni.model.omni import IGNORE_INDEX


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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def to(self, device) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(
            input_ids=move(self.input_ids), targets=move(self.targets),
            position_ids=move(self.position_ids), cu_seqlens=self.cu_seqlens,  # stays on CPU
            max_seqlen=self.max_seqlen, sample_ids=self.sample_ids,
            encoder_inputs={e: {k: move(v) for k, v in d.items()} for e, d in self.encoder_inputs.items()})


def sample_targets(sample: Sample) -> torch.Tensor:
    """[L] next-token targets of one sample: token t+1 where it is trained on, else IGNORE_INDEX."""
    targets = torch.full_like(sample.input_ids, IGNORE_INDEX)
    nxt = sample.input_ids[1:]
    targets[:-1] = torch.where(sample.loss_mask[1:], nxt, torch.full_like(nxt, IGNORE_INDEX))
    return targets


def pack(samples: list[Sample], processors: dict[str, ItemProcessor]) -> MicroBatch:
    """Concatenate `samples` into one row [1, T] with per-sample positions and targets."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    lengths = [s.length for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    positions = torch.cat([s.position_ids for s in samples], dim=-1)  # [T] or [3, T]
    by_encoder: dict[str, list] = {}
    for s in samples:
        for enc, item in s.items:
            by_encoder.setdefault(enc, []).append(item)
    return MicroBatch(
        input_ids=torch.cat([s.input_ids for s in samples]).unsqueeze(0),
        targets=torch.cat([sample_targets(s) for s in samples]).unsqueeze(0),
        position_ids=positions.unsqueeze(-2),  # [1, T] or [3, 1, T]
        cu_seqlens=cu, max_seqlen=max(lengths),
        encoder_inputs={e: processors[e].collate(items) for e, items in by_encoder.items()},
        sample_ids=[s.sample_id for s in samples])


def empty_micro_batch(family) -> MicroBatch:
    """A one-token micro-batch with nothing to predict, for a rank with no sample left in it.

    It still runs every module (and every encoder on its dummy input), so the number of forward
    and backward passes, and ZeRO-3's parameter gathers, stay the same on all ranks.
    """
    one = torch.zeros(1, 1, dtype=torch.long)
    positions = family.position_ids(one[0], [])  # [1] or [3, 1] (M-RoPE)
    return MicroBatch(input_ids=one, targets=torch.full_like(one, IGNORE_INDEX),
                      position_ids=positions.unsqueeze(-2),
                      cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1)
