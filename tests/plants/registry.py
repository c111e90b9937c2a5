"""The registry of planted errors: one small, named change to the code under test each, that an
oracle must catch. The plants themselves live in one module per area (`parity.py`,
`sequence_parallel.py`, `sim.py`, ...), which `tests/plants/__init__.py` imports: each registers
here.

    with plants.applied("loss_x2", rank):   # inside a rank (or the one process) under test
        ... train ...

A plant is put in by monkeypatching (never by editing ds_omni): `applied` puts the change in on
entry and takes it out on exit, so one launch can train a planted case among the honest ones.
Each plant names the launch whose oracle must fail on it (`launch`); the suite's tests called
`test_plant_*` (so `pytest -k plant` runs them all) assert, for every plant of their launch, that
the oracle's check FAILS with the plant in (`tests/unit/project/test_plants.py` holds every
plant to a test that runs it).

To add one: a generator function `(rank) -> None` that patches, yields, and undoes, decorated
with `@plant(name, what, launch)`, in the module of plants of its area; then a case for it in
that launch and its `test_plant_*`.
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


def patched(owner, attr: str, make: Callable) -> Iterator[None]:
    """`owner.attr = make(original)` for the duration."""
    original = getattr(owner, attr)
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


def on_result(owner, attr: str, change: Callable) -> Iterator[None]:
    """`owner.attr` gives back `change(its result, *its args, **its kwargs)` for the duration:
    the plants that alter what a function (or a method: its args start with self) returns."""
    def make(original):
        def planted(*args, **kwargs):
            return change(original(*args, **kwargs), *args, **kwargs)
        return planted
    yield from patched(owner, attr, make)
