"""Long-short sequence parallelism for encoders: a long item is encoded by a group of ranks.

Short items run whole, one rank each (`ds_omni.parallel.reshard` spreads them by cost); an item
above the cost threshold is split over every rank of the group: each runs the encoder on a
contiguous piece of its tokens, and inside attention Ulysses all-to-alls trade the sequence split
for a head split and back. Everything else is per token, so a rank's piece yields the item's
embedding rows [a_r, b_r), which the reshard all-to-all sends on like any other rows. Pure math:
`split_rows`, `is_long`; runtime: `EncoderShard`, `sharded`, `ulysses_attention` (registered as
`ENCODER_ULYSSES`; its name contains "flash" so packing towers like Qwen2-VL's hand it the item's
`cu_seqlens`). More: docs/parallelism.md, "Long-short SP for encoders".

Dims: B batch (1 for a split item), H heads, P ranks of the group, L the item's encoder tokens,
L_r the tokens of rank r's piece, D head dim.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ENCODER_ULYSSES = "ds_omni_flash_encoder_ulysses"


# ------------------------------------------------------------------------------ pure math
def split_rows(rows: int, size: int) -> list[int]:
    """[size + 1] bounds cutting an item's `rows` embedding rows into `size` contiguous pieces whose
    lengths differ by at most one (the longer ones first)."""
    base, extra = divmod(rows, size)
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + base + (r < extra))
    return bounds


def is_long(cost: float, rows: int, size: int, threshold: float | None, group_cost: float) -> bool:
    """Whether an item is encoded by the whole group rather than by one rank.

    threshold: a modelled cost (the item's cost must exceed it), or None for "auto": the item costs
    more than one rank's share of the row's encoder work (`group_cost / size`), the point past which
    no placement of whole items can balance the group. An item with fewer rows than ranks stays
    whole.
    """
    if size < 2 or rows < size:
        return False
    limit = group_cost / size if threshold is None else threshold
    return cost > limit


@dataclass(frozen=True)
class LongItems:
    """Which items a group encodes together: the threshold (None: "auto", see `is_long`) and the
    attention heads of every encoder that can be split (Ulysses needs heads divisible by the group)."""

    threshold: float | None
    heads: dict[str, int]

    def splittable(self, encoder: str, size: int) -> bool:
        return encoder in self.heads and self.heads[encoder] % size == 0

    def is_long(self, encoder: str, cost: float, rows: int, size: int, group_cost: float) -> bool:
        return self.splittable(encoder, size) and is_long(cost, rows, size, self.threshold,
                                                          group_cost)


# ------------------------------------------------------------------------------ the runtime
@dataclass(frozen=True)
class EncoderShard:
    """Rank `rank`'s piece of one item split over a group of `size` ranks.

    `tokens` [size + 1]: bounds of every rank's piece of the item's encoder sequence (uneven).
    """

    group: object
    rank: int
    size: int
    tokens: tuple[int, ...]

    @property
    def lo(self) -> int:
        return self.tokens[self.rank]

    @property
    def hi(self) -> int:
        return self.tokens[self.rank + 1]

    def counts(self) -> list[int]:
        return [self.tokens[r + 1] - self.tokens[r] for r in range(self.size)]

    def cut(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's piece of a tensor laid out over the whole item's sequence along `dim`."""
        return full.narrow(dim, self.lo, self.hi - self.lo)


class _SeqToHeads(torch.autograd.Function):
    """[B, H, L_r, D] (all heads, this rank's tokens) <-> [B, H / P, L, D] (its heads, all tokens).

    One `all_to_all_single` with uneven splits (pieces differ in length); backward is the same
    exchange the other way. `to_heads=False` runs the inverse.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: EncoderShard, to_heads: bool) -> torch.Tensor:
        ctx.shard, ctx.to_heads = shard, to_heads
        return _exchange(x, shard, to_heads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.shard, not ctx.to_heads), None, None


def _exchange(x: torch.Tensor, shard: EncoderShard, to_heads: bool) -> torch.Tensor:
    return _to_heads(x, shard) if to_heads else _to_tokens(x, shard)


def _to_heads(x: torch.Tensor, shard: EncoderShard) -> torch.Tensor:
    """[B, H, L_r, D] -> [B, H/P, L, D]: head chunk j goes to rank j; every rank's tokens come in."""
    p, counts = shard.size, shard.counts()
    b, h, _, d = x.shape
    send = torch.stack(x.chunk(p, dim=1))  # [P, B, H/P, L_r, D]
    recv_sizes = [b * (h // p) * n * d for n in counts]
    recv = x.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send.reshape(-1).contiguous(), recv_sizes,
                           [send[0].numel()] * p, group=shard.group)
    parts = [chunk.view(b, h // p, n, d) for chunk, n in zip(recv.split(recv_sizes), counts)]
    return torch.cat(parts, dim=2)


def _to_tokens(x: torch.Tensor, shard: EncoderShard) -> torch.Tensor:
    """[B, H/P, L, D] -> [B, H, L_r, D]: token piece j goes to rank j; every rank's heads come in."""
    p, counts = shard.size, shard.counts()
    b, hp, _, d = x.shape
    send = torch.cat([piece.reshape(-1) for piece in x.split(counts, dim=2)])
    n_local = counts[shard.rank]
    recv = x.new_empty(p * b * hp * n_local * d)
    dist.all_to_all_single(recv, send.contiguous(), [b * hp * n_local * d] * p,
                           [b * hp * n * d for n in counts], group=shard.group)
    return torch.cat(recv.view(p, b, hp, n_local, d).unbind(0), dim=1)


_current: list[tuple[object, EncoderShard]] = []  # (config, shard) of the encode running now


@contextlib.contextmanager
def sharded(config, shard: EncoderShard):
    """Within: attention modules reading `config` run `ulysses_attention` over `shard`'s group."""
    register()
    before = config._attn_implementation
    config._attn_implementation = ENCODER_ULYSSES
    _current.append((config, shard))
    try:
        yield
    finally:
        _current.pop()
        config._attn_implementation = before


@contextlib.contextmanager
def cut_input(layer: torch.nn.Module, shard: EncoderShard, dim: int):
    """Within: `layer` (an HF encoder's first layer) runs on this rank's piece of its input hidden
    states (cut along `dim`), so every later layer does too; embeddings before it run whole."""
    def hook(module, args, kwargs):
        if args:
            return (shard.cut(args[0], dim), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": shard.cut(kwargs["hidden_states"], dim)}
    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def first_layer(tower: torch.nn.Module) -> torch.nn.Module:
    """The first of an HF encoder's layers (the first `ModuleList` named `layers`)."""
    for name, module in tower.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return module[0]
    raise ValueError(f"{type(tower).__name__} has no `layers` list to cut the sequence at")


def recompute_context():
    """For activation checkpointing: a `context_fn` that re-enters the shard in force now (if
    any) when a layer is recomputed in backward, where `sharded` has long been left."""
    if not _current:
        return None
    config, shard = _current[-1]
    return lambda: (contextlib.nullcontext(), sharded(config, shard))


def current() -> EncoderShard | None:
    return _current[-1][1] if _current else None


def ulysses_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                      cu_seq_lens_q=None, is_causal=False, **kwargs):
    """HF attention interface: q, k, v [B, H, L_r, D] -> output [B, L_r, H, D], weights None.

    Attends over the whole item: `attention_mask` (if any) is the whole item's [B, 1, L, L];
    `cu_seq_lens_q` (Qwen2-VL: frames of one video item) keeps sub-sequences apart.
    """
    shard = current()
    if shard is None:
        raise RuntimeError(f"{ENCODER_ULYSSES} attention ran outside `long_short.sharded`; it is set "
                           "on an encoder's config only while ds_omni encodes a split item")
    q, k, v = (_SeqToHeads.apply(t, shard, True) for t in (query, key, value))  # [B, H/P, L, D]
    if cu_seq_lens_q is not None and len(cu_seq_lens_q) > 2:
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat([F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=scaling, is_causal=is_causal)
            for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
    else:
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                             is_causal=is_causal and mask is None)
    out = _SeqToHeads.apply(out, shard, False)  # [B, H, L_r, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ENCODER_ULYSSES, ulysses_attention)

