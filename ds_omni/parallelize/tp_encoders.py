"""The encoders under parallel.tp: never tensor-parallel, so the TP ranks of a group encode
different items of the row they share, and every TP rank gets every row.

Per micro-batch (`TPEncoders`): `place` (in the step, on the host) gives the row's items to the TP
ranks by modelled cost (`ds_omni.parallel.tp_encode`), each keeping its items' inputs; `embed`
encodes this rank's items (a zero-weight dummy where it has none) and `GatherTPRows` all-gathers
the rows over the TP group. The encoders' gradients come from each rank's items alone, so
`sum_grads_over_tp` sums them over TP in a pre-accumulation hook per parameter, before ZeRO sees
them (as AutoTP does for replicated parameters); every TP rank must therefore run every encoder in
every micro-batch. The encoders run on a random stream forked from the TP group's shared one
(`_encoder_rng`). More: docs/internals.md, "Tensor parallelism".

Dims: T tokens of the row, N its embedding rows, N_r this rank's, D the LLM's width, k deepstack
levels.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from ds_omni.batch import EncodedItem, ItemProcessor, MicroBatch
from ds_omni.data.packing import tp_share
from ds_omni.errors import ModelError
from ds_omni.model.deepstack import Deepstack, split_levels
from ds_omni.model.omni import OmniModel, checked_rows, with_dummy_pass
from ds_omni.parallel.tp_encode import GatherTPRows


@dataclass
class TPEncodeCounts:
    """What this rank's TP encoder split did since start (plain ints: no collective, no sync):
    the tests' proof that each TP rank encoded only its share, and the gradients were summed."""

    rows: int = 0
    """Micro-batches placed (`place`)."""
    row_items: int = 0
    """Encoder items of those micro-batches' rows (every TP rank's)."""
    items_encoded: int = 0
    """Of those, the items this rank encoded."""
    gathers: int = 0
    """All-gathers of embedding rows this rank issued (one per row with items)."""
    grads_summed: int = 0
    """Encoder parameter gradients summed over the TP group (one per parameter per backward)."""

    def as_metrics(self) -> dict[str, int]:
        return {f"tp_{name}": value for name, value in asdict(self).items()}


