"""Process groups built from the parallel plan, and the collectives the data loader uses.

`torch.distributed.new_group` must be called by every rank for every group, in the same order;
`rank_groups` makes all of a run's groups that way, once, and returns this rank's (`RankGroups`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_omni.parallel.dist import timeout_s
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallel.ring import RingGroup


@dataclass
class RankGroups:
    """This rank's process groups (None stands for the default group, the world)."""

    dp: object
    """The data-parallel ranks of this rank's (pp stage, sp rank)."""
    reorder: object
    """This rank's reorder group: G consecutive ranks of `dp` (`ParallelPlan.reorder_group`)."""
    mpu: "SequenceParallelMpu | TensorParallelMpu | SequenceTensorParallelMpu | None"
    """DeepSpeed's mpu: the Ulysses and sequence x data groups (sp > 1), the tensor- and
    data-parallel groups (tp > 1), all four under both (`SequenceTensorParallelMpu`)."""
    blocks: dict[tuple[int, int], object]
    """Per-sequence SP: (first data-parallel rank, size) -> the group of every block that holds
    this rank (under tp, its TP rank's: `ParallelPlan.sequence_block_ranks`)."""
    comm: "TorchDataComm"
    """The loader's metadata all-gathers (and the step's token totals)."""
    step_comm: "TorchDataComm | None"
    """`dp` and `reorder` again as groups of their own, for loader steps a prefetch thread runs."""
    tp: object = None
    """Under parallel.tp > 1: the ranks that split the backbone's layers (None without)."""
    shard_comm: "TorchShardComm | None" = None
    """Under parallel.sp or parallel.tp > 1: the ranks that train on this rank's rows (its sp x
    tp ranks), a gloo group of the loader's own (one reader per group, `ds_omni.data.shared_read`)."""
    rank: int = 0
    """This rank, whose groups these are."""
    axes: dict[str, tuple[object, list[int]]] = field(default_factory=dict)
    """Each kind of `ParallelPlan.axis_group_ranks` (groups of more than one rank): name -> (this
    rank's group, its members); under cp, "cp" (its ring) and "ulysses" (parallel.sp > 1)."""
    block_rings: dict[tuple[int, int], tuple[object, RingGroup]] | None = None
    """Per-sequence blocks larger than the heads (`ParallelPlan.block_split`): block -> (this
    rank's Ulysses group in it, None at Ulysses degree 1; its ring)."""

    @classmethod
    def alone(cls, rank: int = 0) -> "RankGroups":
        """The groups of global rank `rank` when it talks to no other rank: one rank alone, or
        one process looping over simulated ranks (each loader reading its rank's samples)."""
        return cls(dp=None, reorder=None, mpu=None, blocks={}, comm=TorchDataComm(),
                   step_comm=None, rank=rank)

    @property
    def sp(self):
        """The LLM's Ulysses group, or None without parallel.sp."""
        sequence = isinstance(self.mpu, (SequenceParallelMpu, SequenceTensorParallelMpu))
        return self.mpu.get_sequence_parallel_group() if sequence else None

    @property
    def pool(self):
        """The encoder pool's group: every rank of this pipeline stage (`ParallelPlan.pool_size`)
        of this rank's TP rank (each TP rank pools its own copy of the encoders, all alike)."""
        sequence = isinstance(self.mpu, (SequenceParallelMpu, SequenceTensorParallelMpu))
        return self.mpu.get_sequence_data_parallel_group() if sequence else self.dp


def rank_groups(plan: ParallelPlan, rank: int, prefetch: bool) -> RankGroups:
    """Every group of the run, made by every rank in one fixed order; this rank's.
    `prefetch`: the loader's steps run on a thread (`data.prefetch_steps`), which needs groups of
    its own."""
    dp, reorder = data_groups(plan, rank)
    mpu = sequence_groups(plan, rank)
    blocks = sequence_blocks(plan, rank)
    block_rings = sequence_block_rings(plan, rank)
    comm = TorchDataComm(plan, dp, reorder,
                         mpu.get_sequence_data_parallel_group() if mpu else None)
    tp = tensor_group(plan, rank)
    if tp is not None and mpu is not None:  # tp x sp: one mpu serving both of DeepSpeed's views
        mpu = SequenceTensorParallelMpu(tp, dp, mpu.get_sequence_parallel_group(),
                                        mpu.get_sequence_data_parallel_group())
    elif tp is not None:
        mpu = TensorParallelMpu(tp, dp)
    step_comm = loader_step_comm(plan, rank) if prefetch else None
    axes = axis_groups(plan, rank)
    return RankGroups(dp=dp, reorder=reorder, mpu=mpu, blocks=blocks, comm=comm,
                      step_comm=step_comm, tp=tp,
                      shard_comm=loader_shard_comm(plan, rank), rank=rank, axes=axes,
                      block_rings=block_rings)


