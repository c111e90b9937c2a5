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

from typing import TYPE_CHECKING

import torch

from ds_omni.errors import ModelError
from ds_omni.model.attention import PackedAttention
from ds_omni.model.deepstack import Deepstack, split_levels
from ds_omni.model.omni import OmniModel, checked_rows, top_up_calls, with_dummy_pass
from ds_omni.parallel.evidence import SPCounts
from ds_omni.parallel.reshard import ReshardEmbeddings

if TYPE_CHECKING:
    from ds_omni.batch import MicroBatch
    from ds_omni.parallelize.encoder_pool import EncoderPool
    from ds_omni.parallelize.tp_encoders import TPEncoders


class EmbeddingRouter:
    """The plan's routing of one model's micro-batches (module docstring).

    `sp_group`: the LLM's Ulysses group (None: no static SP; encoders are never split, part 1);
    `blocks`: per-sequence SP, (first rank, size) -> the Ulysses group of every block this rank
    can be in, each given its own packed attention with the model's kernel; `pool`: the encoder
    pool (its group carries the exchange of pooled micro-batches); `encoder_dummies`: every
    micro-batch runs every encoder, on a zero-weight dummy where it has no item (ZeRO-2 and -3
    need it); False where one reduction a step only needs a gradient, which a zero one gives
    (`ds_omni.train.setup.encoder_dummies_needed`); `tp_encoders`: under parallel.tp, the
    split of a row's items over its TP ranks (`ds_omni.parallelize.tp_encoders`).
    """

    def __init__(self, *, kernel: str, sp_group=None, blocks: dict | None = None,
                 pool: EncoderPool | None = None, encoder_dummies: bool = True,
                 tp_encoders: TPEncoders | None = None):
        # what this rank's SP machinery did (Ulysses calls, rows resharded, pieces encoded), so
        # that a silent fallback to whole rows shows (`ds_omni.parallel.evidence`)
        self.sp_counts = SPCounts()
        self.sp_group = sp_group
        self.blocks: dict[tuple[int, int], tuple[object, PackedAttention]] = {
            block: (group, PackedAttention(kernel, group, self.sp_counts))
            for block, group in (blocks or {}).items()}
        self.encoder_pool = pool
        self.encoder_dummies = encoder_dummies
        self.tp_encoders = tp_encoders

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
        """The LLM attention of this micro-batch's row (None: the backbone's own)."""
        return self.route(batch)[1]

    def embed(self, model: OmniModel,
              batch: "MicroBatch") -> tuple[torch.Tensor, Deepstack | None]:
        """(token embeddings with encoder outputs in place of placeholder tokens, the deepstack
        levels or None): of this rank's shard [1, S, D] for a micro-batch with a reshard plan,
        else of the whole row [1, T, D] (`OmniModel.embed_local`; a row split over its TP ranks:
        `TPEncoders.embed`)."""
        if batch.route.tp_encode is not None:
            return self.tp_encoders.embed(model, batch, self.encoder_dummies)
        if batch.route.reshard is None:
            return model.embed_local(batch, dummies=self.encoder_dummies)
        return self.embed_shard(model, batch)

    def embed_shard(self, model: OmniModel,
                    batch: "MicroBatch") -> tuple[torch.Tensor, Deepstack | None]:
        """Under SP: this rank's shard [1, S, D] of the row's embeddings (and deepstack levels);
        a pooled micro-batch: the same (the whole row [1, T, D] at sp = 1), its rows exchanged
        over the pool group (long items still split in the row's group). Module docstring."""
        plan = batch.route.reshard
        sp_group = self.route(batch)[0]  # the row's group: it splits the long items
        exchange_group = self.encoder_pool.group if batch.route.pooled else sp_group
        hidden = model.backbone.embed_tokens(batch.input_ids)  # [1, S, D]
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
