"""The loader in a process of its own (`data.workers` 1) on 2 ranks, against the loader in the
training process (`data.workers` 0) on the same ranks: data parallel (2 reorder-group loaders
whose all-gathers now run in the loader processes' own gloo world) and SP 2 with one reader per
SP group (its scatter there too). The same keys, micro-batches and losses step by step, the
same checkpointed state, and a resume from a state taken with workers 1 that continues as
workers 0 does. A loader process killed mid-run is an error on every rank within the test's
hard timeout, and resuming from the last state loses and repeats no sample.
`test_plant_is_caught`: a loader process that sends back the position before each step (not
after) fails the resume check."""

import pytest

from tests import plants
from tests.fixtures import text_source, tiny_config
from tests.harness import run_on_ranks

STEPS, SAVE_AT = 4, 2


def _config(root: str, sp: int, workers: int):
    from ds_omni.config import SourceConfig, from_dict
    from pathlib import Path
    cfg = tiny_config(root, steps=STEPS)
    cfg.data.sources.append(from_dict(SourceConfig, text_source(Path(root), weight=1.0)))
    cfg.data.workers, cfg.parallel.sp = workers, sp
    return cfg


def _loader(cfg, built, rank, world, groups, plan):
    import os
    from ds_omni.data.build import build_loader
    os.environ["DS_OMNI_DIST_TIMEOUT"] = "60"  # how long the trainer waits for its loader process
    return build_loader(cfg, built, plan, groups, num_micro=2)


def _digest(batch, model=None) -> tuple:
    """What the trainer gets of a step: keys, every tensor, and (data parallel) the losses."""
    assert batch.error is None, batch.error
    tensors = [[t.tolist() for t in (mb.input_ids, mb.targets, mb.position_ids, mb.cu_seqlens,
                                     *[v for e in sorted(mb.encoder_inputs)
                                       for _, v in sorted(mb.encoder_inputs[e].items())])]
               for mb in batch.micro_batches]
    losses = [float(model(mb).loss_sum) for mb in batch.micro_batches] if model else []
    return batch.keys, tensors, losses


def _steps(feed, n, model=None) -> list:
    return [_digest(feed.next_step(), model) for _ in range(n)]


def _case(rank, world, root, sp, built, plant):
    import torch
    from ds_omni.data.loader_process import feed_for
    from ds_omni.parallel.groups import rank_groups
    from ds_omni.parallel.plan import ParallelPlan
    here_cfg, there_cfg = _config(root, sp, 0), _config(root, sp, 1)
    plan = ParallelPlan.from_config(here_cfg.parallel, world, here_cfg.data.reorder)
    groups = rank_groups(plan, rank, prefetch=True)
    model = built.model if sp == 1 else None  # (an SP shard needs the model's router)
    with torch.no_grad(), plants.applied(plant, rank):
        here = feed_for(_loader(here_cfg, built, rank, world, groups, plan), 1, until=STEPS)
        there_loader = _loader(there_cfg, built, rank, world, groups, plan)
        there = feed_for(there_loader, 1, until=STEPS)
        want, got = _steps(here, SAVE_AT, model), _steps(there, SAVE_AT, model)
        state_here, state_there = here.state_dict(), there.state_dict()
        want += _steps(here, STEPS - SAVE_AT, model)
        got += _steps(there, STEPS - SAVE_AT, model)
        there.close()
        there_loader.close()
        resumed = _loader(there_cfg, built, rank, world, groups, plan)
        resumed.load_state_dict(state_there)  # a checkpoint taken with workers 1
        after_resume = _steps(resumed, STEPS - SAVE_AT, model)
        resumed.close()
        here.close()
        here.loader.close()
    return {"same": got == want, "same_state": state_here == state_there,
            "resumed_same": after_resume == want[SAVE_AT:], "keys": [k for k, _, _ in want],
            "losses": [loss for _, _, losses in want for loss in losses]}


def _killed(rank, world, root, built) -> dict:
    """Rank 1's loader process is killed after step SAVE_AT; every rank then stops with an
    error (the training step's all-reduce spreads it), and a resume reads on from the state."""
    import os
    import signal
    import time
    import torch.distributed as dist
    from ds_omni.data.loader_process import feed_for
    from ds_omni.parallel.groups import rank_groups
    from ds_omni.parallel.plan import ParallelPlan
    cfg = _config(root, 1, 1)
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    groups = rank_groups(plan, rank, prefetch=True)
    loader = _loader(cfg, built, rank, world, groups, plan)
    feed = feed_for(loader, 1, until=STEPS)
    keys = [feed.next_step().keys for _ in range(SAVE_AT)]
    state = feed.state_dict()
    if rank == 1:
        os.kill(loader.pid, signal.SIGKILL)
        loader._proc.join(10)  # dead before the next step is asked for (SIGKILL is asynchronous;
        # the reply to the request sent early may have come before it: the death is still seen)
    t0 = time.monotonic()
    batch = feed.next_step()
    errors = [None] * world
    dist.all_gather_object(errors, batch.error)  # what train_step's all-reduce does with them
    waited = time.monotonic() - t0
    loader.close()
    resumed = _loader(cfg, built, rank, world, groups, plan)
    resumed.load_state_dict(state)
    keys += [resumed.next_step().keys for _ in range(STEPS - SAVE_AT)]
    resumed.close()
    return {"errors": errors, "waited_s": waited, "keys": keys}


def _ranks(rank, world, root, plant):
    import torch.distributed as dist
    from ds_omni.model.build import build_model
    import datasets
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    if rank:
        dist.barrier()  # rank 0 makes the builtin data first
    built = build_model(_config(root, 1, 0).model)
    if not rank:
        dist.barrier()
    if plant is not None:
        return {"dp": _case(rank, world, root, 1, built, plant)}
    return {"dp": _case(rank, world, root, 1, built, None),
            "sp": _case(rank, world, root, 2, built, None),
            "killed": _killed(rank, world, root, built)}


@pytest.mark.slow
def test_the_loader_process_matches_the_loader_in_process(tmp_path):
    per_rank = run_on_ranks(_ranks, 2, args=(str(tmp_path), None), timeout=900)
    for case in ("dp", "sp"):
        for rank, r in enumerate(per_rank):
            got = r[case]
            assert got["same"] and got["same_state"], (case, rank)
            assert got["resumed_same"], (case, rank)
    dp = [r["dp"] for r in per_rank]
    assert dp[0]["keys"] != dp[1]["keys"] and dp[0]["losses"]  # two ranks' own samples
    sp = [r["sp"] for r in per_rank]
    assert sp[0]["keys"] == sp[1]["keys"]  # the SP group trains the same rows
    killed = [r["killed"] for r in per_rank]
    dead = "rank 1: the loader process (pid"
    for r in killed:  # every rank sees rank 1's death (its own error, or the other's)
        assert any(e and dead in e and "died with signal SIGKILL" in e for e in r["errors"])
        assert r["waited_s"] < 60
    for rank in range(2):  # resumed from the state before the kill: nothing lost or repeated
        assert killed[rank]["keys"] == dp[rank]["keys"], rank


@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("loader_process"))
def test_plant_is_caught(plant, tmp_path):
    per_rank = run_on_ranks(_ranks, 2, args=(str(tmp_path), plant), timeout=900)
    assert all(r["dp"]["same"] for r in per_rank)  # the batches are right...
    assert not any(r["dp"]["resumed_same"] for r in per_rank), plant  # ...the resume is not
