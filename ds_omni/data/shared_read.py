"""One reader per model-parallel group: its first rank reads and processes the group's rows once.

The sp x tp ranks of a data-parallel rank train on the same rows; without this module each would
read and decode every row. With `data.shared_reading` the group's rank 0 (`ParallelPlan
.reader_group_ranks`, in (sp, tp) order) runs the whole loader step, packs the row once, cuts every
SP rank's shard (`packing.pack_shards`) and scatters to each peer, over a gloo group of the
loader's own (`loader_shard_comm`): its `StepBatch` (its shard, the inputs of only the items it
encodes), the reader's loader position (so every rank checkpoints the same state) and the skipped
samples. The peers read nothing. Why one reader and not "each reads what it encodes": who encodes
an item is decided by the packed row's reshard plan. A reader that fails sends its peers the
error with empty micro-batches; one that dies or hangs leaves them a `DataError` naming it (at the
world's timeout), never a hang. More: docs/parallelism.md, "Sequence parallelism".
"""

from __future__ import annotations

import dataclasses
import pickle

from ds_omni.batch import EncodedItem, MicroBatch
from ds_omni.data.rank_place import ShardComm
from ds_omni.data.workers import dumps
from ds_omni.errors import DataError
from ds_omni.parallel.dist import peer_gone


def peer_view(mb: MicroBatch, all_items: bool) -> MicroBatch:
    """What a peer needs of its shard `mb`: the inputs of the items it encodes (`route.reshard
    .encode` under SP, `route.tp_encode.encode` under TP); the others keep their sizes only (no
    pixels). `all_items`: every item whole."""
    plan = mb.route.reshard or mb.route.tp_encode
    if all_items or plan is None:
        return mb
    keep = {e: set(idx) for e, idx in plan.encode.items()}
    items = {e: [it if k in keep.get(e, ()) else _sizes_only(it) for k, it in enumerate(its)]
             for e, its in mb.items.items()}
    return dataclasses.replace(mb, items=items)


def _sizes_only(item: EncodedItem) -> EncodedItem:
    return EncodedItem(inputs={}, num_embeddings=item.num_embeddings, meta=item.meta,
                       encoder_seqs=item.encoder_seqs)


def shard_of(group_rank: int, group_size: int, sp_size: int) -> int:
    """The SP shard that rank `group_rank` of a reader group of `group_size` (sp x tp) ranks
    trains on: the group is in (sp, tp) order."""
    if sp_size < 1 or group_size % sp_size:
        raise ValueError(f"a reader group of {group_size} ranks does not hold {sp_size} SP "
                         "ranks x the same number of TP ranks each")
    return group_rank // (group_size // sp_size)


def peer_shards(own: list, shards: list[list], group_size: int) -> list[list]:
    """The micro-batches of group ranks 1..group_size-1: `own` (the reader's, SP shard 0) or
    `shards[s - 1]` (SP shard s >= 1, packed by the reader), by `shard_of`."""
    sp = len(shards) + 1
    return [own if (s := shard_of(g, group_size, sp)) == 0 else shards[s - 1]
            for g in range(1, group_size)]


def send(comm: ShardComm, parcels: list[dict]) -> None:
    """The reader: parcel r (its step batch, position, skipped samples) to peer r + 1."""
    comm.scatter([None] + [dumps(p) for p in parcels])


def receive(comm: ShardComm, dp_rank: int) -> dict:
    """A peer: the parcel the group's reader made for it."""
    try:
        data = comm.scatter(None)
    except Exception as e:  # the reader died or hung: its peers must not wait forever
        raise DataError(
            f"rank {comm.rank} of the reader group of data-parallel rank {dp_rank} (its sp x tp "
            f"ranks) got no batch from the group's reader (rank {comm.reader}): "
            f"{_why(e)} ({type(e).__name__}: {e}). The reader's log says why it stopped; "
            "data.shared_reading false makes every rank read its rows itself") from None
    return pickle.loads(data)


def _why(e: Exception) -> str:
    """What a failed receive means, in words: the reader gone, or silent past the timeout."""
    text = str(e)
    if peer_gone(e):
        return "its process is gone (the connection to it closed)"
    if "Timed out" in text or "timeout" in text.lower():
        return "it sent nothing within the group's timeout (alive but stuck, or very slow)"
    return "the collective failed"
