"""Encoder-LLM joint pipeline ("uniform" encoder placement): every stage encodes a share.

The ranks of one pipeline (same data-parallel coordinate, so the same micro-batches) split the
step's encoder items by modelled cost, encode their share before the schedule starts, and one
all-to-all over the pipeline brings every embedding row to stage 0; after stage 0's last backward
the rows' gradients go back the same way. Every stage holds the encoders, but each trainable
encoder parameter has one owner stage (`owner_stages`): its gradient is summed onto the owner,
only the owner's optimizer steps it, and the owner broadcasts it after the step
(`EncoderShards`), so each stage steps 1/P of the encoders. Stage 0 holds the received rows as
one leaf tensor, so the exchange back happens once a step.
More: docs/parallelism.md, "Pipeline parallelism".

Dims: N rows of the step's items, N_s those stage s encodes, D LLM hidden size; E elements of
one owner's parameters of one dtype (a flat bucket).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


# ------------------------------------------------------------------------------------- pure
@dataclass(frozen=True)
class Item:
    """One encoder item of the step: micro-batch, encoder, place among that micro-batch's items
    of that encoder, embedding rows it yields, modelled cost."""

    micro: int
    encoder: str
    index: int
    rows: int
    cost: float


def assign_items(costs: list[float], stages: int) -> list[int]:
    """Stage of each item: longest first, each to the stage with the least cost so far (ties:
    the lower stage). Deterministic, so every rank of a pipeline computes the same."""
    load = [0.0] * stages
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        stage = min(range(stages), key=lambda s: (load[s], s))
        out[i] = stage
        load[stage] += costs[i]
    return out


def owner_stages(numels: list[int], stages: int) -> list[int]:
    """The owner stage of each encoder parameter (`numels`: their sizes, in parameter order):
    largest first, each to the stage owning the fewest elements so far (ties: the lower stage,
    then parameter order), so the stages' optimizer work differs by at most the largest
    parameter. Deterministic: every rank of a pipeline, and a resumed run, computes the same."""
    return assign_items([float(n) for n in numels], stages)


@dataclass(frozen=True)
class JointPlan:
    """Who encodes which item, and where each item's rows sit in the rows stage 0 receives
    (stage-major: stage 0's rows, then stage 1's, ...; within a stage in item order)."""

    items: list[Item]
    stage_of: list[int]
    stages: int

    @property
    def rows_per_stage(self) -> list[int]:
        out = [0] * self.stages
        for item, stage in zip(self.items, self.stage_of):
            out[stage] += item.rows
        return out

    def items_of(self, stage: int) -> list[Item]:
        return [it for it, s in zip(self.items, self.stage_of) if s == stage]

    def row_index(self) -> dict[tuple[int, str], list[int]]:
        """(micro-batch, encoder) -> indices of its rows in the received rows, in item order
        (the order of its placeholders)."""
        start = [0] * self.stages
        for s in range(1, self.stages):
            start[s] = start[s - 1] + self.rows_per_stage[s - 1]
        at: dict[int, int] = {}  # item position -> its first row
        for s in range(self.stages):
            offset = start[s]
            for i, (item, stage) in enumerate(zip(self.items, self.stage_of)):
                if stage == s:
                    at[i] = offset
                    offset += item.rows
        out: dict[tuple[int, str], list[int]] = {}
        for i, item in enumerate(self.items):
            out.setdefault((item.micro, item.encoder), []).extend(range(at[i], at[i] + item.rows))
        return out


def plan_joint(micro_items: list[dict[str, list]], item_cost, stages: int) -> JointPlan:
    """The plan of a step whose micro-batches hold `micro_items` (encoder -> EncodedItems each);
    `item_cost(encoder, item)` is the cost model's."""
    items = [Item(m, enc, k, it.num_embeddings, float(item_cost(enc, it)))
             for m, by_encoder in enumerate(micro_items) for enc, its in by_encoder.items()
             for k, it in enumerate(its)]
    return JointPlan(items, assign_items([it.cost for it in items], stages), stages)


