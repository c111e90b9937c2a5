"""The MoE auxiliary loss of an LLM over pipeline stages (parallel.pp x an MoE LLM, ep or not).

HF's aux loss of a sample is not a sum over layers (aux_s = E x sum_e (c_e / R)(p_e / R), c and
p summed over every MoE layer: `ds_omni.model.moe_aux`), so no stage can price its own layers.
Each stage adds its layers' per-sample statistics to two tensors that travel with the hidden
states (`AuxCarry`): the router probabilities' sums [n, E] (float, sent a gradient back like the
hidden states) and the top-k picks with the tokens counted, [n, E + 1] (integers, no gradient).
The last stage sums them over the row's SP group (parallel.sp: each rank carries its shard's),
forms every sample's aux as one process does, and adds coef x sum_s targets_s x aux_s to the
loss; its backward reaches each stage's routers through the carried probabilities. DeepSpeed
runs a stage's backward as one `Tensor.backward` per floating output: the second would walk the
stage's graph below its routers again; `one_backward` makes them one pass. More:
docs/parallelism.md, "Pipeline parallelism".

Dims: n samples of the row, E experts, T packed tokens.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ds_omni.batch import IGNORE_INDEX
from ds_omni.model.moe_aux import RouterAux, SampleStats, aux_from_stats, moe_gate, shard_stats


@contextmanager
def one_backward(engine):
    """Around a stage's `BackwardPass` (not the last stage's): DeepSpeed's
    `out.backward(grad, retain_graph=True)` per floating output but the last are gathered and
    run with the last as one `torch.autograd.backward`, each node of the graph once (the
    gradients are the same sums)."""
    if engine.is_last_stage():
        yield
        return
    original, pending = torch.Tensor.backward, []

    def gathered(out, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        if create_graph or inputs is not None:  # not DeepSpeed's call: as it was
            return original(out, gradient, retain_graph, create_graph, inputs)
        pending.append((out, gradient))
        if not retain_graph:
            tensors, grads = zip(*pending)
            pending.clear()
            run_gathered(list(tensors), list(grads))
        return None

    torch.Tensor.backward = gathered
    try:
        yield
    finally:
        torch.Tensor.backward = original
    if pending:
        raise RuntimeError(f"{len(pending)} stage outputs' backward never ran")


def run_gathered(tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """The backward of a stage's floating outputs from their gradients, in one pass."""
    torch.autograd.backward(tensors, grads)


class AuxCarry:
    """The carried aux statistics of one model (`router_aux`, None: no aux loss, nothing
    carried); `layers_added` counts the MoE layers' statistics this rank's stages added (the
    tests' proof that every stage's layers reached the loss)."""

    def __init__(self, aux: RouterAux | None, sp_group=lambda: None):
        self.aux = aux
        self.sp_group = sp_group  # () -> the SP group every row is split over, or None
        self.layers_added = 0
        self.sp_sums = 0  # rows whose statistics the last stage summed over the SP group

    def _offset(self, shard: int) -> int:
        """This rank's first position in its row (SP rank x shard length; 0 unsplit)."""
        group = self.sp_group()
        return 0 if group is None else torch.distributed.get_rank(group) * shard

    def start(self, cu_seqlens: torch.Tensor, device) -> tuple[torch.Tensor, ...]:
        """The first stage's empty statistics for a row with bounds `cu_seqlens` [n + 1]: ()
        without an aux loss. The probabilities' sums are a leaf that asks for a gradient, so the
        pipeline's backward has one to send even where a stage holds no MoE layer."""
        if self.aux is None:
            return ()
        n, experts = cu_seqlens.numel() - 1, self.aux.num_experts
        probs = torch.zeros(n, experts, device=device, requires_grad=True)  # [n, E]
        counts = torch.zeros(n, experts + 1, dtype=torch.long, device=device)  # [n, E + 1]
        return probs, counts

    @contextmanager
    def through(self, layer: nn.Module, carry: tuple, cu_seqlens: torch.Tensor):
        """Around one decoder layer's forward: yields a list holding `carry`, which on exit
        holds it with the layer's statistics added (unchanged for a dense layer or none)."""
        out = list(carry)
        gate = moe_gate(layer) if carry else None
        if gate is None:
            yield out
            return
        logits = []
        handle = gate.register_forward_hook(
            lambda _m, _a, o: logits.append(o[0] if isinstance(o, tuple) else o))
        try:
            yield out
        finally:
            handle.remove()
        out[:] = self.add(out, logits[0], cu_seqlens)

    def add(self, carry: list, logits: torch.Tensor, cu_seqlens: torch.Tensor) -> list:
        """`carry` plus one MoE layer's statistics of its router `logits` [T, E]."""
        probs, counts = carry
        bounds = cu_seqlens.cpu()
        untrained = torch.full((1, logits.shape[0]), IGNORE_INDEX)  # the last stage counts those
        stats = shard_stats(self.aux, [logits], bounds, untrained,
                            offset=self._offset(logits.shape[0]))
        self.layers_added += 1
        picked = torch.cat([stats.picks, stats.tokens.unsqueeze(1)], dim=1)  # [n, E + 1]
        return [probs + stats.probs, counts + picked.round().long()]

    def loss(self, carry: tuple, cu_seqlens: torch.Tensor, targets: torch.Tensor):
        """coef x sum_s targets_s x aux_s of the row from the whole `carry` (0 without one);
        `targets` [1, T] this rank's, on the host. Under SP, every rank's sums are added over
        the group (the probabilities by an all-reduce autograd sees) and each rank returns
        1 / sp of the row's aux, so the group's loss sums count it once."""
        if not carry:
            return 0.0
        probs, counts = carry
        experts = self.aux.num_experts
        bounds = cu_seqlens.cpu()
        offset = self._offset(targets.shape[1])
        sample = torch.searchsorted(bounds[1:].long(),
                                    torch.arange(offset, offset + targets.shape[1]),
                                    right=True)  # [T]
        trained = torch.bincount(sample, weights=(targets[0] >= 0).double(),
                                 minlength=bounds.numel() - 1).to(probs.device, probs.dtype)  # [n]
        group, size = self.sp_group(), 1
        if group is not None:
            probs, counts, trained = sum_over(group, probs, counts, trained)
            size = torch.distributed.get_world_size(group)
            self.sp_sums += 1
        stats = SampleStats(probs=probs, picks=counts[:, :experts].to(probs.dtype),
                            tokens=counts[:, experts].to(probs.dtype), targets=trained)
        return self.aux.coef * aux_from_stats(self.aux, stats) / size


def sum_over(group, probs: torch.Tensor, counts: torch.Tensor, trained: torch.Tensor):
    """(probs, counts, trained) summed over `group`: the probabilities by an all-reduce that
    autograd sees (its backward sums the ranks' gradients), the rest as they are."""
    from torch.distributed.nn.functional import all_reduce
    counts, trained = counts.clone(), trained.clone()
    torch.distributed.all_reduce(counts, group=group)
    torch.distributed.all_reduce(trained, group=group)
    return all_reduce(probs, group=group), counts, trained
