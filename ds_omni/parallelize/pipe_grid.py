"""The pipeline engine's grid for a plan with tensor and sequence parallelism inside its stages.

DeepSpeed's pipeline engine builds its process groups from a `ProcessTopology` of pipe, data and
model axes and refuses an mpu. ds_omni hands it Megatron-DeepSpeed's topology: the "model" axis
is parallel.tp and the "data" axis is the dp x sp ranks of a (stage, TP rank): Ulysses SP folded
into the data axis. The ranks land where `ParallelPlan` puts them (tp innermost, then sp, dp, pp),
so the engine's groups are ds_omni's: its data group is the sequence x data group ZeRO reduces
over (SP ranks hold the same parameters and different tokens: their gradients add up like data
parallelism's), its p2p pairs join SP shard i of stage s to SP shard i of stage s + 1, its slice
group is the TP group. The Ulysses all-to-alls keep ds_omni's own SP groups. More:
docs/parallelism.md, "Pipeline parallelism".
"""

from __future__ import annotations

from torch import nn

from ds_omni.parallel.plan import ParallelPlan, RankCoords


def pipe_topology(plan: ParallelPlan):
    """The engine's topology: pp stages x (dp x sp) data x tp model
    (`PipeModelDataParallelTopology`; without tp `PipeDataParallelTopology`, whose checkpoint
    files name no model rank), which numbers every rank as `plan.rank_of` does (checked here:
    a mismatch would pair the wrong ranks without an error)."""
    from deepspeed.runtime.pipe.topology import (PipeDataParallelTopology,
                                                 PipeModelDataParallelTopology)
    data = plan.dp * plan.sp
    topology = (PipeModelDataParallelTopology(num_pp=plan.pp, num_mp=plan.tp, num_dp=data)
                if plan.tp_enabled else PipeDataParallelTopology(num_pp=plan.pp, num_dp=data))
    for rank in range(plan.world_size):
        c = plan.coords(rank)
        coord = {"pipe": c.pp_stage, "data": c.dp_rank * plan.sp + c.sp_rank,
                 **({"model": c.tp_rank} if plan.tp_enabled else {})}
        got = topology.get_rank(**coord)
        assert got == rank, f"the pipeline topology puts {c} at rank {got}, the plan at {rank}"
    return topology


def stage_peer(plan: ParallelPlan, rank: int, stage: int) -> int:
    """The rank of `stage` holding what `rank` holds of a row (the same dp, SP and TP ranks):
    where the engine sends `rank`'s activations."""
    c = plan.coords(rank)
    return plan.rank_of(RankCoords(stage, c.dp_rank, c.sp_rank, c.tp_rank))


def mark_norm_owners(module: nn.Module, tp_rank: int) -> None:
    """Which of the stage's parameters DeepSpeed's gradient norm counts on this rank, under
    parallel.tp (it counts a parameter marked `model_parallel`, plus every one on the grid's
    model-parallel rank 0, and sums over the stages x TP ranks): an AutoTP shard on every TP
    rank, a whole parameter (the same on every TP rank) on TP rank 0 only, else it would count
    tp times. Narrows the marks already made (the stage's, "uniform"'s encoder owners)."""
    from ds_omni.parallelize.tensor_parallel import tp_layout
    sharded = set(tp_layout(module))
    for name, p in module.named_parameters():
        p.model_parallel = getattr(p, "model_parallel", True) and (tp_rank == 0 or name in sharded)