# ---------------------------------------------------------------------------------- runtime
class EncodeShare:
    """The items of a micro-batch this rank's pipeline encodes ("uniform", "bubbles"): all, or
    on an SP shard those its reshard plan gives it (`RankReshard.encode`, text order; the other
    SP ranks' pipelines encode the rest, and the shard's all-to-all brings their rows), or under
    the encoder pool those the pool gave it (`Route.pool_items`, any rank's)."""

    def __init__(self, mb):
        plan = mb.route.reshard
        if mb.route.pooled:
            self.items = mb.route.pool_items
        else:
            self.items = mb.items if plan is None else {
                e: [mb.items[e][k] for k in idx] for e, idx in plan.encode.items()}


class JointEncoding:
    """One step of uniform encoder placement on one rank (module docstring)."""

    def __init__(self, plan: JointPlan, stage: int, group, hidden: int, device, dtype):
        self.plan, self.stage, self.group = plan, stage, group
        self.hidden, self.device, self.dtype = hidden, device, dtype
        self.local: torch.Tensor | None = None  # [N_s, D] this rank's rows, with their graph
        self.dummies: list[torch.Tensor] = []  # zero-weight passes of encoders with no item here
        self.rows: torch.Tensor | None = None  # stage 0: [N, D] every row, a leaf
        self.index = {k: torch.tensor(v, dtype=torch.long, device=device)
                      for k, v in plan.row_index().items()} if stage == 0 else {}

    def encode(self, encoders, micro_batches, processors, dummies: bool = True) -> None:
        """Encode this stage's share and send every row to stage 0; `dummies`: an encoder with
        no item here runs once on its dummy at zero weight (else its gradient is left to be
        zero-filled: `EmbeddingRouter.encoder_dummies`)."""
        mine = self.plan.items_of(self.stage)
        pieces = []
        for name, encoder in encoders.items():
            items = [micro_batches[it.micro].items[name][it.index] for it in mine
                     if it.encoder == name]
            if not items and not dummies:
                continue
            if not items:  # every encoder runs on every rank: its parameters all get a gradient
                dummy = encoder(encoder.dummy_inputs(self.device, self.dtype))
                self.dummies.append(0.0 * dummy.sum())
                continue
            inputs = processors[name].collate(items)
            pieces.append((name, encoder({k: v.to(self.device) for k, v in inputs.items()})))
        # rows in item order: an item's rows come from its encoder's output, in order
        self.local = self._in_item_order(mine, dict(pieces))
        self.rows = self._exchange(self.local.detach(), to_stage0=True)
        if self.rows is not None:
            self.rows.requires_grad_()

    def _in_item_order(self, mine: list[Item], outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        taken = {name: 0 for name in outputs}
        parts = []
        for it in mine:
            start = taken[it.encoder]
            parts.append(outputs[it.encoder][start:start + it.rows])
            taken[it.encoder] = start + it.rows
        for name, out in outputs.items():
            if taken[name] != out.shape[0]:
                raise RuntimeError(f"encoder '{name}' produced {out.shape[0]} embeddings for "
                                   f"items whose placeholders number {taken[name]}")
        if not parts:
            return torch.zeros((0, self.hidden), device=self.device, dtype=self.dtype)
        return torch.cat(parts).to(self.dtype)  # [N_s, D]

    def rows_for(self, micro: int, encoder: str) -> torch.Tensor | None:
        """Stage 0: [n, D] the rows of `micro`'s placeholders of `encoder`, or None."""
        index = self.index.get((micro, encoder))
        return None if index is None else self.rows.index_select(0, index)

    def backward(self) -> None:
        """After stage 0's last backward: rows' gradients back to their encoders, backward
        through them (every rank of the pipeline calls this)."""
        grad_rows = None
        if self.stage == 0:
            grad_rows = self.rows.grad
            if grad_rows is None:  # a step without items: no row was used
                grad_rows = torch.zeros_like(self.rows)
        grad_local = self._exchange(grad_rows, to_stage0=False)
        tensors = [self.local] + self.dummies
        grads = [grad_local] + [torch.ones_like(d) for d in self.dummies]
        keep = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
        if keep:
            torch.autograd.backward([t for t, _ in keep], [g for _, g in keep])

    def _exchange(self, send: torch.Tensor | None, to_stage0: bool) -> torch.Tensor | None:
        """All-to-all over the pipeline's ranks: every stage's rows to stage 0 (`to_stage0`), or
        stage 0's row gradients back to the stages that encoded them."""
        counts = self.plan.rows_per_stage
        d = self.hidden
        if to_stage0:
            in_splits = [counts[self.stage] if s == 0 else 0 for s in range(self.plan.stages)]
            out_splits = counts if self.stage == 0 else [0] * self.plan.stages
        else:
            in_splits = counts if self.stage == 0 else [0] * self.plan.stages
            out_splits = [counts[self.stage] if s == 0 else 0 for s in range(self.plan.stages)]
            if send is None:
                send = torch.zeros((0, d), device=self.device, dtype=self.dtype)
        recv = torch.empty((sum(out_splits), d), device=self.device, dtype=self.dtype)
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=self.group)
        if to_stage0 and self.stage != 0:
            return None
        return recv


