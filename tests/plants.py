"""Planted errors: one small, named change to the code under test each, that an oracle must catch.

    with plants.applied("loss_x2", rank):   # inside a rank (or the one process) under test
        ... train ...

A plant is put in by monkeypatching (never by editing ds_omni): `applied` puts the change in on
entry and takes it out on exit, so one launch can train a planted case among the honest ones.
Each plant names the launch whose oracle must fail on it (`launch`); the suite's tests called
`test_plant_*` (so `pytest -k plant` runs them all) assert, for every plant of their launch, that
the oracle's check FAILS with the plant in (`tests/unit/test_plants.py` holds every plant to a
test that runs it).

To add one: a generator function `(rank) -> None` that patches, yields, and undoes, decorated
with `@plant(name, what, launch)`; then a case for it in that launch and its `test_plant_*`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Plant:
    name: str
    what: str  # the change, in words
    launch: str  # the launch (test module) whose oracle must see it
    apply: Callable[[int], contextmanager]  # rank -> a context with the change in place


PLANTS: dict[str, Plant] = {}


def plant(name: str, what: str, launch: str):
    def register(fn: Callable[[int], Iterator[None]]):
        assert name not in PLANTS, f"plant {name!r} registered twice"
        PLANTS[name] = Plant(name, what, launch, contextmanager(fn))
        return fn
    return register


@contextmanager
def applied(name: str | None, rank: int):
    """The plant `name` in place (no plant: nothing changes)."""
    if name is None:
        yield
        return
    with PLANTS[name].apply(rank):
        yield


def for_launch(launch: str) -> list[str]:
    return sorted(n for n, p in PLANTS.items() if p.launch == launch)


def _patched(owner, attr: str, make: Callable) -> Iterator[None]:
    """`owner.attr = make(original)` for the duration."""
    original = getattr(owner, attr)
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


# ------------------------------------------------------------- data parallel (tests/dist/test_parity.py)
@plant("loss_x2", "the loss handed to DeepSpeed's backward is scaled 2x", "dp")
def _loss_x2(rank: int):
    from ds_omni.train import engine as train
    yield from _patched(train, "engine_loss", lambda f: lambda *a: 2 * f(*a))


@plant("drop_sample", "rank 0's first micro-batch of the first step loses its last sample's "
       "targets", "dp")
def _drop_sample(rank: int):
    from ds_omni.data.loader import OmniLoader
    from ds_omni.model.omni import IGNORE_INDEX

    def make(next_step):
        def planted(loader):
            batch = next_step(loader)
            if rank == 0 and batch.step == 0:
                mb = batch.micro_batches[0]
                assert mb.reshard is None, "plant drop_sample on data-parallel runs only"
                mb.targets[:, int(mb.cu_seqlens[-2]):] = IGNORE_INDEX
            return batch
        return planted
    yield from _patched(OmniLoader, "next_step", make)


@plant("weight_decay_dropped", "the DeepSpeed config leaves train.weight_decay out of the "
       "optimizer (weight decay 0)", "dp")
def _weight_decay_dropped(rank: int):
    from ds_omni import ds_config

    def make(derive):
        def planted(*args):
            out = derive(*args)
            out["optimizer"]["params"]["weight_decay"] = 0.0
            return out
        return planted
    yield from _patched(ds_config, "derive_ds_config", make)


@plant("lr_schedule_late", "the LR schedule runs one step late (step k at the scheduler's "
       "iteration k - 1: `align_lr_schedule` left out)", "dp")
def _lr_schedule_late(rank: int):
    from ds_omni.train import engine as train
    yield from _patched(train, "align_lr_schedule", lambda f: lambda engine: None)


@plant("placeholders_as_targets", "the sample processor trains on image placeholder tokens "
       "(their loss mask set): put in the reference too, which must still see it", "dp")
def _placeholders_as_targets(rank: int):
    from ds_omni.data.processing import SampleProcessor

    def make(tokenize):
        def planted(processor, segments, items, where, bos=True):
            ids, mask, ordered, items_end = tokenize(processor, segments, items, where, bos)
            placeholder = {t for enc, its in items.items() for k, it in enumerate(its)
                           for t in processor.item_processors[enc].tokens_at(it, k)}
            return ids, [m or t in placeholder for t, m in zip(ids, mask)], ordered, items_end
        return planted
    yield from _patched(SampleProcessor, "_tokenize", make)


@plant("pool_wrong_rank", "the encoder pool files the rows a rank receives under the wrong "
       "sender (the senders' blocks in reverse rank order): rows encoded on one rank land at "
       "the placeholders of items encoded on another", "dp")
def _pool_wrong_rank(rank: int):
    import dataclasses
    from ds_omni.parallel.encoder_pool import PoolPlan

    def make(reshard):
        def planted(plan, pool_rank, row):
            honest = reshard(plan, pool_rank, row)
            blocks, at = [], 0
            for n in honest.recv_counts:
                blocks.append(honest.recv_positions[at:at + n])
                at += n
            return dataclasses.replace(honest, recv_positions=[
                p for block in reversed(blocks) for p in block])
        return planted
    yield from _patched(PoolPlan, "reshard", make)


# ------------------------------------------ pipeline, "uniform" placement (tests/dist/pipeline.py)
@plant("skip_encoder_broadcast", "after the optimizer step, stage 0 does not broadcast the "
       "encoder parameters it owns (nor do the others receive them): stage 1's replicas go "
       "stale", "pp")
def _skip_encoder_broadcast(rank: int):
    from ds_omni.parallel.joint import EncoderShards

    def make(broadcast):
        def planted(shards):
            buckets = shards._buckets
            shards._buckets = lambda: [(o, b) for o, b in buckets() if o != 0]
            try:
                broadcast(shards)
            finally:
                del shards._buckets
        return planted
    yield from _patched(EncoderShards, "broadcast_params", make)


@plant("grad_norm_replicas_twice", "the encoder gradients are summed onto every stage "
       "(all-reduce) instead of their owner alone, and the replicas keep theirs: DeepSpeed's "
       "gradient norm counts the encoder parameters stage 1 owns twice", "pp")
def _grad_norm_replicas_twice(rank: int):
    import torch
    import torch.distributed as dist
    from ds_omni.parallel import joint

    def make(reduce_grads):
        def planted(shards):
            for _, bucket in shards._buckets():
                flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # [E]
                dist.all_reduce(flat, group=shards.group)
                joint._unflatten_into(flat, [p.grad for p in bucket])
        return planted
    yield from _patched(joint.EncoderShards, "reduce_grads", make)