class TPEncoders:
    """One rank's part in splitting encoder work over its TP group (module docstring)."""

    apart: bool = True
    """The micro-batch in flight was split over the TP ranks (the router sets it); False for a
    per-sequence block's row, whose items its block splits, every TP rank alike: no TP sum."""

    def __init__(self, group, rank: int, size: int, processors: dict[str, ItemProcessor],
                 item_cost: Callable[[str, EncodedItem], float]):
        self.group, self.rank, self.size = group, rank, size
        self.processors, self.item_cost = processors, item_cost
        self.counts = TPEncodeCounts()

    def place(self, mb: MicroBatch) -> MicroBatch:
        """`mb` (the whole row, every item's inputs) with the inputs of this rank's items only
        and its part of the gather; host tensors, before the batch moves to the device."""
        if mb.route.tp_encode is None:
            if mb.route.sp_block is not None:  # its block's ranks split its items, TP ranks alike
                return mb
            if mb.route.reshard is not None:
                raise RuntimeError("TPEncoders got a micro-batch resharded over an SP group: "
                                   "under parallel.sp > 1 the SP ranks split a row's items and "
                                   "no TPEncoders is built (ParallelPlan.tp_encodes_apart)")
            mb = tp_share(mb, self.processors, self.rank, self.size, self.item_cost)
        self.counts.rows += 1
        self.counts.row_items += sum(map(len, mb.items.values()))
        self.counts.items_encoded += mb.route.tp_encode.items
        return mb

    def prepare(self, micro_batches):
        """The step's micro-batches, each placed (`place`) as the step takes it
        (`EmbeddingRouter.prepare_step`)."""
        for mb in micro_batches:
            yield self.place(mb)

    def embed(self, model: OmniModel, batch: MicroBatch,
              dummies: bool) -> tuple[torch.Tensor, Deepstack | None]:
        """(the row's token embeddings [1, T, D] with every encoder row in place, the deepstack
        levels or None): this rank's items encoded, every TP rank's rows gathered."""
        plan = batch.route.tp_encode
        hidden = model.backbone.embed_tokens(batch.input_ids)  # [1, T, D]
        width = hidden.shape[-1]
        rows = {}
        with _encoder_rng(hidden.device, self.rank):
            for name, encoder in model.encoders.items():
                inputs = batch.encoder_inputs.get(name)
                if inputs is None:
                    if dummies:  # the TP sum's hooks need this rank's (zero) gradient too
                        hidden = with_dummy_pass(hidden, encoder)
                    continue
                feats = checked_rows(encoder(inputs).to(hidden.dtype), encoder, width, name)
                if feats.shape[0] != plan.encode_rows.get(name, 0):
                    raise ModelError(
                        f"encoder '{name}' produced {feats.shape[0]} embeddings for this TP "
                        f"rank's items but their placeholders number "
                        f"{plan.encode_rows.get(name, 0)} (samples {batch.sample_ids[:4]}); "
                        "each item needs exactly as many placeholders as it yields embeddings")
                rows[name] = feats
        if not plan.group_rows:  # no item in the row: no rank gathers anything
            return hidden, None
        ordered = [rows[name] for name in plan.order if name in rows]  # the plan's row order
        empty = hidden.new_zeros((0, (1 + model.deepstack) * width))
        local = torch.cat(ordered) if ordered else empty  # [N_r, (1 + k) D]
        gathered = GatherTPRows.apply(local, plan, self.group)  # [N, (1 + k) D]
        self.counts.gathers += 1
        where = torch.as_tensor(plan.positions, dtype=torch.long, device=hidden.device)
        main, extra = split_levels(gathered, width)  # [N, D], [N, k, D]
        hidden = hidden[0].index_copy(0, where, main).unsqueeze(0)
        return hidden, None if extra is None else Deepstack(where, extra, model.deepstack_layers)

    def sum_grads_over_tp(self, encoders: torch.nn.Module) -> int:
        """Register the TP sum on every trainable encoder parameter (module docstring); call
        before `deepspeed.initialize`. Returns how many."""
        group, counts = self.group, self.counts

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self.apart:  # a per-sequence block's row: every TP rank encoded its items
                return grad
            grad = grad.contiguous()
            torch.distributed.all_reduce(grad, group=group)  # sum: each rank's items' part
            counts.grads_summed += 1
            return grad
        params = [p for p in encoders.parameters() if p.requires_grad]
        for p in params:
            p.register_hook(hook)
        return len(params)


@contextmanager
def _encoder_rng(device: torch.device, tp_rank: int):
    """The encoders' own random stream for this micro-batch: seeded by one draw from the stream
    the TP ranks share (the same draw on each) plus the TP rank; the shared stream is restored
    after, so the replicated layers' dropout masks stay the same on every TP rank."""
    seed = int(torch.randint(0, 2 ** 62, (1,))) + tp_rank
    accelerator = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if accelerator else [],
                               device_type=device.type if accelerator else "cuda"):
        torch.random.default_generator.manual_seed(seed)
        if accelerator:
            torch.get_device_module(device.type).manual_seed(seed)  # this device only
        yield


def tp_encoders_for(cfg, built, plan, rank: int, tp_group, item_cost) -> TPEncoders | None:
    """The TP ranks of a row encoding different items of it, where they do
    (`ParallelPlan.tp_encodes_apart`; otherwise every TP rank encodes the same items and their
    gradients are not summed over TP)."""
    if not tp_group or not plan.tp_encodes_apart:
        return None
    return TPEncoders(tp_group, plan.coords(rank).tp_rank, plan.tp, built.item_processors,
                      item_cost)
