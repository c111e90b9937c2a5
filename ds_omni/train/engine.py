"""Training: config -> DeepSpeed engine -> steps -> checkpoints -> report and HF export.

One step, on every data-parallel rank:
  1. the loader reads, balances (grouped reordering) and packs this rank's micro-batches; under
     Ulysses SP the ranks of one SP group read the same rows and each keeps its shard of them;
  2. the ranks all-reduce their target-token counts (and any data error, so all stop together):
     the loss is normalised by the global count, so the gradient equals one process running the
     whole global batch, whatever the split;
  3. each micro-batch runs encode -> (under SP: reshard onto the sequence shards) -> scatter into
     the text -> LLM -> summed token loss, then DeepSpeed's backward and step (which reduces
     gradients at the accumulation boundary, over data x sequence ranks).
Under parallel.pp > 1 step 3 is DeepSpeed's pipeline schedule (`train_batch`) over the stages of
`ds_omni.parallelize.pipeline`; every stage's ranks load the same micro-batches, so 1-2 are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_omni.config import OmniConfig
from ds_omni.data.build import build_loader, cost_model_for
from ds_omni.data.loader import StepBatch, check_per_sequence, reorder_group_size
from ds_omni.data.check import startup_check
from ds_omni.data.prefetch import Prefetcher
from ds_omni.data.skipped import SKIPPED_FILE, flush_skipped, skipped_totals
from ds_omni.data.templates import carry_template, training_template
from ds_omni.ds_config import derive_ds_config, load_ds_json
from ds_omni.errors import DataError, LaunchError
from ds_omni.parallel import dist
from ds_omni.model.attention import resolve_kernel
from ds_omni.model.build import check_sequence_parallel, llm_text_config
from ds_omni.parallelize import parallelize, router_of
from ds_omni.parallelize.encoder_pool import EncoderPool
from ds_omni.parallel.groups import (TorchDataComm, data_groups, loader_step_comm, sequence_blocks,
                                    sequence_groups)
from ds_omni.parallelize.pipeline import (PipelineSpec, around_instructions, check_pipeline,
                                         engine_inputs, fill_missing_grads, is_pipeline,
                                         late_grads_to_master, layer_param_counts,
                                         optimizer_params)
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallel.stages import StagePlan, stage_plan_for
from ds_omni.train import checkpoint
from ds_omni.train.control import WeightsFile
from ds_omni.train.evaluate import build_evaluator
from ds_omni.train.metrics import MetricsLogger, write_report
from ds_omni.train.nonfinite import NonFiniteError, NonFiniteGuard
from ds_omni.train.watchdog import Watchdog

DEFAULT_DIST_TIMEOUT_S = 1800.0
log = logging.getLogger(__name__)


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
    SP by setting `zero_optimization.reduce_scatter`) averages over all dp x sp ranks.
    """
    if sp_size > 1 and engine.zero_optimization_stage() == 3:
        return dp_size * sp_size
    return dp_size


