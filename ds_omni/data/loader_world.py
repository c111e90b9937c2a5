"""Where the loader processes of all ranks (`loader_process.py`) meet: their own gloo world on
the trainer's TCPStore (MASTER_ADDR / MASTER_PORT, under a prefix of their own), and the
loader's groups rebuilt in it from the `ParallelPlan` (`groups.loader_comms`)."""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from ds_omni.data.rank_place import LoaderComms, RankPlace, SharedReading
from ds_omni.parallel.plan import ParallelPlan

_GENERATION = itertools.count()  # one store prefix per loader process world (same on all ranks)


@dataclass
class World:
    """How a loader process joins the other ranks' (None where one rank loads alone)."""

    plan: ParallelPlan
    rank: int
    host: str
    port: int
    prefix: str
    timeout_s: float
    shared: SharedReading | None  # its comm is rebuilt in the loader process; the rest kept


def world_of(place: RankPlace, shared: SharedReading | None, timeout_s: float) -> World | None:
    """How the loader processes find each other: only where more than one rank loads."""
    if place.dp_size == 1 and place.plan.reader_group_size == 1:
        return None
    return World(place.plan, place.rank, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                 int(os.environ["MASTER_PORT"]), f"ds_omni_loader_{next(_GENERATION)}/",
                 timeout_s, shared)


def join_world(world: World | None) -> LoaderComms:
    """The loader processes' own gloo world on the trainer's store, and the loader's groups."""
    if world is None:
        return LoaderComms()
    from ds_omni.parallel.groups import loader_comms
    timeout = timedelta(seconds=world.timeout_s)
    store = torch.distributed.TCPStore(world.host, world.port, is_master=False, timeout=timeout)
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.PrefixStore(world.prefix, store), rank=world.rank,
        world_size=world.plan.world_size, timeout=timeout)
    comm, step_comm, shard_comm = loader_comms(world.plan, world.rank)
    shared = (dataclasses.replace(world.shared, comm=shard_comm)
              if world.shared is not None and shard_comm is not None else None)
    return LoaderComms(comm, step_comm, shared)