def axis_groups(plan: ParallelPlan, rank: int) -> dict[str, tuple[object, list[int]]]:
    """The groups of `ParallelPlan.axis_group_ranks`, every one made by every rank in the same
    order (kinds of one-rank groups skipped); {name: (this rank's group, its members)}."""
    out = {}
    for name, groups in plan.axis_group_ranks().items():
        if max(map(len, groups)) == 1:
            continue
        for members in groups:
            pg = dist.new_group(members)
            if rank in members:
                out[name] = (pg, members)
    return out


def tensor_group(plan: ParallelPlan, rank: int):
    """This rank's tensor-parallel group (None when tp == 1): always a group of its own, even
    when it is the world, since DeepSpeed's AutoTP layers read "no group" as "not parallel"."""
    if not plan.tp_enabled:
        return None
    own = None
    for members in plan.tp_group_ranks():
        pg = dist.new_group(members)
        if rank in members:
            own = pg
    return own


def loader_shard_comm(plan: ParallelPlan, rank: int) -> "TorchShardComm | None":
    """This rank's reader group (the sp x tp ranks of its data-parallel rank,
    `ParallelPlan.reader_group_ranks`) as a new gloo group of the loader's own (None when
    sp x tp == 1): the reader's scatter runs on the prefetch thread, which must not share a
    group with training."""
    if plan.reader_group_size == 1:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    members = next(m for m in plan.reader_group_ranks() if rank in m)
    return TorchShardComm(_own_group(plan.reader_group_ranks(), rank, world, fresh=True),
                          members, rank)


def data_groups(plan: ParallelPlan, rank: int):
    """(this rank's data-parallel group, its reorder group); None stands for the default group.

    The members come from the plan (`ParallelPlan.reorder_group_ranks`), so the groups built here
    are the ones `ds-omni plan` prints.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    return (_own_group(plan.dp_group_ranks(), rank, world),
            _own_group(plan.reorder_group_ranks(plan.reorder_group), rank, world))


def loader_step_comm(plan: ParallelPlan, rank: int) -> "TorchDataComm":
    """The data-parallel and reorder groups again, as new gloo groups of their own (never the
    default group), for the all-gathers of loader steps run on a prefetch thread: two threads must
    not issue collectives on one group, and gloo keeps host-side objects off the accelerator."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return TorchDataComm(plan, _own_group(plan.dp_group_ranks(), rank, world, fresh=True),
                         _own_group(plan.reorder_group_ranks(plan.reorder_group), rank, world,
                                    fresh=True))


def _own_group(groups: list[list[int]], rank: int, world: int, fresh: bool = False):
    """Create every group of `groups` (all ranks must, in the same order); return `rank`'s."""
    own = None
    for members in groups:
        pg = _group(members, world, fresh)
        if rank in members:
            own = pg
    return own


def _group(ranks: list[int], world: int, fresh: bool = False):
    """The default group for the whole world, else a new one (every rank creates every group);
    `fresh`: always a new gloo group (none at all in a single process)."""
    if world == 1 or (len(ranks) == world and not fresh):
        return None
    timeout = world_timeout()
    return (dist.new_group(ranks, backend="gloo", timeout=timeout) if fresh
            else dist.new_group(ranks, timeout=timeout))