def train_step(engine, batch: StepBatch, comm: TorchDataComm, on_reduced_grads=None,
               guard: NonFiniteGuard | None = None) -> StepResult:
    """One optimizer step on this rank's micro-batches (every rank calls it, in lockstep).

    `on_reduced_grads(engine)`, if given, runs after the last backward and before the optimizer
    step, when the gradients are reduced over the ranks (for tests that compare them). `guard`
    checks the losses and gradients before the optimizer step (`ds_omni.train.nonfinite`).
    """
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
    collective of the step could hang."""
    dp_group, token_group = comm.dp_group, comm.token_group
    local = [len(batch.keys), batch.modelled_cost, float(batch.error is not None),
             float(batch.stop is not None)]
    samples, cost_sum, errors, stops = dist.all_reduce_sum(local, dp_group)
    if comm.sp_size > 1:  # SP peers share every forward: one's data problem must stop the others
        errors, stops = dist.all_reduce_sum(local[2:], token_group)
    # a data problem on any rank stops every rank here, before a collective could hang
    if errors:
        raise DataError(_first_error(batch, comm))
    if stops:
        raise StopTraining(batch.stop or "a data source ran out on another rank")
    if not samples:
        raise StopTraining("every data source is exhausted (on_exhausted='drop')")
    cost_max, n_micro = dist.all_reduce_max([batch.modelled_cost, len(batch.micro_batches)],
                                            dp_group)
    targets, tokens = dist.all_reduce_sum([sum(mb.num_targets for mb in batch.micro_batches),
                                           sum(mb.num_tokens for mb in batch.micro_batches)],
                                          token_group)
    return samples, cost_sum, cost_max, n_micro, targets, tokens


def _micro_batch_steps(engine, batch, comm, scale, n_micro, on_reduced_grads, guard):
    """Forward and backward of each micro-batch, the step at the boundary; returns (this rank's
    summed token loss, the samples of a dropped update or None). `scale` turns a summed loss into
    the loss DeepSpeed is given (`engine_loss`)."""
    micro_batches = _even_micro_batches(batch, n_micro)
    if engine.zero_optimization_stage() == 3 and (comm.sp_size > 1 or batch.filler is not None):
        _even_encoder_calls(engine.module, micro_batches, comm.dp_group)
    router = router_of(engine.module)
    pool = router.encoder_pool if router is not None else None
    rounds = pool.plan_step(micro_batches) if pool is not None else None
    losses, dropped = [], None
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        if rounds is not None:  # parallel.encoder_pool: this round's items over all dp ranks
            mb = pool.place(mb, rounds[i])
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
    inputs.batches = [mb.to(engine.device) for mb in batch.micro_batches]
    dropped = []
    try:
        if module.joint is not None:  # "uniform": every stage encodes its share now
            inputs.joint = module.joint.start(inputs.batches, engine.device)
        around_instructions(engine, _pipeline_hooks(module, batch, comm, on_reduced_grads, guard,
                                                    dropped))
        engine.train_batch(data_iter=iter(engine_inputs(batch.micro_batches)))
        sums = inputs.sums
        return float(torch.stack(sums).double().sum()) if sums else 0.0, dropped or None
    finally:
        inputs.sums, inputs.batches, inputs.joint = [], [], None


def _pipeline_hooks(module, batch, comm, on_reduced_grads, guard, dropped: list) -> dict:
    """What runs inside `train_batch`: the encoders' backward of "uniform" placement after the
    last backward (before any reduction; their gradients summed onto each parameter's owner
    stage), before the optimizer step the reduced-gradient callback and the non-finite guard
    (which may drop the update, recording its samples), and after it, under "uniform", each
    owner's updated encoder parameters broadcast to the other stages."""
    from deepspeed.runtime.pipe import schedule
    hooks = {}
    joint = module.joint

    def encoders_backward(engine, run):
        if joint is not None:
            with late_grads_to_master(engine.optimizer):  # bf16: else they are dropped
                joint.finish(module.step_inputs.joint)
        fill_missing_grads(optimizer_params(module))  # an encoder with no item in the whole step
        run()
    hooks[schedule.ReduceTiedGrads] = encoders_backward

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


def encoder_dummies_needed(ds_config: dict, pipeline: bool) -> bool:
    """Whether every micro-batch must run every encoder, on a zero-weight dummy where it has no
    item (`EmbeddingRouter.encoder_dummies`), for DeepSpeed's collectives to line up over the
    ranks.

    ZeRO-3 gathers an encoder's parameters at each run, all ranks together; ZeRO-2 reduces at
    every backward, ZeRO-1 with `overlap_comm` (or a `grad_accum_dtype`) at the last, both in the
    order gradient hooks fire, so every rank's backward must reach the same parameters.
    Otherwise ZeRO-0/1 reduce once a step, in parameter order, each parameter that has a
    gradient (the pipeline engine always: ZeRO 0/1, after its last backward), so an encoder with
    no item only needs a gradient, and a zero one (`fill_missing_grads`) is exactly what its
    dummy would give. bf16 ZeRO-0 (DeepSpeed's BF16_Optimizer) keeps them: untested without.
    """
    if pipeline:
        return False
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or stage >= 2 or zero.get("overlap_comm", False):
        return True
    if stage == 1:
        return bool(ds_config.get("data_types", {}).get("grad_accum_dtype"))
    return bool(ds_config.get("bf16", {}).get("enabled", False))


