"""The MoE auxiliary load-balancing loss, as HF computes it, for each sample of a packed row.

HF's load-balancing loss is not a sum over tokens (aux = E x sum_e (c_e / R) (p_e / R) over every
MoE layer and token of the forward), so packing, splitting or reordering would change it. ds_omni
keeps the one definition no assignment can change: each sample's aux is HF's for that sample
alone, weighted by its target tokens like its token losses:
    loss = (sum of token losses + coef x sum_s targets_s x aux_s) / global target tokens.
Under sequence parallelism each rank sums a sample's statistics over its shard (`SampleStats`)
and the group adds them (an all-reduce autograd sees) before the aux is formed. Router logits are
read by forward hooks on each MoE gate, on HF's block and on AutoEP's alike, for one forward (a
recomputed layer does not record again). More: docs/parallelism.md, "Expert parallelism".
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_omni.errors import ModelError

if TYPE_CHECKING:
    from ds_omni.batch import MicroBatch


@dataclass(frozen=True)
class RouterAux:
    """What the aux loss of an HF MoE config needs (`router_aux_of`)."""

    coef: float  # config.router_aux_loss_coef
    num_experts: int
    top_k: int


def router_aux_of(config) -> RouterAux | None:
    """The aux loss HF's forward adds for this LLM config, or None (not an MoE model, or
    `output_router_logits` off: HF then trains without it, and so does ds_omni)."""
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not num_experts or not getattr(config, "output_router_logits", False):
        return None
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    return RouterAux(coef=coef, num_experts=int(num_experts),
                     top_k=int(config.num_experts_per_tok)) if coef else None


def moe_gate(layer: nn.Module) -> nn.Module | None:
    """The module whose output holds a decoder layer's router logits [T, E], or None (dense)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return None
    router = getattr(mlp, "router", None)  # AutoEP's block: router.gate is the Linear
    if router is not None and isinstance(getattr(router, "gate", None), nn.Module):
        return router.gate
    gate = getattr(mlp, "gate", None)  # HF's block: gate next to experts
    return gate if gate is not None and hasattr(mlp, "experts") else None


@contextmanager
def recorded_router_logits(backbone: nn.Module):
    """Collects each MoE layer's router logits [T, E] during the block, by layer index; nothing
    (no hooks) when the backbone has no aux loss (`backbone.router_aux` None)."""
    logits: dict[int, torch.Tensor] = {}
    handles = []
    layers = backbone.layers if backbone.router_aux is not None else []
    for i, layer in enumerate(layers):
        gate = moe_gate(layer)
        if gate is None:
            continue

        def record(_module, _args, out, i=i):  # the first call: the forward's own
            logits.setdefault(i, out[0] if isinstance(out, tuple) else out)
        handles.append(gate.register_forward_hook(record))
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


def router_aux_sum(aux: RouterAux | None, logits: dict[int, torch.Tensor],
                   batch: "MicroBatch", router=None) -> torch.Tensor | float:
    """coef x sum_s targets_s x aux_s over the samples of one row (0 without an aux loss):
    `logits` the MoE layers' [T, E] (`recorded_router_logits`). `router`: the plan's routing
    (`OmniModel.router`, None without one), whose `aux_group(batch)` is (the group the row is
    split over, its SP counts) or (None, None) for a row held whole: a split row's ranks each
    return 1 / size of the row's sum (`sp_aux_sum`), and the counts note that reduction."""
    if aux is None:
        return 0.0
    group, counts = router.aux_group(batch) if router is not None else (None, None)
    if not logits:
        raise ModelError("the LLM config asks for the MoE auxiliary loss (output_router_logits) "
                         "but no decoder layer has a router (`mlp.gate` or `mlp.router.gate`)")
    layers = [logits[i] for i in sorted(logits)]
    targets = (batch.host or batch).targets
    if group is None:
        return aux.coef * per_sample_aux(aux, layers, batch.cu_seqlens, targets)
    if counts is not None:
        counts.aux_reductions += 1
    return aux.coef * sp_aux_sum(aux, layers, batch.cu_seqlens, targets, group,
                                 batch.route.row_index)


def per_sample_aux(aux: RouterAux, logits: list[torch.Tensor], cu_seqlens: torch.Tensor,
                   targets: torch.Tensor) -> torch.Tensor:
    """sum_s targets_s x aux_s of a row held whole: `logits` each MoE layer's [T, E],
    `cu_seqlens` [n + 1] the samples' bounds and `targets` [1, T] (IGNORE_INDEX, negative,
    where nothing is trained), both on the host: no device sync."""
    return aux_from_stats(aux, shard_stats(aux, logits, cu_seqlens, targets, offset=0))


