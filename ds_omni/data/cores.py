"""Core placement (`data.pin_cores`): which CPU cores the trainer, its loader process and the
loader's pack workers run on.

Unpinned, the kernel moves them and torch's threads over all cores, so decoding and the step take
turns on one core. The plan (`plan_cores`) is pure: each local rank takes a contiguous slice of
the usable cores; in it the loader process and each pack worker get one core, the trainer the rest
(at least one); a slice with fewer cores than processes pins nothing (said once). The apply steps
are thin: the trainer pins itself and its loader process by pid (`pin_trainer`, `pin_pid`), the
loader process sets its torch threads (`pin_self`) and pins its workers (`WorkerPool`). Nothing is
pinned without `os.sched_setaffinity`. More: docs/data.md, "Loading ahead".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

PinSetting = bool | str  # True | False | "auto"


@dataclass(frozen=True)
class CorePlan:
    """Cores of each process of one rank (empty: not pinned) and, when nothing is pinned, why."""

    trainer: tuple[int, ...] = ()
    loader: tuple[int, ...] = ()
    pack_workers: tuple[tuple[int, ...], ...] = ()
    why_not: str = ""

    @property
    def pinned(self) -> bool:
        return bool(self.trainer)

    def record(self) -> dict:
        """JSON-able, for benchmark results and logs."""
        return {"pinned": self.pinned, "trainer": list(self.trainer), "loader": list(self.loader),
                "pack_workers": [list(c) for c in self.pack_workers], "why_not": self.why_not}


def rank_slice(cores: Sequence[int], local_rank: int, local_world: int) -> list[int]:
    """Local rank `local_rank`'s contiguous share of `cores` (sorted); shares differ by <= 1."""
    cores = sorted(cores)
    n = len(cores)
    return cores[n * local_rank // local_world: n * (local_rank + 1) // local_world]


def plan_cores(cores: Sequence[int], *, workers: int, local_rank: int = 0,
               local_world: int | None = 1, setting: PinSetting = "auto",
               can_pin: bool = True) -> CorePlan:
    """Where the processes of local rank `local_rank` run. `cores`: those this process may use
    (shared by the node's `local_world` ranks; None: unknown). "auto" and True pin alike: when
    `workers` >= 1 and each process can get a core of its own."""
    if setting is False:
        return CorePlan(why_not="data.pin_cores is false")
    if not can_pin:
        return CorePlan(why_not="this platform has no os.sched_setaffinity")
    if workers < 1:
        return CorePlan(why_not="data.workers is 0: the training process loads by itself")
    if local_world is None:
        return CorePlan(why_not="the launcher did not say how many ranks share this node "
                                "(LOCAL_WORLD_SIZE or LOCAL_SIZE): set it, or data.pin_cores false")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is not in a local world of {local_world}")
    mine = rank_slice(cores, local_rank, local_world)
    if len(mine) < workers + 1:
        return CorePlan(why_not=(
            f"local rank {local_rank} of {local_world} gets {len(mine)} of the {len(cores)} "
            f"cores this process may use, and its trainer, loader process and {workers - 1} "
            f"pack worker(s) need {workers + 1}: nothing pinned (lower data.workers, or run "
            "fewer ranks per node)"))
    first_loader = len(mine) - workers  # the trainer keeps the rest, at least one core
    return CorePlan(trainer=tuple(mine[:first_loader]), loader=(mine[first_loader],),
                    pack_workers=tuple((c,) for c in mine[first_loader + 1:]))


def local_ranks(env: Mapping[str, str] = os.environ) -> tuple[int, int | None]:
    """(node-local rank, ranks on this node or None where the launcher did not say):
    LOCAL_WORLD_SIZE is torchrun's, LOCAL_SIZE the deepspeed launcher's; one rank in all is
    alone on its node."""
    rank = int(env.get("LOCAL_RANK", 0))
    size = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
    if size:
        return rank, int(size)
    return rank, 1 if int(env.get("WORLD_SIZE", 1)) == 1 else None


# What the training process had before ds_omni pinned it, and how many loaders hold it pinned:
# it gets its cores and threads back when the last one closes (a test session or a benchmark
# goes on after a loader). A fact about the process, so kept per process.
_BEFORE: dict = {}


def _can_pin() -> bool:
    return hasattr(os, "sched_setaffinity")


def trainer_plan(setting: PinSetting, workers: int) -> CorePlan:
    """This rank's plan, from the process's cores (those it had before any pinning) and the
    launcher's environment. Says once why it does not pin when pinning was asked for (true: a
    warning) or would have helped ("auto" with workers)."""
    cores = _BEFORE.get("cores") or (os.sched_getaffinity(0) if _can_pin() else set())
    rank, world = local_ranks()
    plan = plan_cores(sorted(cores), workers=workers, local_rank=rank, local_world=world,
                      setting=setting, can_pin=_can_pin())
    if not plan.pinned and (setting is True or (setting == "auto" and workers >= 1)):
        _say_once(plan.why_not, warn=setting is True)
    return plan


def pin_trainer(plan: CorePlan) -> bool:
    """Hold the training process to its cores, torch's threads to no more than them (True), or
    nothing where the plan does not pin (False). `release_trainer` once per True."""
    if not plan.pinned:
        return False
    if not _BEFORE:
        _BEFORE.update(cores=os.sched_getaffinity(0), threads=torch.get_num_threads(), holders=0)
    _BEFORE["holders"] += 1
    os.sched_setaffinity(0, plan.trainer)
    torch.set_num_threads(min(_BEFORE["threads"], len(plan.trainer)))
    log.info("data.pin_cores: trainer on cores %s, loader process on %s, pack workers on %s",
             list(plan.trainer), list(plan.loader), [list(c) for c in plan.pack_workers])
    return True


def release_trainer() -> None:
    """A pinned loader closed: the last one gives the trainer back its cores and threads."""
    if not _BEFORE:
        return
    _BEFORE["holders"] -= 1
    if _BEFORE["holders"] <= 0:
        os.sched_setaffinity(0, _BEFORE["cores"])
        torch.set_num_threads(_BEFORE["threads"])
        _BEFORE.clear()


_SAID: set[str] = set()


def _say_once(why: str, *, warn: bool) -> None:
    if why and why not in _SAID:
        _SAID.add(why)
        (log.warning if warn else log.info)("data.pin_cores: no core pinning: %s", why)


def pin_self(cores: Sequence[int]) -> None:
    """Hold this process (a loader process, at its start) to `cores`, torch's threads to as many;
    nothing for an empty `cores` (not pinned)."""
    if cores and _can_pin():
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


def pin_pid(pid: int, cores: Sequence[int]) -> None:
    """Hold another process (a pack worker just started) to `cores`."""
    if cores and _can_pin():
        os.sched_setaffinity(pid, cores)
