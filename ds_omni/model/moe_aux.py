"""The MoE auxiliary load-balancing loss, as HF computes it, for each sample of a packed row.

HF's MoE LLMs (Qwen3-MoE, Qwen2-MoE, Mixtral, Qwen3-VL-MoE's text model) add
`router_aux_loss_coef x load_balancing_loss_func(router_logits)` to the loss when
`config.output_router_logits` is true. That loss (Switch Transformer's) is not a sum over tokens:
with c_e the top-k picks of expert e and p_e its summed router probability, over every MoE layer
and token of the forward,

    aux = E x sum_e (c_e / R) (p_e / R),  R = MoE layers x tokens.

So a packed row, a micro-batch split or a reordered step would each change it. ds_omni keeps the
one definition that no assignment can change: each sample's aux is HF's for that sample alone
(HF's forward on that one sequence), and a sample weighs in by its target tokens, as its token
losses do. The step's loss is then the target-weighted mean of HF's per-sample loss
(mean token loss + coef x aux):

    loss = (sum of token losses + coef x sum_s targets_s x aux_s) / global target tokens

which the trainer's normalisation (`train/step.py`) already applies to `loss_sum`.

The router logits are read by forward hooks on each MoE layer's gate, which exist both on HF's
block (`mlp.gate`: HF's router returns (logits, scores, indices), or logits alone) and on the
block DeepSpeed's AutoEP puts in its place (`mlp.router.gate`, a Linear giving the logits): the
same loss with or without expert parallelism. The hooks live for one forward: a layer recomputed
in backward (activation checkpointing) does not record again.
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
                   batch: "MicroBatch") -> torch.Tensor | float:
    """coef x sum_s targets_s x aux_s over the samples of one row (0 without an aux loss):
    `logits` the MoE layers' [T, E] (`recorded_router_logits`)."""
    if aux is None:
        return 0.0
    if batch.route.sharded:
        raise ModelError(
            "the MoE auxiliary loss (output_router_logits) is a per-sample loss that a sequence "
            "shard cannot compute alone in this version; set parallel.sp and "
            "parallel.max_sequence_sp to 1, or output_router_logits to false in the LLM config")
    if not logits:
        raise ModelError("the LLM config asks for the MoE auxiliary loss (output_router_logits) "
                         "but no decoder layer has a router (`mlp.gate` or `mlp.router.gate`)")
    return aux.coef * per_sample_aux(aux, [logits[i] for i in sorted(logits)],
                                     batch.cu_seqlens, (batch.host or batch).targets)


def per_sample_aux(aux: RouterAux, logits: list[torch.Tensor], cu_seqlens: torch.Tensor,
                   targets: torch.Tensor) -> torch.Tensor:
    """sum_s targets_s x aux_s: `logits` each MoE layer's [T, E], `cu_seqlens` [n + 1] the
    samples' bounds and `targets` [1, T] (IGNORE_INDEX, negative, where nothing is trained), both
    on the host: no device sync."""
    probs = torch.stack([F.softmax(x.float(), dim=-1) for x in logits])  # [L, T, E]
    picks = torch.topk(probs, aux.top_k, dim=-1).indices  # [L, T, k]
    # [L, T, E]: how often each token picked each expert (no gradient, as HF's histc)
    ones = torch.ones(picks.shape, dtype=probs.dtype, device=probs.device)
    counts = torch.zeros_like(probs).scatter_add_(-1, picks, ones)
    trained = (targets[0] >= 0).tolist()  # [T], on the host
    bounds = cu_seqlens.tolist()
    total = probs.new_zeros(())
    for start, end in zip(bounds[:-1], bounds[1:]):
        n_targets = sum(trained[start:end])
        if not n_targets:  # padding, or a sample with nothing trained
            continue
        rows = probs.shape[0] * (end - start)  # R: MoE layers x tokens of the sample
        c = counts[:, start:end].sum(dim=(0, 1)) / rows  # [E]
        p = probs[:, start:end].sum(dim=(0, 1)) / rows  # [E]
        total = total + n_targets * aux.num_experts * (c * p).sum()
    return total