def _even_encoder_calls(model, micro_batches: list, group) -> None:
    """Set every micro-batch's `encode_calls` to the most runs of each encoder any rank makes in
    that round. Long-short SP runs an encoder once more per long item on the ranks that share the
    item's row; ZeRO-3 gathers the encoder's parameters at every run, on all ranks together."""
    names = list(model.encoders)
    runs = [1 + len(mb.reshard.split.get(name, [])) if mb.reshard is not None else 1
            for mb in micro_batches for name in names]
    most = dist.all_reduce_max(runs, group) if runs else []
    for i, mb in enumerate(micro_batches):
        mb.encode_calls = {name: int(most[i * len(names) + j]) for j, name in enumerate(names)}


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


def preflight(cfg: OmniConfig, ds_config_path: str,
              resume: bool = False) -> tuple[ParallelPlan, dict]:
    """Every check that needs no process group, so a bad input fails on all ranks at once."""
    plan = ParallelPlan.from_config(cfg.parallel, dist.world_size_from_env())
    if plan.sp_enabled:
        check_sequence_parallel(cfg.model, plan.sp)
    if cfg.parallel.max_sequence_sp > 1:
        check_sequence_parallel(cfg.model, cfg.parallel.max_sequence_sp)
        check_per_sequence(cfg.data.reorder.mode, reorder_group_size(cfg.data, plan.dp),
                           cfg.parallel.max_sequence_sp)
    resolve_kernel(cfg.model.attn_implementation)  # varlen on CPU, flash-attn missing: say so now
    ds_config = derive_ds_config(cfg, load_ds_json(ds_config_path), plan)
    if plan.pp_enabled:
        check_pipeline(cfg, ds_config, llm_text_config(cfg.model)[1])
    checkpoint.check_writable(cfg.train.output_dir)
    if resume:
        checkpoint.check_resumable(cfg.train.output_dir)
    reorder_group_size(cfg.data, plan.dp)
    startup_check(cfg)  # files, schema columns, relative media roots of every source
    return plan, ds_config


def setup_training(cfg: OmniConfig, ds_config: dict, rank: int, plan: ParallelPlan):
    """(built model, loader, DeepSpeed engine) of this rank; call after `init_distributed`."""
    import deepspeed
    from ds_omni.model.build import build_model
    from deepspeed.utils import groups as ds_groups
    coords = plan.coords(rank)
    group_size = reorder_group_size(cfg.data, plan.dp)
    dp_group, reorder_group = data_groups(plan, rank, group_size)
    mpu = sequence_groups(plan, rank)
    # per-sequence SP: a group for every block a long sequence may get, made once on every rank
    blocks = (sequence_blocks(plan.world_size, rank, cfg.parallel.max_sequence_sp)
              if cfg.parallel.max_sequence_sp > 1 else {})
    comm = TorchDataComm(dp_group, reorder_group, plan.dp, group_size,
                         mpu.get_sequence_data_parallel_group() if mpu else None, plan.sp)
    step_comm = loader_step_comm(plan, rank, group_size) if cfg.data.prefetch_steps else None
    # rank 0 makes builtin assets first; the others then only read them
    if rank != 0:
        dist.barrier()
    built = build_model(cfg.model)
    built.model.train()  # from_pretrained hands models over in eval mode: dropout would stay off
    # the tokenizer carries the template trained with into checkpoints and the HF export
    carry_template(built.tokenizer, training_template(cfg.data.template, built))
    pool = None
    if cfg.parallel.encoder_pool == "dp":
        pool = encoder_pool_for(cfg, built, plan, rank,
                                mpu.get_sequence_data_parallel_group() if mpu else dp_group)
    loader = build_loader(cfg, built, dp_rank=coords.dp_rank, dp_size=plan.dp,
                          num_micro=ds_config["gradient_accumulation_steps"], comm=comm,
                          sp_rank=coords.sp_rank, sp_size=plan.sp, step_comm=step_comm)
    if rank == 0:
        dist.barrier()
    torch.manual_seed(cfg.train.seed + rank)
    ds_groups.mpu = None  # DeepSpeed keeps the last engine's mpu in a module global: don't inherit it
    pipeline = None
    if plan.pp_enabled:  # this rank's stage of the pipeline, split where the cost model says
        cost = cost_model_for(built, cfg.model.frozen_parts(), cfg.data.reorder.cost_scales)
        pipeline = PipelineSpec(
            plan, stage_plan(cfg, built, plan), cfg.parallel.encoder_placement,
            built.item_processors,
            lambda name, item: float(cost.encoder_cost(name, item.cost_seqs()).sum()))
    # the plan applied to the built model (the LLM's attention goes Ulysses under SP; encoders
    # keep theirs): the model, or this rank's pipeline stage
    module = parallelize(built.model, kernel=cfg.model.attn_implementation,
                         sp_group=mpu.get_sequence_parallel_group() if plan.sp_enabled else None,
                         blocks=blocks, pool=pool,
                         encoder_dummies=encoder_dummies_needed(ds_config, plan.pp_enabled),
                         pipeline=pipeline)
    params = optimizer_params(module)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=ds_config,
                                      mpu=mpu)
    align_lr_schedule(engine)
    return built, loader, engine


