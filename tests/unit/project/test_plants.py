"""Every planted error of `tests/plants/` has a `test_plant_*` that runs it, and goes away
after its case."""

import ast
from pathlib import Path

from tests import plants

TESTS = Path(__file__).resolve().parents[2]


def _launch_of_plant_tests() -> set[str]:
    """The launches whose test modules hold a `test_plant_*` parametrized by
    `plants.for_launch(<launch>)`."""
    found = set()
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_plant"):
                for call in ast.walk(node):
                    if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == \
                            "for_launch" and call.args and isinstance(call.args[0], ast.Constant):
                        found.add(call.args[0].value)
    return found


def test_every_plant_has_a_test_that_runs_it():
    tested = _launch_of_plant_tests()
    untested = sorted(n for n, p in plants.PLANTS.items() if p.launch not in tested)
    assert not untested, f"plants no test_plant_* runs: {untested}"
    assert all(p.what for p in plants.PLANTS.values())


def test_every_plant_is_a_generator():
    """`applied` enters each plant as a context manager: a function that does not yield (a
    lost `yield` in a merge) fails only inside the ranks, at the plant's case."""
    import inspect
    plain = sorted(n for n, p in plants.PLANTS.items()
                   if not inspect.isgeneratorfunction(p.apply.__wrapped__))
    assert not plain, f"plants that do not yield: {plain}"


def test_a_plant_is_undone_on_exit():
    from ds_omni.train import step
    original = step.engine_loss
    with plants.applied("loss_x2", 0):
        assert step.engine_loss is not original
    assert step.engine_loss is original
