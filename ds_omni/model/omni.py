"""OmniModel: one representation of any multimodal LLM.

A model is a set of modality encoders (an encoder plus its projector, producing LLM-width
embeddings that replace placeholder tokens) and an LLM backbone (token embedding, decoder layers,
final norm, head). The parallel machinery works on this representation only; the family adapters
in `ds_omni.model.families` map HF models onto it. The modules are the HF model's own, registered
under family-neutral names, so parameters are shared and export back to HF is exact. Deepstack
encoders (Qwen3-VL, Granite 4 Vision) yield rows [N, (1 + k) D], the main embedding then k levels,
so every path that moves rows carries the levels; `Deepstack` holds them for the backbone.
More: docs/models.md, "What a model is".

Dims: T packed tokens of a micro-batch, N embeddings of one encoder in a micro-batch,
D LLM hidden size, V vocabulary, k deepstack levels.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_omni.batch import MicroBatch
from ds_omni.errors import ModelError
from ds_omni.model.attention import PackedAttention
from ds_omni.model.deepstack import Deepstack, join_deepstack, split_levels
from ds_omni.model.layer_types import for_layer, mark_nope, rotary_tables
from ds_omni.model.moe_aux import recorded_router_logits, router_aux_of, router_aux_sum
from ds_omni.model.outside import LogitRule
from ds_omni.model.per_sample import ROW_BOUNDS, run_per_sample, runs_per_sample
from ds_omni.model.recompute import recompute_in_backward
from ds_omni.parallel.long_short import EncoderShard

if TYPE_CHECKING:
    from ds_omni.model.family import Family

DEEPSTACK_ALONE = (
    "this model's vision features are also added between the LLM's decoder layers (deepstack: "
    "Qwen3-VL, Granite 4 Vision), which `OmniModel.embed` does not return; call "
    "`embed_deepstack`, which returns them beside the embeddings")
UNROUTED = (
    "this micro-batch is a sequence shard or a pooled row (its `route` has a `reshard` or an `sp_block`), "
    "which only the plan's routing can embed; apply the plan to the model first "
    "(`ds_omni.parallelize.parallelize`)")


class ModalityEncoder(nn.Module):
    """An encoder and its projector for one modality: inputs of a micro-batch -> [N, D] embeddings.

    Subclasses (one per family) implement `encode` and `dummy_inputs`; the embeddings come out in the
    order the items appear in the packed text, and replace that encoder's placeholder tokens.
    """

    modality: str = "image"
    deepstack_layers: tuple[int, ...] = ()
    """Deepstack towers: the LLM layer each of the k extra levels ([N, (1 + k) D]) is added before
    (0: onto the embeddings; n layers: before the final norm; past n: never); else empty."""

    @property
    def deepstack(self) -> int:
        """k, the deepstack levels its rows carry."""
        return len(self.deepstack_layers)

    def __init__(self, *, tower: nn.Module, projector: nn.Module, placeholder_id: int,
                 more_placeholder_ids: tuple[int, ...] = ()):
        super().__init__()
        self.tower = tower
        self.projector = projector
        self.placeholder_id = placeholder_id
        # other tokens its embeddings replace (Qwen2-VL: videos, through the same tower)
        self.placeholder_ids = (placeholder_id, *more_placeholder_ids)

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def dummy_inputs(self, device, dtype) -> dict[str, torch.Tensor]:
        """The smallest valid input, run when a rank has nothing to encode (see `forward`)."""
        raise NotImplementedError

    def forward(self, inputs: dict[str, torch.Tensor], piece: tuple | None = None) -> torch.Tensor:
        """Embeddings of the items in `inputs`; with `piece` (rows, group, rank), this rank's
        rows of the one long item in `inputs` (`forward_piece`)."""
        if piece is None:
            return self.encode(self._cast(inputs))
        rows, group, rank = piece
        inputs = self._cast(inputs)
        shard = EncoderShard(group, rank, len(rows) - 1, tuple(self.piece_tokens(inputs, rows)))
        return self.encode_piece(inputs, shard)

    def _cast(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dtype = next(self.tower.parameters()).dtype  # float inputs follow the tower (fp32 / bf16)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}

    # Long items (`ds_omni.parallel.long_short`): families that can encode a piece of one item
    # override the three methods below.
    def attention_heads(self) -> int | None:
        """The tower's attention heads (Ulysses splits them over the group); None: this encoder
        cannot encode a piece of an item, so its long items run whole on one rank."""
        return None

    def piece_tokens(self, inputs: dict[str, torch.Tensor], rows: tuple[int, ...]) -> tuple[int, ...]:
        """Bounds [P + 1] of the pieces of the one item in `inputs`, in the tower's sequence, that
        yield its embedding rows cut at `rows` [P + 1]; they cover the whole sequence."""
        raise NotImplementedError

    def encode_piece(self, inputs: dict[str, torch.Tensor], shard: "EncoderShard") -> torch.Tensor:
        """This rank's embedding rows [rows[r + 1] - rows[r], D] of the one item in `inputs`."""
        raise NotImplementedError

    def forward_piece(self, inputs: dict[str, torch.Tensor], rows: tuple[int, ...], group,
                      rank: int) -> torch.Tensor:
        """Rank `rank`'s rows of a long item encoded by the whole `group` (collective).

        Through the module's call, as a whole-item run: ZeRO-3 records the modules each forward
        enters and needs the same record on every rank, also on ranks that top up with dummy
        runs while this one encodes a piece."""
        return self(inputs, piece=(rows, group, rank))