def encoder_pool_for(cfg: OmniConfig, built, plan: ParallelPlan, rank: int,
                     group) -> EncoderPool | None:
    """`parallel.encoder_pool="dp"`: this rank's pool over `group`, every rank of the (single)
    pipeline stage: the data-parallel ranks, under sp > 1 those times the SP ranks, whose groups
    are consecutive pool ranks (under max_sequence_sp > 1 a block's micro-batch names its group,
    `sp_block`); priced by the loader's cost model. None (said once) when there
    is one data-parallel rank: the row's SP group (if any) already spreads its items."""
    if plan.dp == 1:
        if rank == 0:
            log.warning("parallel.encoder_pool=\"dp\" with one data-parallel rank: there is no "
                        "other row to share encoder work with; the pool is off")
        return None
    cost = cost_model_for(built, cfg.model.frozen_parts(), cfg.data.reorder.cost_scales)
    encoders = built.model.encoders
    return EncoderPool(group, rank, plan.dp * plan.sp, built.item_processors,
                       {name: enc.placeholder_ids for name, enc in encoders.items()},
                       lambda name, item: float(cost.encoder_cost(name, item.cost_seqs()).sum()),
                       dist.comm_device(), sp=plan.sp)


def stage_plan(cfg: OmniConfig, built, plan: ParallelPlan, split: str | None = None) -> StagePlan:
    """Pipeline stage boundaries by `split` (default `parallel.stage_split`), and each stage's
    predicted time for a typical micro-batch (micro_batch_size samples of `stage_tokens` tokens,
    one item per encoder each), from the loader's cost model."""
    cost = cost_model_for(built, cfg.model.frozen_parts(), cfg.data.reorder.cost_scales)
    split = split or cfg.parallel.stage_split
    layer_params, encoder_params = (layer_param_counts(built.model) if split == "parameters"
                                    else (None, 0))
    return stage_plan_for(cost, plan.pp, cfg.parallel.encoder_placement,
                          cfg.train.micro_batch_size, stage_tokens(cfg), split=split,
                          layer_params=layer_params, encoder_params=encoder_params)


def stage_tokens(cfg: OmniConfig) -> int:
    """Tokens of the typical sample the stage boundaries are planned for."""
    return cfg.parallel.stage_tokens or cfg.data.max_seq_len


def align_lr_schedule(engine) -> None:
    """Make optimizer step k run at the LR schedule's iteration k.

    DeepSpeed's schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR) put the LR of iteration -1
    (the warm-up's start, 0 in the shipped configs) into the optimizer when they are built, and
    the engine steps them after each optimizer step; so step k ran at iteration k - 1: steps 0
    and 1 both at the start (with lr 0, two steps that learn nothing from their samples) and the
    whole schedule one step late. One scheduler step before training puts it on time.
    """
    scheduler = engine.lr_scheduler
    if getattr(scheduler, "last_batch_iteration", None) == -1:
        scheduler.step()


