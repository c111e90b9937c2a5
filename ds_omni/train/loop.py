"""The training loop: preflight -> process group -> set-up -> steps -> checkpoints -> report and
HF export, with the watchdog around all of it.

Each step reads its micro-batches from the loader (made ahead on a thread: `data.prefetch_steps`),
runs `ds_omni.train.step.train_step`, logs metrics, and checkpoints every `train.save_every`
steps; `--resume` restores the newest complete checkpoint first (weights, optimizer, LR, RNG,
data position).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from ds_omni.config import OmniConfig
from ds_omni.data.loader_process import feed_for
from ds_omni.data.skipped import SKIPPED_FILE, flush_skipped, skipped_totals
from ds_omni.errors import LaunchError
from ds_omni.parallel import dist
from ds_omni.parallelize import encoder_pool_of, router_of
from ds_omni.parallelize.bubble_schedule import bubble_metrics
from ds_omni.parallelize.expert_parallel import expert_load
from ds_omni.train import checkpoint, reshard
from ds_omni.train.control import WeightsFile
from ds_omni.train.evaluate import build_evaluator
from ds_omni.train.metrics import MetricsLogger, write_report
from ds_omni.train.nonfinite import NonFiniteGuard
from ds_omni.train.setup import preflight, setup_training
from ds_omni.train.step import StopTraining, train_step
from ds_omni.train.watchdog import Watchdog

def run(cfg: OmniConfig, ds_config_path: str, *, resume: bool = False,
        stop_after: int | None = None) -> dict:
    """Train as `cfg` says; returns the report (on rank 0; {} elsewhere)."""
    plan, ds_config = preflight(cfg, ds_config_path, resume)
    rank, world = dist.init_distributed(dist.timeout_s())
    watchdog = Watchdog.start(rank, world, cfg.train.peer_timeout_s)
    try:
        report = _run(cfg, ds_config, plan, rank, resume, stop_after, watchdog)
    except BaseException as e:
        if watchdog is not None:
            cause = watchdog.explain(e)
            if cause:  # a collective failed because a peer died: say which
                print(f"ds-omni: rank {rank}: {cause}", file=sys.stderr, flush=True)
            watchdog.close(failed=f"{type(e).__name__}: {e}")
        raise
    if watchdog is not None:
        watchdog.close()
    return report


def _run(cfg, ds_config, plan, rank, resume, stop_after, watchdog) -> dict:
    out = Path(cfg.train.output_dir)
    with _solo(watchdog):  # another plan's checkpoint: made whole, to be sharded anew
        resharded = reshard.resharded_checkpoint(out, plan, rank) if resume else None
    built, loader, engine, groups = setup_training(
        cfg, ds_config, rank, plan, resharded.weights if resharded is not None else None)
    start = 0
    if resume:
        with _solo(watchdog):  # rank 0 may convert it first (another number of ranks)
            start = resume_from(engine, loader, out, rank, resharded=resharded)
        resharded = None  # the whole weights and moments: not held while training
    elif rank == 0:
        (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / SKIPPED_FILE).unlink(missing_ok=True)
        checkpoint.start_run(out)
    if rank == 0:
        checkpoint.save_model_meta(checkpoint.checkpoint_root(out), built)
    logger = MetricsLogger(out, total_steps=cfg.train.steps, start_step=start, enabled=rank == 0,
                           monitor=getattr(engine, "monitor", None))
    step = _loop(cfg, engine, loader, groups, logger, plan, rank, start, stop_after, watchdog,
                 build_evaluator(cfg, built, loader, groups))
    logger.close()
    with _solo(watchdog):  # (the loader's state is gathered there: a loader process must live)
        report = _finish(cfg, engine, loader, rank, step, plan)
    loader.close()
    return report


def _solo(watchdog):
    """A phase where one rank may work while the others wait (see `Watchdog.solo`)."""
    return watchdog.solo() if watchdog is not None else contextlib.nullcontext()


def resume_from(engine, loader, output_dir, rank: int,
                resharded: reshard.Resharded | None = None) -> int:
    """Load the newest complete checkpoint of `output_dir` into `engine` and `loader` (the data
    position); returns its step. Every rank calls this. `resharded`: it was written under
    another plan, its weights came in whole at setup, its moments come in here
    (`ds_omni.train.reshard`)."""
    start, loader_state = checkpoint.load(engine, output_dir, rank, resharded is not None)
    if resharded is not None:
        reshard.restore_moments(engine, resharded, rank)
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


def _loop(cfg, engine, loader, groups, logger, plan, rank, start, stop_after, watchdog=None,
          evaluator=None) -> int:
    """Train from `start`; the loader's next steps are made ahead on a thread
    (`data.prefetch_steps`), and it is left at the position of the steps trained."""
    end = cfg.train.steps if stop_after is None else min(cfg.train.steps, start + stop_after)
    feed = feed_for(loader, cfg.data.prefetch_steps, until=end, timeout_s=dist.timeout_s())
    try:
        step = _steps(cfg, engine, feed, groups, logger, rank, start, end, watchdog, evaluator)
    except BaseException:
        feed.close(abort=True)
        raise
    feed.close()
    return step


def _steps(cfg, engine, loader, groups, logger, rank, start, end, watchdog, evaluator) -> int:
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
            result = train_step(engine, batch, groups, guard=guard)
        except StopTraining as e:
            if rank == 0:
                print(f"ds-omni: stopping at step {step}: {e}")
            loader.rewind()  # this step was not trained: a resumed run reads its samples again
            break
        elapsed = time.perf_counter() - t0
        moe = expert_load(engine.module)  # every step, every rank: AutoEP's counters, reset
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
                      **pool_metrics(engine.module), **sp_metrics(engine.module), **moe,
                      **bubble_metrics(engine.module)}
            if cfg.train.log_samples:
                record["sample_keys"] = sorted(k for part in groups.comm.world_all_gather(
                    batch.keys) for k in part)
            logger.log(record)
            flush_skipped(loader, cfg.train.output_dir, rank, step)
        logger.advance()
        step += 1
        if cfg.train.save_every and step % cfg.train.save_every == 0 and step < end:
            with _solo(watchdog):
                checkpoint.save(engine, cfg.train.output_dir, step, loader.state_dict(), rank,
                                keep=cfg.train.keep_checkpoints,
                                whole_moments=cfg.train.save_whole_moments)
    guard.close()
    return step


def pool_metrics(module) -> dict:
    """`parallel.encoder_pool`: the items this rank encoded for other ranks in the step just run
    (`data_pool_moved`) and those all ranks did (`data_pool_moved_group`, the same on every rank:
    rank 0's log shows the pool at work even when rank 0 itself moves nothing); nothing without
    the pool."""
    pool = encoder_pool_of(module)
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
                    keep=cfg.train.keep_checkpoints,
                    whole_moments=cfg.train.save_whole_moments)
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