class EncoderShards:
    """The owner of each trainable encoder parameter on one rank of a pipeline (module
    docstring), and the two collectives around the optimizer step, each one flat bucket per
    owner stage and dtype."""

    def __init__(self, params: list[torch.nn.Parameter], stage: int, stages: int, group):
        self.stage, self.group = stage, group
        owners = owner_stages([p.numel() for p in params], stages)
        self.by_owner = [[p for p, o in zip(params, owners) if o == s] for s in range(stages)]
        self.owned = self.by_owner[stage]
        self.replicas = [p for p, o in zip(params, owners) if o != stage]
        # owner broadcasts this rank took part in, since start: a run that silently skipped
        # them (replicas left stale) shows it here (tests read it)
        self.broadcasts = 0

    def reduce_grads(self) -> None:
        """Sum each parameter's gradient over the pipeline's ranks onto its owner; the replicas'
        gradients (other owners') are dropped here. Every parameter needs a gradient
        (`fill_missing_grads`)."""
        for owner, bucket in self._buckets():
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # [E]
            dist.reduce(flat, dst=dist.get_global_rank(self.group, owner), group=self.group)
            if owner == self.stage:
                _unflatten_into(flat, [p.grad for p in bucket])
        for p in self.replicas:
            p.grad = None

    def broadcast_params(self) -> None:
        """After the optimizer step: every owner's updated parameters to the other stages."""
        for owner, bucket in self._buckets():
            if owner == self.stage:
                flat = torch.cat([p.detach().reshape(-1) for p in bucket])  # [E]
            else:
                flat = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                                   device=bucket[0].device)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, owner), group=self.group)
            self.broadcasts += 1
            if owner != self.stage:
                _unflatten_into(flat, [p.data for p in bucket])

    @contextlib.contextmanager
    def replicas_frozen(self):
        """The replicas out of `requires_grad` for a while: DeepSpeed's ZeRO-0 reduction gives
        every trainable parameter without a gradient a zero one and all-reduces it over the
        data-parallel ranks, work their owners' ranks do already."""
        frozen = [p for p in self.replicas if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in frozen:
                p.requires_grad_(True)

    def _buckets(self) -> list[tuple[int, list[torch.nn.Parameter]]]:
        """(owner stage, its parameters of one dtype), the same order on every rank."""
        out = []
        for owner, params in enumerate(self.by_owner):
            for dtype in sorted({p.dtype for p in params}, key=str):
                out.append((owner, [p for p in params if p.dtype == dtype]))
        return out


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