def world_timeout() -> timedelta:
    """The default group's timeout (`init_distributed`'s), for the groups made here: torch
    gives a new group its own default (30 minutes) instead, so a loader's peer would wait that
    long for a reader that hangs. `DS_OMNI_DIST_TIMEOUT`, where the backend does not say."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # no CPU backend in the world group (NCCL only)
        return timedelta(seconds=timeout_s())


def sequence_blocks(plan: ParallelPlan, rank: int) -> dict[tuple[int, int], object]:
    """Per-sequence SP: a process group for every block of `ParallelPlan.sequence_blocks` (under
    tp one per TP rank, `sequence_block_ranks`), created once at start-up by every rank in the
    same order; returns {(first data-parallel rank, size): group} for the blocks that contain
    `rank` (empty when per-sequence SP is off). A block of the whole world
    gets a group of its own too: None would mean "no SP" to the model."""
    out = {}
    for start, size in plan.sequence_blocks():
        for members in plan.sequence_block_ranks(start, size):  # one per TP rank
            group = dist.new_group(members)
            if rank in members:
                out[(start, size)] = group
    return out


def sequence_block_rings(plan: ParallelPlan, rank: int
                         ) -> dict[tuple[int, int], tuple[object, RingGroup]]:
    """Per-sequence blocks with a ring (`ParallelPlan.block_split`): the Ulysses groups and
    rings of every such block, made by every rank in the same order; {block: (this rank's
    Ulysses group or None, its ring)} for the blocks that hold `rank`."""
    out = {}
    for start, size in plan.sequence_blocks():
        if plan.block_split(size)[1] == 1:
            continue
        for members in plan.sequence_block_ranks(start, size):
            ulysses_groups, rings = plan.block_ring_ranks(members)
            mine = [None, None]
            for group in ulysses_groups if len(ulysses_groups[0]) > 1 else []:
                pg = dist.new_group(group)
                mine[0] = pg if rank in group else mine[0]
            for ring in rings:
                pg = dist.new_group(ring)
                mine[1] = RingGroup.of(pg, ring, rank) if rank in ring else mine[1]
            if rank in members:
                out[(start, size)] = tuple(mine)
    return out


class TorchDataComm:
    """`DataComm` over torch.distributed: object all-gathers within groups.

    `token_group` spans the ranks whose micro-batches together hold the global batch's tokens once:
    the dp group without SP; under SP the sequence x data group, since each SP rank holds a shard.
    The sizes are `plan`'s (default: one rank alone).
    """

    def __init__(self, plan: ParallelPlan | None = None, dp_group=None, reorder_group=None,
                 seq_data_group=None):
        self.plan = plan or ParallelPlan(world_size=1, dp=1)
        self.dp_group, self.reorder_group = dp_group, reorder_group
        self.token_group = seq_data_group if self.plan.sp_enabled else dp_group

    @property
    def dp_size(self) -> int:
        return self.plan.dp

    @property
    def sp_size(self) -> int:
        return self.plan.sp

    @property
    def group_size(self) -> int:
        return self.plan.reorder_group

    def group_all_gather(self, obj) -> list:
        return _all_gather(obj, self.reorder_group, self.group_size)

    def world_all_gather(self, obj) -> list:
        return _all_gather(obj, self.dp_group, self.dp_size)


class TorchShardComm:
    """`ShardComm` over torch.distributed: the reader (the reader group's first rank) sends each
    peer its bytes, a size then the payload, point to point: no pickling of the pickled bytes
    again and no padding to the largest part (what `scatter_object_list` does)."""

    def __init__(self, group, members: list[int], rank: int):
        self.group, self.members = group, members
        self.rank, self.size, self.reader = members.index(rank), len(members), members[0]

    def scatter(self, parts: list[bytes | None] | None):
        if self.rank == 0:
            for dst, data in zip(self.members[1:], parts[1:]):
                dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=self.group)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst,
                          group=self.group)
            return parts[0]
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, self.reader, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, self.reader, group=self.group)
        return memoryview(data.numpy())


def _all_gather(obj, group, size: int) -> list:
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def sequence_groups(plan: ParallelPlan, rank: int) -> "SequenceParallelMpu | None":
    """This rank's Ulysses group and sequence x data group, as DeepSpeed's `mpu`; None when sp == 1.

    SP groups are the ranks of one (pp, dp, tp) coordinate (consecutive ranks without tp, which
    `ParallelPlan` puts innermost). The sequence x data group holds the dp x sp ranks of this
    pipeline stage and tensor-parallel rank (`ParallelPlan.seq_data_group_ranks`; without tp,
    every rank of the stage): ZeRO partitions and reduces over it, since those ranks hold the
    same parameters (the same TP shard) and each sees a different part of the data.
    """
    if not plan.sp_enabled:
        return None
    sp_pg = None
    for members in plan.sp_group_ranks():
        pg = dist.new_group(members)  # always a group of its own, even when it is the world
        if rank in members:
            sp_pg = pg
    seq_data_pg = None
    for members in plan.seq_data_group_ranks():
        pg = dist.new_group(members)
        if rank in members:
            seq_data_pg = pg
    alone = [dist.new_group([r]) for r in range(plan.world_size)][rank]
    return SequenceParallelMpu(sp_pg, seq_data_pg, alone)


class SequenceGroups:
    """DeepSpeed's sequence-parallel interface over `_sp` (the Ulysses group) and `_seq_data`
    (the sequence x data group ZeRO reduces over): what both SP mpus below offer."""

    _sp: object
    _seq_data: object

    def get_sequence_parallel_group(self):
        return self._sp

    def get_sequence_parallel_world_size(self) -> int:
        return dist.get_world_size(self._sp)

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self._sp)

    def get_sequence_data_parallel_group(self):
        return self._seq_data

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._seq_data)

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self._seq_data)


class SequenceParallelMpu(SequenceGroups):
    """The `mpu` DeepSpeed is given under Ulysses SP, so ZeRO reduces over data x sequence ranks.

    It offers what DeepSpeed's own `deepspeed.runtime.sequence_parallel.parallel_state_sp` module
    offers (DeepSpeed recognises that interface by `initialize_sequence_parallel`), held by an object
    instead of module globals. DeepSpeed then averages gradients over the dp ranks and sums them over
    the sp ranks (`engine._reduce_non_expert_gradients`, ZeRO's `average_tensor`), which is what
    `engine.gradient_divisor` accounts for.
    """

    def __init__(self, sp_group, seq_data_group, model_parallel_group):
        self._sp, self._seq_data, self._mp = sp_group, seq_data_group, model_parallel_group

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        raise RuntimeError("ds_omni builds its sequence-parallel groups from the ParallelPlan")

    # No tensor parallelism: each rank holds whole parameters. DeepSpeed's gradient clipping asks
    # for these (its own parallel_state_sp lacks them, so ZeRO-0 with clipping fails there).
    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return self._mp


class TensorParallelMpu:
    """The `mpu` DeepSpeed is given under parallel.tp > 1 (Megatron's interface, held by an object).

    ZeRO partitions and averages gradients over `get_data_parallel_group` (the ranks of one
    tensor-parallel rank: they hold the same shards), and its gradient norm adds the squares of
    the sharded parameters (`tensor_model_parallel`, set by AutoTP's layers) over
    `get_model_parallel_group`, counting the whole ones on tensor-parallel rank 0 only.
    """

    def __init__(self, tp_group, dp_group):
        self._tp, self._dp = tp_group, dp_group

    def get_model_parallel_group(self):
        return self._tp

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self._tp)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._tp)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp)


class SequenceTensorParallelMpu(SequenceGroups, TensorParallelMpu):
    """The `mpu` DeepSpeed is given under parallel.tp > 1 and parallel.sp > 1: Megatron's
    model-parallel interface for the TP group (`TensorParallelMpu`) and DeepSpeed's
    sequence-parallel one for the Ulysses group, held by one object.

    ZeRO partitions and reduces over the sequence x data group, the dp x sp ranks of this rank's
    TP rank (they hold the same shards), and divides by its size / sp = dp; the gradient norm adds
    the TP shards over the TP group. It has no `initialize_sequence_parallel` on purpose:
    DeepSpeed reads that attribute as "a sequence-parallel mpu, no model parallelism" and would
    then ignore the TP group (a model-parallel world of 1 in ZeRO's gradient norm).
    """

    def __init__(self, tp_group, dp_group, sp_group, seq_data_group):
        super().__init__(tp_group, dp_group)
        self._sp, self._seq_data = sp_group, seq_data_group


def loader_comms(plan: ParallelPlan, rank: int
                 ) -> tuple["TorchDataComm", "TorchDataComm | None", "TorchShardComm | None"]:
    """The loader's groups, made by a world of loader processes (`ds_omni.data.loader_process`,
    one per rank, in the same order on every one): (its state's and its steps' all-gathers;
    the steps' again as groups of their own, for its step-ahead thread, None with one
    data-parallel rank; its SP group's scatter, None without SP)."""
    dp, reorder = data_groups(plan, rank)
    comm = TorchDataComm(plan, dp, reorder)
    step_comm = loader_step_comm(plan, rank) if plan.dp > 1 else None
    return comm, step_comm, loader_shard_comm(plan, rank)
