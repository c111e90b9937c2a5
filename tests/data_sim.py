"""Simulated data-parallel ranks for loader tests: one thread per rank, all-gathers by barrier.

The loader's collectives are object all-gathers (`DataComm`); here every rank is a thread of
one process, so grouped reordering and state gathering run for real without a process group.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


class _Exchange:
    """All-gather among `size` threads: each writes its slot, all wait, all read, all wait."""

    def __init__(self, size: int):
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def all_gather(self, index: int, obj) -> list:
        self.slots[index] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadComm:
    """`DataComm` of one simulated rank."""

    def __init__(self, world: _Exchange, group: _Exchange, dp_rank: int, group_rank: int):
        self.world, self.group = world, group
        self.dp_rank, self.group_rank = dp_rank, group_rank
        self.dp_group = None

    def group_all_gather(self, obj) -> list:
        return self.group.all_gather(self.group_rank, obj)

    def world_all_gather(self, obj) -> list:
        return self.world.all_gather(self.dp_rank, obj)


def thread_comms(dp: int, group_size: int) -> list[ThreadComm]:
    world = _Exchange(dp)
    groups = [_Exchange(group_size) for _ in range(dp // group_size)]
    return [ThreadComm(world, groups[r // group_size], r, r % group_size) for r in range(dp)]


class ThreadShardComm:
    """`ShardComm` of one simulated SP rank: the reader's scatter by barrier."""

    def __init__(self, exchange: _Exchange, rank: int):
        self.exchange, self.rank, self.size, self.reader = exchange, rank, exchange.barrier.parties, 0

    def scatter(self, parts):
        return self.exchange.all_gather(self.rank, parts)[0][self.rank]


def thread_shard_comms(size: int, timeout: float = 60) -> list[ThreadShardComm]:
    exchange = _Exchange(size)
    exchange.barrier = threading.Barrier(size, timeout=timeout)
    return [ThreadShardComm(exchange, r) for r in range(size)]


def on_ranks(fn, dp: int) -> list:
    """[fn(0), ..., fn(dp - 1)], each on its own thread (they may all-gather with each other)."""
    with ThreadPoolExecutor(max_workers=dp) as pool:
        return list(pool.map(fn, range(dp)))
