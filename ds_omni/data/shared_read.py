"""One reader per SP group: the group's first rank reads and processes its rows once.

Under Ulysses SP (parallel.sp > 1) the ranks of an SP group train on the same rows, each on its
own token shard. Without this module each of them would read every row, decode every image and
run the HF processors on it, to keep a shard and the inputs of the few items the reshard plan
gives it to encode: sp times the reads, decodes and loader CPU of one rank.

With `data.shared_reading` the group's rank 0 (its *reader*) runs the whole loader step (reading,
the grouped reordering's all-gathers, decoding, packing), packs the row once and cuts every
rank's shard of it (`packing.pack_shards`: the same `shard_row` each rank would run itself),
then sends each peer, in one scatter over a gloo group of the loader's own
(`parallel.groups.loader_shard_comm`: never a training group, so it cannot interleave with the
step's collectives when a prefetch thread runs it):
- its `StepBatch`: its shards (token ids, targets, positions, the collated inputs of only the
  items it encodes, the long items every rank encodes a piece of), keys, stats and error;
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
every rank with it; a reader that dies leaves its peers a `DataError` naming it when the
group's timeout runs out, never a hang.
"""

from __future__ import annotations

import dataclasses
import pickle

from ds_omni.batch import EncodedItem, MicroBatch
from ds_omni.data.rank_place import ShardComm
from ds_omni.data.workers import dumps
from ds_omni.errors import DataError


def peer_view(mb: MicroBatch, all_items: bool) -> MicroBatch:
    """What a peer needs of its shard `mb`: the inputs of the items it encodes (`route.reshard
    .encode`); the others keep their sizes only (no pixels). `all_items`: every item whole."""
    plan = mb.route.reshard
    if all_items or plan is None:
        return mb
    keep = {e: set(idx) for e, idx in plan.encode.items()}
    items = {e: [it if k in keep.get(e, ()) else _sizes_only(it) for k, it in enumerate(its)]
             for e, its in mb.items.items()}
    return dataclasses.replace(mb, items=items)


def _sizes_only(item: EncodedItem) -> EncodedItem:
    return EncodedItem(inputs={}, num_embeddings=item.num_embeddings, meta=item.meta,
                       encoder_seqs=item.encoder_seqs)


def send(comm: ShardComm, parcels: list[dict]) -> None:
    """The reader: parcel r (its step batch, position, skipped samples) to peer r + 1."""
    comm.scatter([None] + [dumps(p) for p in parcels])


def receive(comm: ShardComm, dp_rank: int) -> dict:
    """A peer: the parcel the group's reader made for it."""
    try:
        data = comm.scatter(None)
    except Exception as e:  # the reader died or hung: its peers must not wait forever
        raise DataError(
            f"SP rank {comm.rank} of data-parallel rank {dp_rank} got no batch from its SP "
            f"group's reader (rank {comm.reader}): {type(e).__name__}: {e}. The reader's log "
            "says why it stopped; data.shared_reading false makes every SP rank read its rows "
            "itself") from None
    return pickle.loads(data)