def run(cfg: OmniConfig, ds_config_path: str, *, resume: bool = False,
        stop_after: int | None = None) -> dict:
    """Train as `cfg` says; returns the report (on rank 0; {} elsewhere)."""
    plan, ds_config = preflight(cfg, ds_config_path, resume)
    rank, world = dist.init_distributed(float(os.environ.get("DS_OMNI_DIST_TIMEOUT",
                                                             DEFAULT_DIST_TIMEOUT_S)))
    watchdog = Watchdog.start(rank, world, cfg.train.peer_timeout_s)
    try:
        report = _run(cfg, ds_config, plan, rank, resume, stop_after, watchdog)
    except BaseException as e:
        if watchdog is not None:
            cause = watchdog.diagnose()
            if cause:  # a collective failed because a peer died: say which
                print(f"ds-omni: rank {rank}: {cause}", file=sys.stderr, flush=True)
            watchdog.close(failed=f"{type(e).__name__}: {e}")
        raise
    if watchdog is not None:
        watchdog.close()
    return report


def _run(cfg, ds_config, plan, rank, resume, stop_after, watchdog) -> dict:
    built, loader, engine = setup_training(cfg, ds_config, rank, plan)
    out = Path(cfg.train.output_dir)
    start = 0
    if resume:
        with _solo(watchdog):  # rank 0 may convert it first (another number of ranks)
            start = resume_from(engine, loader, out, rank)
    elif rank == 0:
        (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / SKIPPED_FILE).unlink(missing_ok=True)
    if rank == 0:
        checkpoint.save_model_meta(checkpoint.checkpoint_root(out), built)
    logger = MetricsLogger(out, total_steps=cfg.train.steps, start_step=start, enabled=rank == 0,
                           monitor=getattr(engine, "monitor", None))
    step = _loop(cfg, engine, loader, logger, plan, rank, start, stop_after, watchdog,
                 build_evaluator(cfg, built, loader))
    logger.close()
    loader.close()
    with _solo(watchdog):
        return _finish(cfg, engine, loader, rank, step, plan)


def _solo(watchdog):
    """A phase where one rank may work while the others wait (see `Watchdog.solo`)."""
    return watchdog.solo() if watchdog is not None else contextlib.nullcontext()


def resume_from(engine, loader, output_dir, rank: int) -> int:
    """Load the newest complete checkpoint of `output_dir` into `engine` and `loader` (the data
    position); returns its step. Every rank calls this."""
    start, loader_state = checkpoint.load(engine, output_dir, rank)
    restore_loader(loader, loader_state)
    if getattr(engine.module, "joint", None) is not None:  # "uniform": stage 0 holds them
        engine.module.joint.sync_replicas()
    return start


def restore_loader(loader, state: dict) -> None:
    """The data position of a checkpoint; a loader_state.json that parses but lacks what the
    loader needs is damaged, and said so (not a KeyError from deep inside)."""
    try:
        loader.load_state_dict(state)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise LaunchError(f"--resume: the checkpoint's loader_state.json is damaged "
                          f"({type(e).__name__}: {e}); move that checkpoint directory aside to resume from the one "
                          "before it") from None


def _loop(cfg, engine, loader, logger, plan, rank, start, stop_after, watchdog=None,
          evaluator=None) -> int:
    """Train from `start`; the loader's next steps are made ahead on a thread
    (`data.prefetch_steps`), and it is left at the position of the steps trained."""
    end = cfg.train.steps if stop_after is None else min(cfg.train.steps, start + stop_after)
    feed = Prefetcher(loader, cfg.data.prefetch_steps, until=end, timeout_s=float(
        os.environ.get("DS_OMNI_DIST_TIMEOUT", DEFAULT_DIST_TIMEOUT_S)))
    try:
        step = _steps(cfg, engine, feed, logger, rank, start, end, watchdog, evaluator)
    except BaseException:
        feed.close(abort=True)
        raise
    feed.close()
    return step


