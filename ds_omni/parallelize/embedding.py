"""The plan's routing of a micro-batch's embeddings: Ulysses SP, per-sequence SP, the encoder pool.

Under SP a rank holds a shard of the row's tokens; under the encoder pool it encodes items other
ranks' rows hold. Either way its micro-batch carries a reshard plan (`Route.reshard`): the rank
encodes the items the plan gives it (and its piece of each long item), then one all-to-all
(`ReshardEmbeddings`) brings every row of this shard's placeholders from the rank that encoded it;
deepstack rows carry their levels. `EmbeddingRouter` holds what that needs of the plan (the SP
group, the per-sequence blocks' groups, the pool, dummy passes, evidence counts) and is attached to
the `OmniModel` by `parallelize`. A micro-batch without a reshard plan embeds whole.
More: docs/parallelism.md, "Sequence parallelism".

Dims: S tokens of this rank's shard (T for a pooled row at sp = 1), N_r rows this rank encoded,
R rows its shard receives, D LLM hidden size, k deepstack levels.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ds_omni.errors import ModelError
from ds_omni.model.attention import PackedAttention
from ds_omni.model.deepstack import Deepstack, split_levels
from ds_omni.model.omni import OmniModel, checked_rows, top_up_calls, with_dummy_pass
from ds_omni.parallel import dist
from ds_omni.parallel.evidence import SPCounts
from ds_omni.parallel.reshard import ReshardEmbeddings

if TYPE_CHECKING:
    from ds_omni.batch import MicroBatch
    from ds_omni.parallelize.encoder_pool import EncoderPool
    from ds_omni.parallelize.tp_encoders import TPEncoders


class EmbeddingRouter:
    """The plan's routing of one model's micro-batches (module docstring): `sp_group` the LLM's
    Ulysses group; `blocks` each per-sequence block's Ulysses group (`block_rings`: the (Ulysses
    group, ring) of blocks past the heads); `pool`, `tp_encoders` the encoder pool and TP split;
    `encoder_dummies` whether every micro-batch runs every encoder (`encoder_dummies_needed`).
    Per-step features register with `on_step`; the step calls `prepare_step` only."""

    def __init__(self, *, kernel: str, sp_group=None, blocks: dict | None = None,
                 pool: EncoderPool | None = None, encoder_dummies: bool = True,
                 tp_encoders: TPEncoders | None = None, block_rings: dict | None = None):
        # what this rank's SP machinery did (Ulysses calls, rows resharded, pieces encoded), so
        # that a silent fallback to whole rows shows (`ds_omni.parallel.evidence`)
        self.sp_counts = SPCounts()
        self.sp_group = sp_group
        self.blocks: dict[tuple[int, int], tuple[object, PackedAttention]] = {}
        for block, group in (blocks or {}).items():  # past the heads: Ulysses inside, ring across
            ulysses, ring = (block_rings or {}).get(block, (group, None))
            self.blocks[block] = (group, PackedAttention(kernel, ulysses, self.sp_counts, ring=ring))
        self.encoder_pool = pool
        self.encoder_dummies = encoder_dummies
        self.tp_encoders = tp_encoders
        self.step_features: list = []  # what prepares a step's micro-batches (`on_step`)
        # the attention of rows whose cut reorders them (`Route.row_index`; `apply_plan`)
        self.row_attention: PackedAttention | None = None

    def on_step(self, feature) -> None:
        """Have `feature.prepare(micro_batches)` refine every step's micro-batches (in the order
        registered): a feature of the plan that places work over ranks per step."""
        self.step_features.append(feature)

    def prepare_step(self, micro_batches: list) -> Iterator["MicroBatch"]:
        """The step's micro-batches as the plan's features route them, each made as the step
        takes it: a feature's per-micro-batch collective runs right before that micro-batch's
        forward, in the same order on every rank."""
        for feature in self.step_features:
            micro_batches = feature.prepare(micro_batches)
        return iter(micro_batches)

    def route(self, batch: "MicroBatch") -> tuple[object, PackedAttention | None]:
        """(SP group, attention) of this micro-batch: its block's, else the model's own (None:
        the backbone's attention)."""
        block = batch.route.sp_block
        if block is None:
            return self.sp_group, None
        if block not in self.blocks:
            raise ModelError(f"micro-batch for SP block {block} (first rank, size) but this rank "
                             f"has groups for {sorted(self.blocks)}; the loader and the model "
                             "disagree on parallel.max_sequence_sp")
        return self.blocks[block]

    def aux_group(self, batch: "MicroBatch") -> tuple[object, SPCounts | None]:
        """(the group this micro-batch's row is split over, the SP counts), or (None, None) for
        a row this rank holds whole: what an MoE LLM's per-sample aux loss is summed over
        (`ds_omni.model.moe_aux.router_aux_sum`)."""
        group = self.route(batch)[0]
        return (group, self.sp_counts) if group is not None else (None, None)

    def attention(self, batch: "MicroBatch") -> PackedAttention | None:
        """The LLM attention of this micro-batch's row (None: the backbone's own); a row whose
        cut reorders it, bound to its row positions (`ds_omni.parallel.row_cut`)."""
        index = batch.route.row_index
        if index is None:
            return self.route(batch)[1]
        if batch.route.sp_block is not None:  # a block larger than the heads: its own ring
            attention = self.route(batch)[1]
            if attention.ring is None:
                raise ModelError(f"a micro-batch of SP block {batch.route.sp_block} cut for ring "
                                 "attention, but this rank's block has no ring; the loader and "
                                 "the model disagree on the block's Ulysses x ring split")
            return attention.for_row(index)
        if self.row_attention is None:
            raise ModelError("a micro-batch whose cut reorders its row (its route has a "
                             "row_index) but this model has no attention for such rows; the "
                             "loader and the model disagree on the plan's row cut "
                             "(ParallelPlan.row_cut)")
        return self.row_attention.for_row(index)

    def embed(self, model: OmniModel,
              batch: "MicroBatch") -> tuple[torch.Tensor, Deepstack | None]:
        """(token embeddings with encoder outputs in place of placeholder tokens, the deepstack
        levels or None): of this rank's shard [1, S, D] for a micro-batch with a reshard plan,
        else of the whole row [1, T, D] (`OmniModel.embed_local`; a row split over its TP ranks:
        `TPEncoders.embed`)."""
        if self.tp_encoders is not None:  # a block's row: no TP sum of its encoder gradients
            self.tp_encoders.apart = batch.route.tp_encode is not None
        if batch.route.tp_encode is not None:
            return self.tp_encoders.embed(model, batch, self.encoder_dummies)
        if batch.route.reshard is None:
            return model.embed_local(batch, dummies=self.encoder_dummies)
        return self.embed_shard(model, batch)

    def embed_shard(self, model: OmniModel, batch: "MicroBatch",
                    encoded: dict[str, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, Deepstack | None]:
        """Under SP: this rank's shard [1, S, D] of the row's embeddings (and deepstack levels);
        a pooled micro-batch: the same (the whole row [1, T, D] at sp = 1), its rows exchanged
        over the pool group (long items still split in the row's group). `encoded`: the rows
        of this rank's items, encoded elsewhere (the joint pipeline's stages), in the plan's
        item order. Module docstring."""
        plan = batch.route.reshard
        sp_group = self.route(batch)[0]  # the row's group: it splits the long items
        exchange_group = self.encoder_pool.group if batch.route.pooled else sp_group
        hidden = model.backbone.embed_tokens(batch.input_ids)  # [1, S, D]
        if encoded is None:
            hidden, rows = self._encode_share(model, batch, hidden, sp_group)
        else:
            rows = {name: r.to(hidden.dtype) for name, r in encoded.items() if r is not None}
        return self._reshard(model, plan, rows, hidden, exchange_group)

    def _encode_share(self, model: OmniModel, batch: "MicroBatch", hidden: torch.Tensor,
                      sp_group) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(hidden with any dummy passes added, encoder -> [N_r, D] the rows of the items this
        rank encodes and its pieces of the long ones)."""
        plan = batch.route.reshard
        rows: dict[str, torch.Tensor] = {}
        for name, encoder in model.encoders.items():
            inputs = batch.encoder_inputs.get(name)
            long = plan.split.get(name, [])
            hidden = top_up_calls(hidden, encoder, batch, name, runs=1 + len(long))
            if inputs is None and self.encoder_dummies:  # no whole item here: the dummy (above)
                hidden = with_dummy_pass(hidden, encoder)
            # whole items [n, D], then this rank's piece of each long item (a group collective)
            self.sp_counts.encoder_pieces += len(long)
            feats = ([encoder(inputs)] if inputs is not None else []) + [
                encoder.forward_piece(item, bounds, sp_group, plan.piece_rank)
                for item, (_, bounds) in zip(batch.route.split_inputs.get(name, []), long)]
            if not feats:
                continue
            feats = checked_rows(torch.cat(feats).to(hidden.dtype), encoder, hidden.shape[-1], name)
            if feats.shape[0] != plan.encode_rows[name]:
                raise ModelError(
                    f"encoder '{name}' produced {feats.shape[0]} embeddings for this rank's items but "
                    f"their placeholders number {plan.encode_rows[name]} (samples "
                    f"{batch.sample_ids[:4]}); each item needs exactly as many placeholders as it "
                    "yields embeddings")
            rows[name] = feats
        return hidden, rows

    def _reshard(self, model: OmniModel, plan, rows: dict[str, torch.Tensor],
                 hidden: torch.Tensor, exchange_group) -> tuple[torch.Tensor, Deepstack | None]:
        """`hidden` [1, S, D] with the rows of its placeholders, brought from the ranks that
        encoded them by one all-to-all (`ReshardEmbeddings`)."""
        if not plan.group_rows:  # no item in the whole row: no rank exchanges anything
            return hidden, None
        width = hidden.shape[-1]
        ordered = [rows[name] for name in plan.order if name in rows]  # the plan's row order
        # [N_r, (1 + k) D]; a rank that encoded nothing still sends rows of the group's width
        empty = hidden.new_zeros((0, (1 + model.deepstack) * width))
        local = torch.cat(ordered) if ordered else empty
        if _encoders_trainable(model) and not local.requires_grad:
            # every rank must reach the backward all-to-all, also one that encoded nothing
            local = local.detach().requires_grad_()
        recv = ReshardEmbeddings.apply(local, plan, exchange_group)  # [R, (1 + k) D]
        self.sp_counts.resharded(plan)
        where = torch.as_tensor(plan.recv_positions, dtype=torch.long, device=hidden.device)
        main, extra = split_levels(recv, width)  # [R, D], [R, k, D]
        hidden = hidden[0].index_copy(0, where, main).unsqueeze(0)
        return hidden, None if extra is None else Deepstack(where, extra, model.deepstack_layers)


def _encoders_trainable(model: OmniModel) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for p in model.encoders.parameters())


class EvenEncoderCalls:
    """ZeRO-3 under SP (static or per-sequence): each micro-batch routed to run each encoder as
    often as the most runs any rank makes in that round (`Route.encode_calls`). Long-short SP
    runs an encoder once more per long item on the ranks that share the item's row; ZeRO-3
    gathers the encoder's parameters at every run, on all ranks together."""

    def __init__(self, encoder_names: list[str], group):
        self.names, self.group = list(encoder_names), group

    def prepare(self, micro_batches: list) -> list:
        names = self.names
        runs = [1 + len(mb.route.reshard.split.get(name, [])) if mb.route.reshard is not None
                else 1 for mb in micro_batches for name in names]
        most = dist.all_reduce_max(runs, self.group) if runs else []
        return [mb.routed(encode_calls={name: int(most[i * len(names) + j])
                                        for j, name in enumerate(names)})
                for i, mb in enumerate(micro_batches)]


def encoder_dummies_needed(ds_config: dict, pipeline: bool) -> bool:
    """Whether every micro-batch must run every encoder, on a zero-weight dummy where it has no
    item (`EmbeddingRouter.encoder_dummies`), for DeepSpeed's collectives to line up over the
    ranks.

    ZeRO-3 gathers an encoder's parameters at each run, all ranks together; ZeRO-2 reduces at
    every backward, ZeRO-1 with `overlap_comm` (or a `grad_accum_dtype`) at the last, both in the
    order gradient hooks fire, so every rank's backward must reach the same parameters.
    Otherwise ZeRO-0/1 reduce once a step, in parameter order, each parameter that has a
    gradient (the pipeline engine always: ZeRO 0/1, after its last backward), so an encoder with
    no item only needs a gradient, and a zero one (`fill_missing_grads`) is exactly what its
    dummy would give. bf16 ZeRO-0 (DeepSpeed's BF16_Optimizer) keeps them: untested without.
    """
    if pipeline:
        return False
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or stage >= 2 or zero.get("overlap_comm", False):
        return True
    if stage == 1:
        return bool(ds_config.get("data_types", {}).get("grad_accum_dtype"))
    return bool(ds_config.get("bf16", {}).get("enabled", False))