@dataclass
class SampleStats:
    """What a sample's aux needs, per sample of a row, over the tokens one rank holds: sums
    over those tokens, so the shards of a split row add up to the whole sample's."""

    probs: torch.Tensor  # [n, E] summed router probabilities (MoE layers x tokens); grad
    picks: torch.Tensor  # [n, E] top-k picks of each expert (no gradient, as HF's histc)
    tokens: torch.Tensor  # [n] tokens of the sample held here
    targets: torch.Tensor  # [n] trained tokens of the sample held here

    def __add__(self, other: "SampleStats") -> "SampleStats":
        return SampleStats(self.probs + other.probs, self.picks + other.picks,
                           self.tokens + other.tokens, self.targets + other.targets)


def shard_stats(aux: RouterAux, logits: list[torch.Tensor], cu_seqlens: torch.Tensor,
                targets: torch.Tensor, offset: int,
                positions: torch.Tensor | None = None) -> SampleStats:
    """The `SampleStats` of this rank's tokens, positions [offset, offset + S) of the row (or
    `positions` [S], a ring's zigzag shard): `logits` each MoE layer's [S, E], `cu_seqlens`
    [n + 1] the whole (padded) row's bounds, `targets` [1, S] this rank's, both on the host."""
    probs = torch.stack([F.softmax(x.float(), dim=-1) for x in logits])  # [L, S, E]
    picks = torch.topk(probs, aux.top_k, dim=-1).indices  # [L, S, k]
    ones = torch.ones(picks.shape, dtype=probs.dtype, device=probs.device)
    counts = torch.zeros_like(probs).scatter_add_(-1, picks, ones)  # [L, S, E]
    s, n = probs.shape[1], cu_seqlens.numel() - 1
    if positions is None:
        positions = torch.arange(offset, offset + s)
    sample = torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)  # [S] on the host
    trained = (targets[0] >= 0).to(torch.float64)  # [S]
    on = sample.to(probs.device)
    return SampleStats(
        probs=probs.new_zeros(n, probs.shape[-1]).index_add(0, on, probs.sum(dim=0)),
        picks=probs.new_zeros(n, probs.shape[-1]).index_add(0, on, counts.sum(dim=0)),
        tokens=torch.bincount(sample, minlength=n).to(probs.device, probs.dtype)
        * probs.shape[0],  # R counts MoE layers x tokens
        targets=torch.bincount(sample, weights=trained, minlength=n).to(probs.device,
                                                                       probs.dtype))


def aux_from_stats(aux: RouterAux, stats: SampleStats) -> torch.Tensor:
    """sum_s targets_s x aux_s, aux_s = E x sum_e (c_e / R)(p_e / R) with R = MoE layers x the
    sample's tokens (HF's `load_balancing_loss_func` on the sample alone); a sample with nothing
    trained (padding) weighs 0."""
    rows = stats.tokens.clamp(min=1).unsqueeze(1)  # [n, 1]
    per_sample = ((stats.picks / rows) * (stats.probs / rows)).sum(dim=1)  # [n]
    return (stats.targets * aux.num_experts * per_sample).sum()


def sp_aux_sum(aux: RouterAux, logits: list[torch.Tensor], cu_seqlens: torch.Tensor,
               targets: torch.Tensor, group, index=None) -> torch.Tensor:
    """This rank's part of sum_s targets_s x aux_s of a row split over `group` (its shard's
    `logits` [S, E] each, rank r of the group holding positions [r S, (r + 1) S), or under a
    ring slots [r S, (r + 1) S) of `index`, the zigzag's [cp, C] row positions): the samples'
    stats are summed over the group first, the probabilities by an all-reduce that autograd
    sees (its backward sums the ranks' gradients), so every rank has the whole samples' aux;
    each then returns 1 / size of it, so the sum over the group (as ZeRO sums the SP ranks'
    gradients and the step the ranks' loss sums) counts each sample once. Every rank of the
    group must call it, for every row the group runs."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_reduce
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    s = logits[0].shape[0]
    positions = (None if index is None
                 else torch.as_tensor(index).reshape(-1)[rank * s:(rank + 1) * s].long())
    mine = shard_stats(aux, logits, cu_seqlens, targets, rank * s, positions)
    n = mine.tokens.shape[0]
    plain = torch.cat([mine.picks.flatten(), mine.tokens, mine.targets])  # one no-grad reduce
    dist.all_reduce(plain, group=group)
    picks, rest = plain[:mine.picks.numel()].view_as(mine.picks), plain[mine.picks.numel():]
    whole = SampleStats(all_reduce(mine.probs, group=group), picks, rest[:n], rest[n:])
    return aux_from_stats(aux, whole) / size
