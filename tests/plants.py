"""Planted errors: one small, named change to the code under test each, that an oracle must catch.

    with plants.applied("loss_x2", rank):   # inside a rank (or the one process) under test
        ... train ...

A plant is put in by monkeypatching (never by editing ds_omni): `applied` puts the change in on
entry and takes it out on exit, so one launch can train a planted case among the honest ones.
Each plant names the launch whose oracle must fail on it (`launch`); the suite's tests called
`test_plant_*` (so `pytest -k plant` runs them all) assert, for every plant of their launch, that
the oracle's check FAILS with the plant in (`tests/unit/test_plants.py` holds every plant to a
test that runs it).

To add one: a generator function `(rank) -> None` that patches, yields, and undoes, decorated
with `@plant(name, what, launch)`; then a case for it in that launch and its `test_plant_*`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Plant:
    name: str
    what: str  # the change, in words
    launch: str  # the launch (test module) whose oracle must see it
    apply: Callable[[int], contextmanager]  # rank -> a context with the change in place


PLANTS: dict[str, Plant] = {}


def plant(name: str, what: str, launch: str):
    def register(fn: Callable[[int], Iterator[None]]):
        assert name not in PLANTS, f"plant {name!r} registered twice"
        PLANTS[name] = Plant(name, what, launch, contextmanager(fn))
        return fn
    return register


@contextmanager
def applied(name: str | None, rank: int):
    """The plant `name` in place (no plant: nothing changes)."""
    if name is None:
        yield
        return
    with PLANTS[name].apply(rank):
        yield


def for_launch(launch: str) -> list[str]:
    return sorted(n for n, p in PLANTS.items() if p.launch == launch)


def _patched(owner, attr: str, make: Callable) -> Iterator[None]:
    """`owner.attr = make(original)` for the duration."""
    original = getattr(owner, attr)
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


# ------------------------------------------------------------- data parallel (tests/dist/test_parity.py)
@plant("loss_x2", "the loss handed to DeepSpeed's backward is scaled 2x", "dp")
def _loss_x2(rank: int):
    from ds_omni.train import engine as train
    yield from _patched(train, "engine_loss", lambda f: lambda *a: 2 * f(*a))


@plant("drop_sample", "rank 0's first micro-batch of the first step loses its last sample's "
       "targets", "dp")
def _drop_sample(rank: int):
    from ds_omni.data.loader import OmniLoader
    from ds_omni.model.omni import IGNORE_INDEX

    def make(next_step):
        def planted(loader):
            batch = next_step(loader)
            if rank == 0 and batch.step == 0:
                mb = batch.micro_batches[0]
                assert mb.reshard is None, "plant drop_sample on data-parallel runs only"
                mb.targets[:, int(mb.cu_seqlens[-2]):] = IGNORE_INDEX
            return batch
        return planted
    yield from _patched(OmniLoader, "next_step", make)


# ------------------------------------- slow tier, data parallel (tests/dist/test_parity_slow.py)
@plant("per_sample_whole_row", "a per-sample layer run over the whole row (one sample's state "
       "flows into the next)", "dp_slow")
def _per_sample_whole_row(rank: int):
    from ds_omni.model import omni, per_sample

    def make(run_per_sample):
        def whole_row(layer, hidden, kwargs):
            return layer(hidden, **{k: v for k, v in kwargs.items()
                                    if k not in (*per_sample._ROW_ONLY, "cu_seqlens")})
        return whole_row
    yield from _patched(omni, "run_per_sample", make)


# ------------------------ slow tier, sequence parallel (tests/dist/test_sequence_parallel_slow.py)
@plant("deepstack_levels_dropped", "the deepstack levels are never added to the LLM's hidden "
       "states", "sp_slow")
def _deepstack_levels_dropped(rank: int):
    from ds_omni.model import omni
    yield from _patched(omni.Deepstack, "add", lambda add: lambda self, hidden, level: hidden)
