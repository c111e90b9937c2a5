"""Planted errors of sequence parallelism's launches (tests/dist/test_sequence_parallel.py
and test_sequence_parallel_slow.py)."""

from contextlib import contextmanager

from tests.plants.registry import on_result, patched, plant


# ------------------------ slow tier, sequence parallel (tests/dist/test_sequence_parallel_slow.py)
@plant("deepstack_levels_dropped", "the deepstack levels are never added to the LLM's hidden "
       "states", "sp_slow")
def _deepstack_levels_dropped(rank: int):
    from ds_omni.model import deepstack
    yield from patched(deepstack.Deepstack, "add", lambda add: lambda self, hidden, level: hidden)


# ----------------------------------------- sequence parallel (tests/dist/test_sequence_parallel.py)
@plant("reshard_rows_swapped", "rank 0's first shard that receives two or more embedding rows "
       "puts its first and last received row in each other's place (the resharding plan)", "sp2")
def _reshard_rows_swapped(rank: int):
    import dataclasses
    from ds_omni.data import packing
    done = []

    def swap(plans, *args, **kwargs):
        mine = plans[0]
        if rank == 0 and not done and mine.rows_in >= 2:
            where = list(mine.recv_positions)
            where[0], where[-1] = where[-1], where[0]
            plans[0] = dataclasses.replace(mine, recv_positions=where)
            done.append(True)
        return plans
    yield from on_result(packing, "plan_reshard", swap)


@plant("sp_block_ignored", "the model runs a long sequence's row without its block's Ulysses "
       "group (its sp_block ignored): each rank attends over its own shard only", "sp2")
def _sp_block_ignored(rank: int):
    from ds_omni.parallelize.embedding import EmbeddingRouter
    yield from patched(EmbeddingRouter, "route",
                       lambda route: lambda router, batch: (router.sp_group, None))


@plant("sp_whole_row", "every SP rank packs and computes the whole row (no shard, no "
       "resharding; attention over a whole row skips Ulysses)", "sp2")
def _sp_whole_row(rank: int):
    from contextlib import ExitStack
    from ds_omni.data import packing
    from ds_omni.model.attention import PackedAttention

    def whole_row(row, items, processors, shard):  # what `pack` makes without a shard
        row.encoder_inputs = {e: processors[e].collate(its) for e, its in items.items()}
        row.items = items
        return row

    def make_call(call):
        def planted(self, q, k, v, cu_seqlens, *rest):
            if q.shape[2] == int(cu_seqlens[-1]):  # [1, H, T, D]: the whole row, no exchange
                return self._local(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   cu_seqlens, *rest)
            return call(self, q, k, v, cu_seqlens, *rest)
        return planted
    with ExitStack() as stack:
        for owner, attr, make in ((packing, "shard_row", lambda f: whole_row),
                                  (PackedAttention, "__call__", make_call)):
            stack.enter_context(contextmanager(patched)(owner, attr, make))
        yield


@plant("reader_wrong_pixels", "the SP group's reader sends a peer the pixels of the wrong items "
       "(each item it encodes gets the next item of the row's inputs)", "sp2")
def _reader_wrong_pixels(rank: int):
    from ds_omni.data import workers

    def wrong_pixels(shards, samples, processors, shard):
        for mb in shards[1:]:
            plan = mb.route.reshard
            if plan is None:
                continue
            mb.encoder_inputs = {
                e: processors[e].collate([mb.items[e][(k + 1) % len(mb.items[e])] for k in idx])
                for e, idx in plan.encode.items() if idx}
        return shards
    yield from on_result(workers, "pack_shards", wrong_pixels)
