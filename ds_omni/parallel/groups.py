"""Process groups built from the parallel plan, and the collectives the data loader uses.

`torch.distributed.new_group` must be called by every rank for every group, in the same order;
`data_groups` does that for the data-parallel groups and the reorder groups (G consecutive ranks
of a data-parallel group) and returns this rank's.
"""

from __future__ import annotations

import torch.distributed as dist

from ds_omni.parallel.plan import ParallelPlan


def data_groups(plan: ParallelPlan, rank: int, group_size: int):
    """(this rank's data-parallel group, its reorder group); None stands for the default group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp_pg = reorder_pg = None
    for dp_ranks in plan.dp_group_ranks():
        pg = _group(dp_ranks, world)
        if rank in dp_ranks:
            dp_pg = pg
        for start in range(0, len(dp_ranks), group_size):
            members = dp_ranks[start:start + group_size]
            sub = _group(members, world)
            if rank in members:
                reorder_pg = sub
    return dp_pg, reorder_pg


def _group(ranks: list[int], world: int):
    """The default group for the whole world, else a new one (every rank creates every group)."""
    if len(ranks) == world:
        return None
    return dist.new_group(ranks)


class TorchDataComm:
    """`DataComm` over torch.distributed: object all-gathers within groups."""

    def __init__(self, dp_group=None, reorder_group=None, dp_size: int = 1, group_size: int = 1):
        self.dp_group, self.reorder_group = dp_group, reorder_group
        self.dp_size, self.group_size = dp_size, group_size

    def group_all_gather(self, obj) -> list:
        return _all_gather(obj, self.reorder_group, self.group_size)

    def world_all_gather(self, obj) -> list:
        return _all_gather(obj, self.dp_group, self.dp_size)


def _all_gather(obj, group, size: int) -> list:
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out
