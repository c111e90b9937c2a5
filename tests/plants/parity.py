"""Planted errors of data parallelism's launches (tests/dist/test_parity.py and
test_parity_slow.py)."""

from tests.plants.registry import on_result, patched, plant


# -------------------------------------------------------- data parallel (tests/dist/test_parity.py)
@plant("loss_x2", "the loss handed to DeepSpeed's backward is scaled 2x", "dp")
def _loss_x2(rank: int):
    from ds_omni.train import step
    yield from patched(step, "engine_loss", lambda f: lambda *a: 2 * f(*a))


@plant("drop_sample", "rank 0's first micro-batch of the first step loses its last sample's "
       "targets", "dp")
def _drop_sample(rank: int):
    from ds_omni.data.loader import OmniLoader
    from ds_omni.batch import IGNORE_INDEX

    def drop(batch, loader):
        if rank == 0 and batch.step == 0:
            mb = batch.micro_batches[0]
            assert mb.route.reshard is None, "plant drop_sample on data-parallel runs only"
            mb.targets[:, int(mb.cu_seqlens[-2]):] = IGNORE_INDEX
        return batch
    yield from on_result(OmniLoader, "next_step", drop)


# ------------------------------------- slow tier, data parallel (tests/dist/test_parity_slow.py)
@plant("per_sample_whole_row", "a per-sample layer run over the whole row (one sample's state "
       "flows into the next)", "dp_slow")
def _per_sample_whole_row(rank: int):
    from ds_omni.model import omni, per_sample

    def whole_row(layer, hidden, kwargs):
        return layer(hidden, **{k: v for k, v in kwargs.items()
                                if k not in (*per_sample._ROW_ONLY, "cu_seqlens")})
    yield from patched(omni, "run_per_sample", lambda f: whole_row)


# ---------- data parallel: the optimizer, the targets, the encoder pool (tests/dist/test_parity.py)
@plant("weight_decay_dropped", "the DeepSpeed config leaves train.weight_decay out of the "
       "optimizer (weight decay 0)", "dp")
def _weight_decay_dropped(rank: int):
    from ds_omni.train import ds_config

    def no_decay(out, *args):
        out["optimizer"]["params"]["weight_decay"] = 0.0
        return out
    yield from on_result(ds_config, "derive_ds_config", no_decay)


@plant("lr_schedule_late", "the LR schedule runs one step late (step k at the scheduler's "
       "iteration k - 1: `align_lr_schedule` left out)", "dp")
def _lr_schedule_late(rank: int):
    from ds_omni.train import setup
    yield from patched(setup, "align_lr_schedule", lambda f: lambda engine: None)


@plant("placeholders_as_targets", "the sample processor trains on image placeholder tokens "
       "(their loss mask set): put in the reference too, which must still see it", "dp")
def _placeholders_as_targets(rank: int):
    from ds_omni.data.processing import SampleProcessor

    def trained(tokenized, processor, segments, items, *args, **kwargs):
        ids, mask, ordered, items_end = tokenized
        placeholder = {t for enc, its in items.items() for k, it in enumerate(its)
                       for t in processor.item_processors[enc].tokens_at(it, k)}
        return ids, [m or t in placeholder for t, m in zip(ids, mask)], ordered, items_end
    yield from on_result(SampleProcessor, "_tokenize", trained)


@plant("pool_wrong_rank", "the encoder pool files the rows a rank receives under the wrong "
       "sender (the senders' blocks in reverse rank order): rows encoded on one rank land at "
       "the placeholders of items encoded on another", "dp")
def _pool_wrong_rank(rank: int):
    import dataclasses
    from ds_omni.parallelize.encoder_pool import PoolPlan

    def reversed_senders(honest, *args):
        blocks, at = [], 0
        for n in honest.recv_counts:
            blocks.append(honest.recv_positions[at:at + n])
            at += n
        return dataclasses.replace(honest, recv_positions=[
            p for block in reversed(blocks) for p in block])
    yield from on_result(PoolPlan, "reshard", reversed_senders)
