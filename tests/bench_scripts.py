"""The scripts of benchmarks/ as modules, for the tests that call their functions (benchmarks/
is not a package: each script is run from the command line and puts the repository on sys.path
itself)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def load(script: str, name: str) -> ModuleType:
    """benchmarks/`script`.py imported once a process as the module `name`, registered in
    sys.modules under it before it runs (its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
