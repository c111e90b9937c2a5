"""What one rank's loader is told about its place in the run: its ranks and micro-batches
(`RankPlace`), the collectives it talks over (`DataComm`, `LoaderComms`), and how long work is
split over ranks (`LongSplits`). Plain values, built once by `data.build.build_loader`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ds_omni.parallel.long_short import LongItems
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallel.row_cut import RowCut


class DataComm(Protocol):
    """The collectives the loader needs (torch.distributed in training; threads in unit tests)."""

    def group_all_gather(self, obj) -> list:
        """`obj` of every rank of this rank's reorder group, in group-rank order."""

    def world_all_gather(self, obj) -> list:
        """`obj` of every data-parallel rank, in dp-rank order."""


class LocalComm:
    """One data-parallel rank alone."""

    def group_all_gather(self, obj) -> list:
        return [obj]

    def world_all_gather(self, obj) -> list:
        return [obj]


@dataclass(frozen=True, kw_only=True)
class RankPlace:
    """Where this rank's loader sits: global rank `rank` of `plan` (default: one rank alone),
    whose data-parallel rank names the samples it reads (the ranks of one SP group read the same
    rows) and whose SP rank its shard of each row; `num_micro` micro-batches a step."""

    plan: ParallelPlan = ParallelPlan(world_size=1, dp=1)
    rank: int = 0
    num_micro: int

    @property
    def dp_rank(self) -> int:
        return self.plan.coords(self.rank).dp_rank

    @property
    def dp_size(self) -> int:
        return self.plan.dp

    @property
    def sp_rank(self) -> int:
        return self.plan.coords(self.rank).sp_rank

    @property
    def sp_size(self) -> int:
        return self.plan.sp

    @property
    def row_cut(self) -> RowCut:
        """How a row is cut over the sp_size ranks (`ParallelPlan.row_cut`)."""
        return self.plan.row_cut()

    @property
    def reorder_group(self) -> int:
        """G: the data-parallel ranks whose loaders reorder together."""
        return self.plan.reorder_group

    @property
    def max_sequence_sp(self) -> int:
        """Per-sequence SP: the most ranks of a reorder group one long sequence is split over."""
        return self.plan.max_sequence_sp


class ShardComm(Protocol):
    """The loader's own collective over one reader group (`data.shared_reading`: the sp x tp
    ranks of a data-parallel rank, in (sp, tp) order): its first rank, the reader, hands every
    rank its part of a step."""

    rank: int  # this rank's place in the reader group (0: the reader)
    size: int
    reader: int  # the reader's global rank (for messages)

    def scatter(self, parts: list | None):
        """On the reader: `parts` (one picklable object per group rank), its own returned; on
        the others (None): the object the reader gave this rank."""


@dataclass(frozen=True)
class SharedReading:
    """One reader per sp x tp group (`ds_omni.data.shared_read`): `comm` the group's own collective;
    `all_items`: a peer gets the inputs of every item of its rows, not only of those it encodes
    (the encoder pool and the joint pipeline read other items' inputs on every rank)."""

    comm: ShardComm
    all_items: bool = False
    tp_apart: int = 1
    """parallel.tp when the TP ranks of a row encode different items of it (`ParallelPlan
    .tp_encodes_apart`, sp = 1): peer g, TP rank g, then gets its own items' inputs only."""


@dataclass
class LoaderComms:
    """The loader's collectives: `data` for its state (and its steps, by default); `step` for the
    all-gathers of `next_step`, groups of their own when steps run on a prefetch thread;
    `shared`: one reader per sp x tp group (None: every rank reads its rows itself)."""

    data: DataComm | None = None
    step: DataComm | None = None
    shared: SharedReading | None = None

    def __post_init__(self):
        self.data = self.data or LocalComm()
        self.step = self.step or self.data


@dataclass(frozen=True)
class LongSplits:
    """Which long encoder items are split over the ranks sharing their row (long-short SP;
    None: no item is split). Long sequences split as `RankPlace.max_sequence_sp` says."""

    long_items: LongItems | None = None