def with_dummy_pass(hidden: torch.Tensor, encoder: ModalityEncoder) -> torch.Tensor:
    """`hidden` plus zero times the encoder's output on its dummy input: the encoder runs (and
    ZeRO-3 gathers its parameters) on a rank with nothing to encode, without changing a number."""
    return hidden + 0.0 * encoder(encoder.dummy_inputs(hidden.device, hidden.dtype)).sum()


def top_up_calls(hidden: torch.Tensor, encoder: ModalityEncoder, batch: "MicroBatch", name: str,
                 runs: int) -> torch.Tensor:
    """Under ZeRO-3 every rank must run `encoder` as often as any other on this micro-batch
    (`Route.encode_calls`): the ranks of a group with long items run it once more per item,
    so a rank that will run it only `runs` times adds zero-weight dummy runs."""
    want = (batch.route.encode_calls or {}).get(name, runs)
    for _ in range(want - runs):
        hidden = with_dummy_pass(hidden, encoder)
    return hidden


def checked_rows(feats: torch.Tensor, encoder: ModalityEncoder, width: int,
                 name: str) -> torch.Tensor:
    """feats, checked to be [N, (1 + k) D] for the encoder's k deepstack levels."""
    want = (1 + encoder.deepstack) * width
    if feats.shape[-1] != want:
        raise ModelError(f"encoder '{name}' yields rows of width {feats.shape[-1]}, but the LLM's "
                         f"width {width} with the encoder's {encoder.deepstack} deepstack levels "
                         f"makes {want}; its family adapter must set the encoder's "
                         "`deepstack_layers` to one LLM layer per feature level its tower returns")
    return feats


def _insert(hidden: torch.Tensor, slots: torch.Tensor, feats: torch.Tensor, name: str,
            batch: "MicroBatch") -> torch.Tensor:
    """hidden [1, T, D] with the rows of feats [N, D] at positions slots [N]."""
    if feats.shape[0] != slots.shape[0]:
        raise ModelError(
            f"encoder '{name}' produced {feats.shape[0]} embeddings but the text has "
            f"{slots.shape[0]} '{name}' placeholder tokens (samples {batch.sample_ids[:4]}); each "
            f"item needs exactly as many placeholders as it yields embeddings")
    return hidden[0].index_copy(0, slots, feats.to(hidden.dtype)).unsqueeze(0)  # [T, D] -> [1, T, D]


def _part(encoder: ModalityEncoder) -> str:
    """The part name of an encoder (as `model.freeze` and `activation_checkpointing` say it)."""
    return "vision" if encoder.modality == "image" else "audio"


