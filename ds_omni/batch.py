"""The contract data/ and model/ share: how one item becomes encoder inputs and placeholder
tokens, and the packed micro-batch the model consumes.

A family's item processors (`ds_omni.model.families`) make `EncodedItem`s; sample processing and
packing (`ds_omni.data`) put their placeholder tokens in the text and collate them into a
`MicroBatch`; `OmniModel.forward` consumes it. Both sides import this module and neither imports
the other, so it holds only torch types and plain data (no model, no plan).

Dims: T packed tokens (sum of sample lengths; padded to a multiple of sp under SP), n samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    import numpy as np

IGNORE_INDEX = -100
"""The target of a position that predicts nothing (the loss skips it, as torch's cross entropy)."""


@dataclass
class EncodedItem:
    """One image or audio clip, preprocessed for its encoder."""

    inputs: dict[str, torch.Tensor]
    """Encoder inputs of this item alone (collated per micro-batch by `ItemProcessor.collate`)."""
    num_embeddings: int
    """How many LLM embeddings (placeholder tokens) the item yields."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Size facts for position ids and logs (patches, grid, frames, ...)."""
    encoder_seqs: list[int] = field(default_factory=list)
    """Lengths of the sequences the encoder attends over for this item (one per image, per tile,
    per audio window), for the cost model; empty means one sequence of num_embeddings."""

    def cost_seqs(self) -> list[int]:
        return self.encoder_seqs or [self.num_embeddings]


class ItemProcessor:
    """Raw item (PIL image, audio array, video) -> `EncodedItem`; a list of them -> encoder inputs.

    A family's `item_processors` are keyed by the kind of item ("vision" for images, "audio",
    "video"); `encoder` names the OmniModel encoder its items feed (None: the encoder named by
    its key), which collates them all with the processor keyed by that encoder's name (so a video
    processor feeding "vision" makes inputs the image processor's `collate` accepts)."""

    encoder: str | None = None
    modality: str = "image"
    placeholder_id: int = -1
    """Token id that each of the item's embeddings replaces."""
    more_placeholder_ids: tuple[int, ...] = ()
    """Other token ids the item's embeddings replace, in text order with the placeholders (Ovis2's
    visual indicator tokens around and between its image tokens)."""

    def process(self, item: Any) -> EncodedItem:
        raise NotImplementedError

    def measure(self, item: Any) -> EncodedItem:
        """The item's size (num_embeddings, encoder_seqs, meta) with `inputs` left empty.

        Run on every sample a rank reads, before grouped reordering decides who trains on it, so
        families override it with something cheaper than `process` where they can (a header read
        instead of a decode). The default processes the item.
        """
        out = self.process(item)
        return EncodedItem(inputs={}, num_embeddings=out.num_embeddings, meta=out.meta,
                           encoder_seqs=out.encoder_seqs)

    shared_tail: int = 0
    """How many of an item's last tokens a run of adjacent items writes once, after the last item
    (Idefics2's closing <fake_token_around_image>, PaliGemma's <bos> after its images)."""

    def tokens(self, item: EncodedItem) -> list[int]:
        """The token ids standing for `item` in the text: one placeholder per embedding."""
        return [self.placeholder_id] * item.num_embeddings

    def tokens_at(self, item: EncodedItem, index: int) -> list[int]:
        """The tokens of `item` as the `index`-th item of its kind in a sample (0-based); the
        same for every index unless a family numbers them (MiniCPM-V's <image_id>)."""
        return self.tokens(item)

    def collate(self, items: list[EncodedItem]) -> dict[str, torch.Tensor]:
        """Default: stack each input along a new leading dim."""
        return {k: torch.stack([it.inputs[k] for it in items]) for k in items[0].inputs}


def feeds(processors: dict[str, ItemProcessor], kind: str) -> str:
    """The encoder that items of `kind` (a key of `processors`) feed."""
    return processors[kind].encoder or kind


def placeholder_ids(processors: dict[str, ItemProcessor], encoder: str) -> tuple[int, ...]:
    """Every token id whose embeddings `encoder` yields: the placeholders of the processors that
    feed it (an image and a video processor may feed one vision encoder)."""
    return tuple(sorted({i for k, p in processors.items() if feeds(processors, k) == encoder
                         for i in (p.placeholder_id, *p.more_placeholder_ids)}))


class SampleFamily(Protocol):
    """What turning rows into samples needs of a model family (`ds_omni.model.family.Family`
    is one): its name for messages, the positions of a sample's tokens, and the spans of it that
    attend both ways."""

    name: str

    def position_ids(self, input_ids: torch.Tensor,
                     items: list[tuple[str, EncodedItem]]) -> torch.Tensor:
        """Positions of one sample's tokens [L] (or [3, L] for M-RoPE)."""

    def attention_blocks(self, input_ids: torch.Tensor,
                         loss_mask: torch.Tensor) -> list[tuple[int, int]]:
        """Spans (start, end) of one sample attended both ways on top of causal attention."""


@dataclass
class Route:
    """What a parallel plan adds to a packed row: how its embeddings move between ranks and which
    group of ranks runs it. Empty (the default) for a row one rank runs whole.

    Made where the loader packs a row (`ds_omni.data.packing`: `shard_row`, `tp_share`); at step
    time only the features the router runs (`EmbeddingRouter.prepare_step`) refine it, by giving a
    micro-batch a new one (`MicroBatch.routed`), never by changing one in place. Read by the
    plan's embedding router (`ds_omni.parallelize.embedding`).
    """

    reshard: "RankReshard | None" = None
    """Under SP: what this rank encodes, sends and receives (`ds_omni.parallel.reshard.RankReshard`,
    a layer above this module: not imported here)."""
    split_inputs: dict[str, list[dict[str, torch.Tensor]]] = field(default_factory=dict)
    """Under SP: encoder -> inputs of each long item of the row (`reshard.split`), one by one; every
    rank of the group has them all and encodes its piece of each."""
    row_positions: dict[tuple[str, int], "np.ndarray"] | None = None
    """Under SP: (encoder, index) -> the item's placeholder positions in the whole padded row
    (`reshard.item_slots`), for the encoder pool; None: the row is `input_ids` itself."""
    sp_block: tuple[int, int] | None = None
    """Per-sequence SP: (first rank, size) of the block of ranks that splits this row, whose
    Ulysses group the model uses for it; None: the static plan's (no SP, or parallel.sp)."""
    pooled: bool = False
    """`parallel.encoder_pool`: `encoder_inputs` are the items the pool gave this rank (any
    rank's), and `reshard` brings this row's rows home over the pool's group."""
    pool_items: dict[str, list[EncodedItem]] | None = None
    """Pooled: those items (`reshard.encode` order), which "uniform"'s stages share under pp."""
    encode_calls: dict[str, int] | None = None
    """ZeRO-3: how many times each encoder runs on this micro-batch, the same on every rank
    (`EvenEncoderCalls` sets it; the model tops up with zero-weight dummy runs). None: no top-up."""
    row_index: "np.ndarray | None" = None
    """[parts, C] the row positions of every part's tokens where the row's cut reorders it
    (`ds_omni.parallel.row_cut`), which attention masks by; None: contiguous shards."""
    tp_encode: "TPEncode | None" = None
    """Under parallel.tp: the items this TP rank encodes (`encoder_inputs` holds theirs only) and
    its part of the gather that gives every TP rank every row (`ds_omni.parallel.tp_encode`)."""

    @property
    def sharded(self) -> bool:
        """The row is split over a group of ranks (static or per-sequence SP)."""
        return self.reshard is not None or self.sp_block is not None


@dataclass
class MicroBatch:
    """One packed row: what `OmniModel.forward` consumes. The data of the row, and the `route`
    a parallel plan adds to it."""

    input_ids: torch.Tensor  # [1, T]
    targets: torch.Tensor  # [1, T] next token, or IGNORE_INDEX
    position_ids: torch.Tensor  # [1, T] or [3, 1, T]
    cu_seqlens: torch.Tensor  # [n + 1] int32
    max_seqlen: int
    encoder_inputs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    sample_ids: list[str] = field(default_factory=list)
    pad_tokens: int = 0  # padding tokens in this row (or shard)
    host: "MicroBatch | None" = field(default=None, repr=False)  # the CPU batch `to` moved
    blocks: torch.Tensor | None = None
    """[m, 2] (start, end) spans of the whole row whose tokens attend to each other both ways
    (Gemma 3's images); host tensor, the same on every rank of an SP group. None: causal."""
    items: dict[str, list[EncodedItem]] = field(default_factory=dict, repr=False)
    """The row's encoder items (host tensors; under SP the whole row's) by encoder, in placeholder
    order: what a rank encoding only some (uniform placement, the pool) collates from."""
    route: Route = field(default_factory=Route)
    """What the parallel plan adds: resharding, the SP block, the pool, encoder top-ups."""

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
            max_seqlen=self.max_seqlen, sample_ids=self.sample_ids, pad_tokens=self.pad_tokens,
            host=self.host or self, items=self.items, blocks=self.blocks,
            encoder_inputs={e: {k: move(v) for k, v in d.items()}
                            for e, d in self.encoder_inputs.items()},
            route=dataclasses.replace(self.route, split_inputs={
                e: [{k: move(v) for k, v in d.items()} for d in items]
                for e, items in self.route.split_inputs.items()}))

    def routed(self, **changes) -> "MicroBatch":
        """The same row with its route refined (`Route`'s fields)."""
        return dataclasses.replace(self, route=dataclasses.replace(self.route, **changes))
