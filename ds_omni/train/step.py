"""One optimizer step: this rank's micro-batches -> loss normalised by the global target count
-> DeepSpeed's backward and step (or its pipeline schedule).

On every data-parallel rank:
  1. the ranks all-reduce their target-token counts (and any data error, so all stop together):
     the loss is normalised by the global count, so the gradient equals one process running the
     whole global batch, whatever the split;
  2. each micro-batch runs encode -> (under SP: reshard onto the sequence shards) -> scatter into
     the text -> LLM -> summed token loss, then DeepSpeed's backward and step (which reduces
     gradients at the accumulation boundary, over data x sequence ranks).
Under parallel.pp > 1 step 2 is DeepSpeed's pipeline schedule (`train_batch`) over the stages of
`ds_omni.parallelize.pipeline`; every stage's ranks load the same micro-batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ds_omni.data.loader import StepBatch
from ds_omni.errors import DataError, LaunchError
from ds_omni.parallel import dist
from ds_omni.parallel.groups import RankGroups, TorchDataComm
from ds_omni.parallelize import router_of
from ds_omni.parallelize.pipeline import (around_instructions, engine_inputs, fill_missing_grads,
                                         is_pipeline, late_grads_to_master, optimizer_params)
from ds_omni.parallelize.pipeline_moe import one_backward
from ds_omni.train.nonfinite import NonFiniteError, NonFiniteGuard


@dataclass
class StepResult:
    loss: float
    tokens: int
    targets: int
    samples: int
    cost_max_over_mean: float  # modelled cost of the busiest rank / the mean rank (1.0 = even)
    nonfinite_keys: list[str] | None = None  # the samples of a step whose update was dropped


class StopTraining(Exception):
    """A data source ran out under on_exhausted="stop": end the run with a checkpoint."""


def engine_loss(loss_sum: torch.Tensor, grad_divisor: int, global_targets: float) -> torch.Tensor:
    """The loss handed to `engine.backward` (without DeepSpeed's accumulation scaling).

    DeepSpeed sums the ranks' gradients and divides by `grad_divisor` ranks (`gradient_divisor`);
    multiplying by it undoes that, so the reduced gradient is d(sum of all token losses of the
    global batch) / global target tokens, whatever the plan.
    """
    return loss_sum * (grad_divisor / max(global_targets, 1.0))


def gradient_divisor(engine, dp_size: int, sp_size: int) -> int:
    """How many ranks DeepSpeed divides the summed gradient by.

    Without SP: the dp ranks. Under SP, DeepSpeed 0.19.8 is not consistent: ZeRO 0-2 (and ZeRO-3's
    contiguous all-reduce) divide by dp only, i.e. *sum* over the SP ranks of a group, but
    ZeRO-3's reduce-scatter (`__avg_scatter_grads`, which ds_omni makes the one ZeRO-3 path under
    SP by setting `zero_optimization.reduce_scatter`) averages over all dp x sp ranks. The
    pipeline engine (ZeRO 0/1) averages over its data axis: dp x sp (`parallelize.pipe_grid`).
    """
    if sp_size > 1 and engine.zero_optimization_stage() == 3:
        return dp_size * sp_size
    if is_pipeline(engine):  # its data axis holds the dp x sp ranks (`parallelize.pipe_grid`)
        return dp_size * sp_size
    return dp_size


def train_step(engine, batch: StepBatch, groups: RankGroups, on_reduced_grads=None,
               guard: NonFiniteGuard | None = None) -> StepResult:
    """One optimizer step on this rank's micro-batches (every rank calls it, in lockstep), its
    totals reduced over `groups` (this rank's, `rank_groups`).

    `on_reduced_grads(engine)`, if given, runs after the last backward and before the optimizer
    step, when the gradients are reduced over the ranks (for tests that compare them). `guard`
    checks the losses and gradients before the optimizer step (`ds_omni.train.nonfinite`).
    """
    comm = groups.comm
    samples, cost_sum, cost_max, n_micro, targets, tokens = _step_totals(batch, comm)
    scale = engine_loss(1.0, gradient_divisor(engine, comm.dp_size, comm.sp_size), targets)
    if is_pipeline(engine):
        loss_sum, dropped = _pipeline_step(engine, batch, comm, scale, on_reduced_grads, guard)
        loss_group = None  # only the last stage has losses: the world's sum is the global one
    else:
        loss_sum, dropped = _micro_batch_steps(engine, batch, comm, scale, int(n_micro),
                                               on_reduced_grads, guard)
        loss_group = comm.token_group
    (global_loss_sum,) = dist.all_reduce_sum([loss_sum], loss_group)
    return StepResult(loss=global_loss_sum / max(targets, 1.0), tokens=int(tokens),
                      targets=int(targets), samples=int(samples), nonfinite_keys=dropped,
                      cost_max_over_mean=cost_max / (cost_sum / comm.dp_size) if cost_sum else 1.0)


def _step_totals(batch: StepBatch, comm: TorchDataComm) -> tuple[float, ...]:
    """(samples, modelled cost sum, its max, most micro-batches, target tokens, tokens) over the
    data-parallel ranks; a data problem or stop on any rank stops every rank here, before a
    collective of the step could hang.

    Two collectives (three under SP): the token-group sums ride with a sum already made over
    that group (the data-parallel one without SP, the SP peers' error check under SP)."""
    dp_group, token_group = comm.dp_group, comm.token_group
    counts = [sum(mb.num_targets for mb in batch.micro_batches),
              sum(mb.num_tokens for mb in batch.micro_batches)]
    local = [len(batch.keys), batch.modelled_cost, float(batch.error is not None),
             float(batch.stop is not None)]
    if token_group is dp_group:  # no SP
        samples, cost_sum, errors, stops, targets, tokens = dist.all_reduce_sum(local + counts,
                                                                                dp_group)
    else:  # SP peers share every forward: one's data problem must stop the others
        samples, cost_sum = dist.all_reduce_sum(local[:2], dp_group)
        errors, stops, targets, tokens = dist.all_reduce_sum(local[2:] + counts, token_group)
    # a data problem on any rank stops every rank here, before a collective could hang
    if errors:
        raise DataError(_first_error(batch, comm))
    if stops:
        raise StopTraining(batch.stop or "a data source ran out on another rank")
    if not samples:
        raise StopTraining("every data source is exhausted (on_exhausted='drop')")
    cost_max, n_micro = dist.all_reduce_max([batch.modelled_cost, len(batch.micro_batches)],
                                            dp_group)
    return samples, cost_sum, cost_max, n_micro, targets, tokens


def _micro_batch_steps(engine, batch, comm, scale, n_micro, on_reduced_grads, guard):
    """Forward and backward of each micro-batch, the step at the boundary; returns (this rank's
    summed token loss, the samples of a dropped update or None). `scale` turns a summed loss into
    the loss DeepSpeed is given (`engine_loss`)."""
    micro_batches = _even_micro_batches(batch, n_micro)
    count = len(micro_batches)
    router = router_of(engine.module)
    if router is not None:  # the plan's features route each micro-batch as the loop takes it
        micro_batches = router.prepare_step(micro_batches)
    losses, dropped = [], None
    for i, mb in enumerate(micro_batches):
        last = i == count - 1
        if batch.filler is not None:  # per-sequence SP: the step's length is ours, not the config's
            engine.set_gradient_accumulation_boundary(last)
        out = engine(mb.to(engine.device))
        if guard is not None:
            guard.watch_loss(out.loss_sum)
        if last and router is not None and not router.encoder_dummies:  # before the reduction
            fill_missing_grads(engine.module.encoders.parameters())
        engine.backward(out.loss_sum * scale, scale_wrt_gas=False)
        if last and on_reduced_grads is not None:
            on_reduced_grads(engine)
        if last and guard is not None and guard.tripped():
            dropped = _nonfinite_step(guard, batch, comm)
            with guard.dropped_update():
                engine.step()
        else:
            engine.step()
        losses.append(out.loss_sum.detach())  # read once after the last step: no sync per micro-batch
    return float(torch.stack(losses).double().sum()), dropped


def _pipeline_step(engine, batch, comm, scale, on_reduced_grads, guard):
    """The step through DeepSpeed's pipeline schedule (`train_batch`: every micro-batch, the
    reductions and the optimizer step); returns (this rank's summed token loss, which only the
    last stage has, else 0; the samples of a dropped update or None)."""
    module, gas = engine.module, engine.gradient_accumulation_steps()
    if len(batch.micro_batches) != gas:
        raise LaunchError(f"the pipeline engine runs {gas} micro-batches a step but the loader "
                          f"made {len(batch.micro_batches)}; under parallel.pp > 1 use "
                          "data.reorder.mode \"fixed\" or \"loader_order\"")
    inputs = module.step_inputs
    inputs.scale = gas * scale  # the engine divides the last stage's loss by the accumulation steps
    placed = batch.micro_batches
    if module.pool is not None:  # the pool places every round before the schedule starts
        placed = list(module.pool.prepare(placed))
    inputs.batches = [mb.to(engine.device) for mb in placed]
    dropped = []
    try:
        if module.clock is not None:  # the step's span, for bubble_fraction
            module.clock.begin()
        if module.joint is not None:  # "uniform": every stage encodes its share now
            inputs.joint = module.clock.timed(lambda: module.joint.start(inputs.batches,
                                                                         engine.device),
                                              "encode_fwd")
            module.joint.bind(engine)
        around_instructions(engine, _pipeline_hooks(module, batch, comm, on_reduced_grads, guard,
                                                    dropped))
        engine.train_batch(data_iter=iter(engine_inputs(batch.micro_batches)))
        # the TP ranks of the last stage hold the same losses: one of them reports
        sums = inputs.sums if engine.grid.get_slice_parallel_rank() == 0 else []
        return float(torch.stack(sums).double().sum()) if sums else 0.0, dropped or None
    finally:
        inputs.sums, inputs.batches, inputs.joint = [], [], None


def _pipeline_hooks(module, batch, comm, on_reduced_grads, guard, dropped: list) -> dict:
    """What runs inside `train_batch`: each backward of a stage over its outputs as one pass
    (`one_backward`), the encoders' backward of "uniform" placement after the last backward
    (before any reduction; their gradients summed onto each parameter's owner stage), before
    the optimizer step the reduced-gradient callback and the non-finite guard
    (which may drop the update, recording its samples), and after it, under "uniform", each
    owner's updated encoder parameters broadcast to the other stages."""
    from deepspeed.runtime.pipe import schedule
    hooks = {}
    joint = module.joint

    def encoders_backward(engine, run):
        if joint is not None:
            with late_grads_to_master(engine.optimizer):  # bf16: else they are dropped
                module.clock.timed(lambda: joint.finish(module.step_inputs.joint), "encode_bwd")
        fill_missing_grads(optimizer_params(module))  # an encoder with no item in the whole step
        run()
    hooks[schedule.ReduceTiedGrads] = encoders_backward
    clock = module.clock

    def backward(engine, run):  # the stage's outputs' backward as one pass (`one_backward`)
        with one_backward(engine):
            run() if clock is None else clock.timed(run, "backward")
    hooks[schedule.BackwardPass] = backward
    if clock is not None:  # the schedule's own timestamps (bubble_fraction)
        hooks[schedule.ForwardPass] = lambda engine, run: clock.timed(run, "forward")

        def reduce_tied(engine, run, backward=encoders_backward):
            backward(engine, run)
            clock.finish()
        hooks[schedule.ReduceTiedGrads] = reduce_tied

    if joint is not None:
        def reduce_grads(engine, run):
            with joint.shards.replicas_frozen():
                run()
        hooks[schedule.ReduceGrads] = reduce_grads

    def optimizer_step(engine, run):
        if on_reduced_grads is not None:
            on_reduced_grads(engine)
        tripped = False
        if guard is not None:
            for loss_sum in module.step_inputs.sums:
                guard.watch_loss(loss_sum)
            tripped = guard.tripped()
        if tripped:
            dropped.extend(_nonfinite_step(guard, batch, comm))
            with guard.dropped_update():
                run()
        else:
            run()
        if joint is not None:  # a dropped update broadcasts the unchanged values: harmless
            joint.shards.broadcast_params()
    hooks[schedule.OptimizerStep] = optimizer_step
    return hooks


def _even_micro_batches(batch: StepBatch, n_micro: int) -> list:
    """The rank's micro-batches, topped up with zero-weight fillers to `n_micro`, the most any rank
    has this step (per-sequence SP: ranks in more long-sequence rounds run more). Every rank then
    runs the same number of forward and backward passes, which ZeRO-2's per-backward reductions
    and ZeRO-3's parameter gathers need."""
    missing = n_micro - len(batch.micro_batches)
    if missing and batch.filler is None:
        raise RuntimeError(f"this rank has {len(batch.micro_batches)} micro-batches and another "
                           f"{n_micro}, but no filler: only per-sequence SP varies the count")
    return batch.micro_batches + [dataclasses.replace(batch.filler) for _ in range(missing)]


def _nonfinite_step(guard: NonFiniteGuard, batch: StepBatch, comm: TorchDataComm) -> list[str]:
    """The step's sample keys (all ranks); under "stop", the error that names them."""
    keys = sorted({k for part in comm.world_all_gather(batch.keys) for k in part})
    if guard.policy == "stop":
        raise NonFiniteError(
            f"the loss or gradients of step {batch.step} are not finite (NaN/inf); nothing was "
            f"updated. Its {len(keys)} samples: {keys}. To drop such steps and go on, set "
            "train.on_nonfinite to \"skip\"")
    return keys


def _first_error(batch: StepBatch, comm: TorchDataComm) -> str:
    """This rank's data error, else another rank's (every rank of the token group calls this
    when any has one)."""
    if comm.sp_size > 1:
        messages = [None] * torch.distributed.get_world_size(comm.token_group)
        torch.distributed.all_gather_object(messages, batch.error, group=comm.token_group)
    else:
        messages = comm.world_all_gather(batch.error)
    messages = [m for m in messages if m]
    return batch.error or (messages[0] if messages else "another rank hit a data error")
