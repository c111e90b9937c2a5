"""One reader per model-parallel group: its first rank reads and processes the group's rows once.

The ranks of one data-parallel rank train on the same rows: under Ulysses SP (parallel.sp > 1)
each on its own token shard, under tensor parallelism (parallel.tp > 1) each on the whole row
(its share of every layer's columns). Without this module each of them would read every row,
decode every image and run the HF processors on it: sp x tp times the reads, decodes and loader
CPU of one rank.

With `data.shared_reading` the group's rank 0 (its *reader*; the group is
`ParallelPlan.reader_group_ranks`: the sp x tp ranks of a data-parallel rank, in (sp, tp)
order, so group rank g trains SP shard g // tp) runs the whole loader step (reading, the
grouped reordering's all-gathers, decoding, packing), packs the row once and cuts every SP
rank's shard of it (`packing.pack_shards`: the same `shard_row` each rank would run itself),
then sends each peer, in one scatter over a gloo group of the loader's own
(`parallel.groups.loader_shard_comm`: never a training group, so it cannot interleave with the
step's collectives when a prefetch thread runs it):
- its `StepBatch`: its shard's micro-batches (token ids, targets, positions, the collated inputs
  of only the items it encodes, `peer_view`, and the long items every rank encodes a piece of),
  keys, stats and error; a TP peer gets the micro-batches of its SP rank (without SP, the
  reader's own);
- the reader's loader position after the step, which the peer takes as its own: the loader
  state every rank checkpoints is the same as before, and resuming (also under another
  data-parallel size) works unchanged;
- the samples the step skipped (the peer's skip log and counts match the reader's).
The peers read and decode nothing (`ReadCounts` stays at zero).

Why this scheme and not "each rank reads only the items it encodes": which rank encodes an item
is decided by the reshard plan of the packed row, which needs every item's size, and the row's
text is needed by all; a single reader needs no second planning round and keeps every sample's
bad-row policy in one place. The price is one scatter per step of what the peers keep anyway.

A reader that fails while making the step sends its peers the error (naming its rank, and the
sample with its file where one is at fault) with empty micro-batches, so the trainer stops
every rank with it; a reader that dies or hangs leaves its peers a `DataError` naming it (at
once when its process is gone, when the group's timeout runs out when it hangs: the loader's
groups take the world's timeout, `parallel.groups.world_timeout`), never a hang.
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