class Backbone(nn.Module):
    """The LLM: embedding, decoder layers, final norm, head. Runs packed rows of samples.

    `embed_scale` and `logit_rule` are what the HF forwards do outside these modules
    (`ds_omni.model.outside`: Granite's multipliers, logit soft-capping, suppressed tokens);
    `scale_embeddings` and `head` apply them wherever the backbone's numbers are made.
    """

    def __init__(self, *, embed_tokens: nn.Module, layers: nn.ModuleList, norm: nn.Module,
                 lm_head: nn.Module, rotary_emb: nn.Module, embed_scale: float = 1.0,
                 logit_rule: LogitRule = LogitRule(), router_aux=None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.rotary_emb = rotary_emb
        self.embed_scale = embed_scale
        self.logit_rule = logit_rule
        self.attention = PackedAttention()  # the model's kernel (`ds_omni.parallelize` adds SP)
        self.checkpoint_layers = False  # recompute decoder layers in backward (ModelConfig)
        self.router_aux = router_aux  # an MoE LLM's aux loss as HF adds it (`model.moe_aux`)
        # what the layers take beyond the common arguments, read once: the row's bounds on the
        # host (layers run per sample) and Gemma 4's `shared_kv_states`
        self.any_per_sample = any(map(runs_per_sample, layers))
        self.shares_kv = bool(len(layers)) and "shared_kv_states" in inspect.signature(
            type(layers[0]).forward).parameters

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int,
                attention: PackedAttention | None = None,
                deepstack: Deepstack | None = None,
                blocks: torch.Tensor | None = None,
                token_inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """hidden [1, S, D], position_ids [1, S] or [3, 1, S] (M-RoPE) -> normed hidden [1, S, D].

        S = T, the whole row, or under sequence parallelism this rank's shard of it; `cu_seqlens`
        always delimits the samples of the whole (padded) row. `attention` overrides the model's
        for this row (per-sequence SP: the row's block group); `blocks` [m, 2]: the row's spans
        attended both ways (`MicroBatch.blocks`). `deepstack`: level i is added before layer
        `deepstack.layers[i]` (the number of layers: before the final norm; past it: unused, as in
        HF). `token_inputs`: per-token inputs [1, S] every layer also takes (`Family.layer_inputs`).
        """
        hidden = self.scale_embeddings(hidden)
        kwargs = self.layer_kwargs(hidden, position_ids, cu_seqlens, max_seqlen, attention, blocks)
        kwargs.update(token_inputs or {})
        for i, layer in enumerate(self.layers):
            if deepstack is not None:
                hidden = deepstack.add_before(hidden, i)
            hidden = self.run_layer(layer, hidden, kwargs)
        if deepstack is not None:
            hidden = deepstack.add_before(hidden, len(self.layers))
        return self.norm(hidden)

    def scale_embeddings(self, hidden: torch.Tensor) -> torch.Tensor:
        """The merged embeddings (image rows included) as the LLM's forward scales them."""
        return hidden * self.embed_scale if self.embed_scale != 1 else hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits [..., V], with what HF's forward applies after the head."""
        return self.logit_rule.head(self.lm_head, hidden)

    def layer_kwargs(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_seqlen: int,
                     attention: PackedAttention | None = None,
                     blocks: torch.Tensor | None = None) -> dict:
        """What every decoder layer of a row is called with (a pipeline stage makes it again
        from the position ids and `cu_seqlens` it receives)."""
        position_embeddings = rotary_tables(self.rotary_emb, hidden, position_ids)
        text_positions = position_ids if position_ids.ndim == 2 else position_ids[0]
        attention = attention or self.attention
        # the samples' bounds on the host, for layers run per sample (read once per row, not once
        # per such layer from a device copy)
        bounds = {ROW_BOUNDS: cu_seqlens.tolist()} if self.any_per_sample else {}
        cu_seqlens = attention.boundaries(cu_seqlens, hidden.device)
        kwargs = dict(attention_mask=None, position_ids=text_positions,
                      position_embeddings=position_embeddings, cu_seqlens=cu_seqlens,
                      max_seqlen=max_seqlen, ds_omni_attention=attention, ds_omni_blocks=blocks,
                      **bounds)
        if self.shares_kv:
            # Gemma 4's layers store their keys and values there (for later layers that reuse
            # them; `config_problem` refuses models that have such layers): a fresh one a row
            kwargs["shared_kv_states"] = {}
        return kwargs

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """One decoder layer [1, S, D] -> [1, S, D], recomputed in backward if so configured; a
        layer whose token mixing is not attention runs once per sample
        (`ds_omni.model.per_sample`)."""
        kwargs = for_layer(layer, kwargs)
        if runs_per_sample(layer):
            run = lambda h, **kw: run_per_sample(layer, h, kw)  # noqa: E731
        else:
            run, kwargs = layer, {k: v for k, v in kwargs.items() if k != ROW_BOUNDS}
        if self.checkpoint_layers and torch.is_grad_enabled():
            # non-reentrant: works with ZeRO-3's parameter hooks and re-runs the Ulysses
            # all-to-alls in the same order on every rank
            out = checkpoint(run, hidden, use_reentrant=False, **kwargs)
        else:
            out = run(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # (hidden,): Chameleon's older layers


NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "embedding_norm")
"""Where HF's decoder models keep their final norm (Persimmon, Fuyu's LLM: `final_layernorm`;
LFM: `embedding_norm`)."""


def final_norm(decoder_model: nn.Module) -> nn.Module | None:
    """The final norm of an HF decoder model, under any name of `NORM_NAMES`, or None."""
    for name in NORM_NAMES:
        if isinstance(getattr(decoder_model, name, None), nn.Module):
            return getattr(decoder_model, name)
    return None


def backbone_of(decoder_model: nn.Module, lm_head: nn.Module,
                owner: nn.Module | None = None) -> Backbone:
    """The backbone of an HF decoder-only model (LlamaModel, Qwen2Model, ...) and its head.

    `owner`: the HF model whose forward applies the head (its logit rule is followed,
    `ds_omni.model.outside`); the embedding scale is the decoder model's own forward's.
    Its attention switches to the packed kernel (`ds_omni.model.attention`); the switch is on this
    config alone, so encoders keep theirs.
    """
    from ds_omni.model import outside
    from ds_omni.model.attention import PACKED_ATTENTION, register
    from ds_omni.model.per_sample import mark
    register()
    config = decoder_model.config
    config._attn_implementation = PACKED_ATTENTION
    mark(decoder_model.layers, config)
    mark_nope(decoder_model)
    norm = final_norm(decoder_model)
    if norm is None:
        raise ModelError(f"{type(decoder_model).__name__} has none of {list(NORM_NAMES)}: the "
                         "backbone needs the norm its model applies after the last layer")
    rule = LogitRule() if owner is None else outside.logit_rule(
        type(owner), owner.config.get_text_config(), outside.suppressed_ids(owner))
    return Backbone(embed_tokens=decoder_model.embed_tokens, layers=decoder_model.layers,
                    norm=norm, lm_head=lm_head, rotary_emb=decoder_model.rotary_emb,
                    embed_scale=outside.embed_scale(type(decoder_model), config),
                    logit_rule=rule, router_aux=router_aux_of(config))


def summed_token_loss(head, hidden: torch.Tensor, targets: torch.Tensor,
                      keep: torch.Tensor) -> torch.Tensor:
    """Sum of the token losses of a row: hidden [1, T, D], targets [1, T], keep [n] (the positions
    that carry a target), `head` the backbone's (`Backbone.head`: the LM head and its logit rule).
    Only those are projected: the [T, V] logits are the largest activation."""
    logits = head(hidden[0].index_select(0, keep))  # [n, V]
    wanted = targets[0].index_select(0, keep)  # [n]: next token at each kept position
    return F.cross_entropy(logits.float(), wanted, reduction="sum")


class LossOutput(NamedTuple):
    """Sum (not mean) of token losses of one micro-batch, and the number of target tokens.

    A NamedTuple, so ZeRO-3's hooks see the loss tensor inside it.
    """

    loss_sum: torch.Tensor
    num_targets: int


class OmniModel(nn.Module):
    """Encoders + backbone. `forward(batch)` returns the micro-batch's summed token loss."""

    def __init__(self, *, encoders: dict[str, ModalityEncoder], backbone: Backbone,
                 family: "Family", hf_model: nn.Module):
        super().__init__()
        self.encoders = nn.ModuleDict(encoders)
        self.backbone = backbone
        self.family = family
        # The HF model object shares every parameter with this module; kept out of the module tree
        # so parameters are registered once, under the names above.
        object.__setattr__(self, "hf_model", hf_model)
        maps = {encoder.deepstack_layers for encoder in encoders.values()}
        if len(maps) > 1:
            raise ModelError(f"encoders with different deepstack layer maps {sorted(maps)}; the "
                             "rows they send to the LLM must have one width and their levels go "
                             "before the same layers")
        self.deepstack_layers = maps.pop() if maps else ()  # every encoder's layer map
        # the plan's routing of sharded and pooled micro-batches and of whether encoders run
        # dummies (`ds_omni.parallelize.embedding.EmbeddingRouter`), attached by
        # `ds_omni.parallelize`; None: every micro-batch embeds whole, here
        self.router = None

    @property
    def deepstack(self) -> int:
        """k, the deepstack levels of every encoder's rows."""
        return len(self.deepstack_layers)

    def set_checkpointing(self, parts: set[str], named: set[str] = frozenset()) -> None:
        """Recompute in backward the layers of `parts` (of llm, vision, audio) this model has;
        a part in `named` (written out by the user) that the model lacks is an error."""
        have = {"llm"} | {_part(e) for e in self.encoders.values()}
        missing = sorted(named - have)
        if missing:
            raise ModelError(f"model.activation_checkpointing names {missing} but this model has "
                             f"no such part; it has {sorted(have)} (\"encoders\" means all of its "
                             "encoders)")
        self.backbone.checkpoint_layers = "llm" in parts
        for name, encoder in self.encoders.items():
            if _part(encoder) in parts and not recompute_in_backward(encoder.tower):
                raise ModelError(
                    f"model.activation_checkpointing: the {name} encoder "
                    f"({type(encoder.tower).__name__}) has no layers marked as HF "
                    "GradientCheckpointingLayer, so ds_omni cannot recompute them; leave "
                    f"'{_part(encoder)}' out of the list")

    # ---------------------------------------------------------------------------- forward
    def embed(self, batch: "MicroBatch") -> torch.Tensor:
        """Token embeddings with encoder outputs in place of placeholder tokens -> [1, T, D]
        (for a model without deepstack levels: those need `embed_deepstack`)."""
        if self.deepstack:
            raise ModelError(DEEPSTACK_ALONE)
        return self.embed_deepstack(batch)[0]

    def embed_deepstack(self, batch: "MicroBatch") -> tuple[torch.Tensor, Deepstack | None]:
        """(token embeddings [1, T, D] with encoder outputs in place of placeholder tokens, the
        deepstack levels at those placeholders or None). Under the plan's routing (`router`), of
        this rank's shard [1, S, D] where the micro-batch is sharded or pooled."""
        if self.router is not None:
            return self.router.embed(self, batch)
        if batch.route.sharded:
            raise ModelError(UNROUTED)
        return self.embed_local(batch)

    def embed_local(self, batch: "MicroBatch",
                    dummies: bool = True) -> tuple[torch.Tensor, Deepstack | None]:
        """`embed_deepstack` of a whole row [1, T, D], on this rank alone; `dummies`: an encoder
        with no item runs on its dummy input (below)."""
        hidden = self.backbone.embed_tokens(batch.input_ids)  # [1, T, D]
        levels: list[Deepstack] = []
        for name, encoder in self.encoders.items():
            inputs = batch.encoder_inputs.get(name)
            slots = batch.positions_of(encoder.placeholder_ids)  # [n] (found on the host: no sync)
            n_slots = slots.shape[0]
            hidden = top_up_calls(hidden, encoder, batch, name, runs=1)
            if inputs is None:
                if n_slots:
                    raise ModelError(f"{n_slots} '{name}' placeholder tokens but no {name} inputs "
                                     f"in the batch (samples {batch.sample_ids[:4]}...)")
                # Every rank runs every encoder every micro-batch, so ZeRO-3 gathers the same
                # parameters on all ranks (no hang when some ranks have no images); the result
                # counts zero. Off (`dummies`) where a zero gradient does the same.
                if dummies:
                    hidden = with_dummy_pass(hidden, encoder)
                continue
            feats = checked_rows(encoder(inputs), encoder, hidden.shape[-1], name)
            main, extra = split_levels(feats, hidden.shape[-1])  # [N, D], [N, k, D]
            hidden = _insert(hidden, slots, main, name, batch)
            if extra is not None:
                levels.append(Deepstack(slots, extra, encoder.deepstack_layers))
        return hidden, join_deepstack(levels)

    def embed_rows(self, batch: "MicroBatch", rows: dict[str, torch.Tensor]
                   ) -> tuple[torch.Tensor, Deepstack | None]:
        """`embed_deepstack` with `rows` (encoder name -> [N, (1 + k) D], encoded elsewhere: the
        joint pipeline) in place of the placeholder tokens -> ([1, T, D], levels or None)."""
        hidden = self.backbone.embed_tokens(batch.input_ids)  # [1, T, D]
        levels: list[Deepstack] = []
        for name, encoder in self.encoders.items():
            slots = batch.positions_of(encoder.placeholder_ids)
            if name in rows or slots.shape[0]:
                width = hidden.shape[-1]
                main, extra = split_levels(rows.get(name, hidden.new_zeros((0, width))),
                                           width)  # [N, D], [N, k, D]
                hidden = _insert(hidden, slots, main, name, batch)
                if extra is not None:
                    levels.append(Deepstack(slots, extra, encoder.deepstack_layers))
        return hidden, join_deepstack(levels)

    def hidden_states(self, batch: "MicroBatch") -> torch.Tensor:
        """Final normed hidden states [1, T, D]."""
        hidden, deepstack = self.embed_deepstack(batch)
        attention = self.router.attention(batch) if self.router is not None else None
        return self.backbone(hidden, batch.position_ids, batch.cu_seqlens, batch.max_seqlen,
                             attention=attention, deepstack=deepstack,
                             blocks=batch.blocks,
                             token_inputs=self.family.layer_inputs(batch.input_ids))

    def logits(self, batch: "MicroBatch") -> torch.Tensor:
        """Logits for every position [1, T, V] (for parity checks and evaluation)."""
        return self.backbone.head(self.hidden_states(batch))

    def forward(self, batch: "MicroBatch") -> LossOutput:
        with recorded_router_logits(self.backbone) as router_logits:  # an MoE LLM's, else none
            hidden = self.hidden_states(batch)
        # Project only positions that carry a target: the [T, V] logits are the largest activation.
        # Their indices come from the host, so nothing here waits for the device.
        keep = batch.target_positions()  # [n]
        loss_sum = summed_token_loss(self.backbone.head, hidden, batch.targets, keep)
        aux = router_aux_sum(self.backbone.router_aux, router_logits, batch, self.router)
        return LossOutput(loss_sum=loss_sum + aux, num_targets=keep.shape[0])

    # ---------------------------------------------------------------------------- structure
    def parts(self) -> dict[str, list[nn.Module]]:
        """Modules by freezable part name: vision, audio, projector, llm."""
        parts: dict[str, list[nn.Module]] = {"vision": [], "audio": [], "projector": [],
                                              "llm": [self.backbone]}
        for encoder in self.encoders.values():
            parts[_part(encoder)].append(encoder.tower)
            parts["projector"].append(encoder.projector)
        return parts

    def freeze(self, names: list[str]) -> None:
        """Turn off gradients of the named parts (DeepSpeed then keeps no optimizer state for them)."""
        parts = self.parts()
        for name in names:
            if not parts[name]:
                raise ModelError(f"model.freeze names '{name}' but this model has no {name} part; "
                                 f"it has {[k for k, v in parts.items() if v]}")
            for module in parts[name]:
                module.requires_grad_(False)

    def hf_key_map(self) -> dict[str, str]:
        """HF state-dict key -> OmniModel state-dict key, found by tensor identity."""
        ours = {id(t): k for k, t in self.state_dict(keep_vars=True).items()}
        mapping = {}
        for hf_key, tensor in self.hf_model.state_dict(keep_vars=True).items():
            if id(tensor) not in ours:
                raise ModelError(f"HF tensor {hf_key!r} is not part of the OmniModel; the "
                                 f"{self.family.name} adapter misses a module")
            mapping[hf_key] = ours[id(tensor)]
        return mapping
