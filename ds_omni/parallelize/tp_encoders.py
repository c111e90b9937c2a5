"""The encoders under parallel.tp: never tensor-parallel, they keep their own plan, so the TP
ranks of a group encode different items of the row they share, and every TP rank gets every row.

Per micro-batch (`TPEncoders`):
  1. `place` (in the step, on the host): the row's items go over the TP ranks by modelled cost
     (`ds_omni.data.packing.tp_share`, the pure plan `ds_omni.parallel.tp_encode`); this rank
     keeps the inputs of its items only. A micro-batch a loader already placed is left alone.
  2. `embed` (in the model's forward): this rank encodes its items (a zero-weight dummy pass
     where it has none), and `GatherTPRows` all-gathers the rows over the TP group, so each
     rank scatters the whole row's embeddings into its (whole) token embeddings.

The gradients, and where each is made whole:
  - at the LLM's input embeddings: already whole on every TP rank (`GatherTPRows`' docstring),
    so the gather's backward hands each rank its own rows' slice, summing nothing;
  - the encoders' (tower and projector) parameters: rank r's gradient now comes from its items
    alone, so the whole one is the SUM over the TP ranks. `sum_grads_over_tp` registers a hook on
    each trainable encoder parameter, before `deepspeed.initialize`, that all-reduces (sums) the
    gradient over the TP group as autograd computes it, before it is accumulated: what
    DeepSpeed's AutoTP does for its replicated parameters that see sharded activations
    (`AutoTP.register_replicated_grad_hooks`). Why a hook and not a reduction over dp x tp in
    ZeRO: ZeRO-2 reduces (and partitions) each gradient from its own post-accumulation hook
    during backward, so there is no later point at which a sum over TP could still go in; a
    pre-accumulation hook runs before it under ZeRO 0, 1 and 2 alike (and under gradient
    accumulation, each micro-batch's part summed as it comes). A ZeRO reduction over dp x tp
    instead would average where a sum is wanted and needs a parameter group of its own (MoE's
    expert groups). After the sum the encoders' gradients are the same on every TP rank, so
    ZeRO's average over the data-parallel ranks (`TensorParallelMpu`) and its gradient norm,
    which counts a parameter AutoTP did not split on TP rank 0 only, count them once.
  - the hooks are collectives: every TP rank must compute every encoder parameter's gradient
    in every backward, in the same order. So under parallel.tp every micro-batch runs every
    encoder, on a zero-weight dummy where a rank has no item (`parallelize` turns
    `encoder_dummies` on): the dummy's zero gradient is this rank's share.

Random streams: the TP ranks of a row share one (`ds_omni.train.setup`), so the dropout masks
of the replicated layers agree; encoding different items would draw different amounts from it.
The encoders run on a stream forked from it (`_encoder_rng`): one draw from the shared stream,
the same on every TP rank, seeds each rank's encoder stream, and the shared stream goes on
in step.

Dims: T tokens of the row, N its embedding rows, N_r this rank's, D the LLM's width, k
deepstack levels.
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

    def __init__(self, group, rank: int, size: int, processors: dict[str, ItemProcessor],
                 item_cost: Callable[[str, EncodedItem], float]):
        self.group, self.rank, self.size = group, rank, size
        self.processors, self.item_cost = processors, item_cost
        self.counts = TPEncodeCounts()

    def place(self, mb: MicroBatch) -> MicroBatch:
        """`mb` (the whole row, every item's inputs) with the inputs of this rank's items only
        and its part of the gather; host tensors, before the batch moves to the device."""
        if mb.route.tp_encode is None:
            if mb.route.reshard is not None:
                raise ModelError("parallel.tp: this micro-batch is also resharded over an SP "
                                 "group (parallel.sp > 1), which the encoders' split over the TP "
                                 "ranks does not handle yet; set parallel.sp to 1")
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
    (`ParallelConfig.tp_encodes_apart`; otherwise every TP rank encodes the same items and their
    gradients are not summed over TP)."""
    if not tp_group or not cfg.parallel.tp_encodes_apart:
        return None
    return TPEncoders(tp_group, plan.coords(rank).tp_rank, plan.tp, built.item_processors,
                      item_cost)