def _steps(cfg, engine, loader, logger, rank, start, end, watchdog, evaluator) -> int:
    step = start
    weights_file = WeightsFile(cfg.train.output_dir, rank)
    guard = NonFiniteGuard(engine, cfg.train.on_nonfinite)
    while step < end:
        if watchdog is not None:
            watchdog.step = step
        t0 = time.perf_counter()
        weights_file.poll(loader)
        batch = loader.next_step()
        lr = engine.get_lr()[0]  # the LR this step uses (DeepSpeed moves it on after the step)
        try:
            result = train_step(engine, batch, loader.comm, guard=guard)
        except StopTraining as e:
            if rank == 0:
                print(f"ds-omni: stopping at step {step}: {e}")
            loader.rewind()  # this step was not trained: a resumed run reads its samples again
            break
        elapsed = time.perf_counter() - t0
        if result.nonfinite_keys and rank == 0:
            print(f"ds-omni: step {step}: loss or gradients not finite; update dropped "
                  f"(train.on_nonfinite=\"skip\"); its samples: {result.nonfinite_keys}")
        evaluated = evaluator.run(engine) if evaluator and evaluator.due(step + 1) else {}
        if step % cfg.train.log_every == 0 or step == end - 1 or result.nonfinite_keys or evaluated:
            record = {"step": step, "loss": result.loss, "lr": lr,
                      "tokens": result.tokens, "targets": result.targets,
                      "samples": result.samples, "step_s": elapsed,
                      "data_wait_s": loader.last_wait_s,
                      "tokens_per_s": result.tokens / elapsed,
                      "cost_max_over_mean": result.cost_max_over_mean,
                      **({"nonfinite_skipped": result.nonfinite_keys}
                         if result.nonfinite_keys else {}), **evaluated,
                      **{f"data_{k}": v for k, v in batch.stats.items()
                         if k in ("skipped", "outliers", "mean_delay", "max_delay",
                                  "long_items")},
                      **pool_metrics(engine.module), **sp_metrics(engine.module)}
            if cfg.train.log_samples:
                record["sample_keys"] = sorted(k for part in loader.comm.world_all_gather(
                    batch.keys) for k in part)
            logger.log(record)
            flush_skipped(loader, cfg.train.output_dir, rank, step)
        logger.advance()
        step += 1
        if cfg.train.save_every and step % cfg.train.save_every == 0 and step < end:
            with _solo(watchdog):
                checkpoint.save(engine, cfg.train.output_dir, step, loader.state_dict(), rank,
                                keep=cfg.train.keep_checkpoints)
    guard.close()
    return step


def pool_metrics(module) -> dict:
    """`parallel.encoder_pool`: the items this rank encoded for other ranks in the step just run
    (`data_pool_moved`) and those all ranks did (`data_pool_moved_group`, the same on every rank:
    rank 0's log shows the pool at work even when rank 0 itself moves nothing); nothing without
    the pool."""
    router = router_of(module)
    pool = router.encoder_pool if router is not None else None
    return {"data_pool_moved": pool.step_moved,
            "data_pool_moved_group": pool.step_moved_group} if pool is not None else {}


def sp_metrics(module) -> dict:
    """Under sequence parallelism (static or per-sequence): this rank's SP work since start
    (`sp_ulysses_calls`, `sp_rows_sent`, ...: `ds_omni.parallel.evidence`), which shows that the
    SP machinery ran; nothing without SP or on a pipeline stage."""
    router = router_of(module)
    if router is None or (router.sp_group is None and not router.blocks):
        return {}
    return router.sp_counts.as_metrics()


def _finish(cfg, engine, loader, rank, step, plan) -> dict:
    checkpoint.save(engine, cfg.train.output_dir, step, loader.state_dict(), rank,
                    keep=cfg.train.keep_checkpoints)
    flush_skipped(loader, cfg.train.output_dir, rank, step)
    skipped = skipped_totals(loader)
    dist.barrier()
    report = {}
    if rank == 0:
        extra = {"world_size": plan.world_size, "dp": plan.dp, "sp": plan.sp, "data_skipped": skipped,
                 "zero_stage": engine.zero_optimization_stage(), "final_step": step}
        if cfg.train.export_hf and step >= cfg.train.steps:
            from ds_omni.model.convert import export_checkpoint
            hf_dir = Path(cfg.train.output_dir) / "hf"
            export_checkpoint(checkpoint.checkpoint_root(cfg.train.output_dir), hf_dir)
            extra["hf_export"] = str(hf_dir)
        report = write_report(cfg.train.output_dir, extra)
    dist.barrier()
    return report
