"""The scripts of benchmarks/ as modules, for the tests that call their functions (benchmarks/
is not a package: each script is run from the command line and puts the repository on sys.path
itself)."""

from __future__ import annotations

import functools
import importlib.util
import shutil
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


def planted_tree(tmp_path: Path, old: str, new: str) -> Path:
    """A copy of BENCHMARKS.md and docs/benchmarks/*.md under `tmp_path` with `old` (in exactly
    one of the files, once) replaced by `new`; returns the copy of BENCHMARKS.md."""
    root = BENCH.parent
    files = [root / "BENCHMARKS.md", *sorted((root / "docs" / "benchmarks").glob("*.md"))]
    holders = [f for f in files if old in f.read_text()]
    assert len(holders) == 1 and holders[0].read_text().count(old) == 1, \
        f"the plant's anchor {old!r} is not in one file once: {holders}"
    for f in files:
        dest = tmp_path / f.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest)
    target = tmp_path / holders[0].relative_to(root)
    target.write_text(target.read_text().replace(old, new))
    return tmp_path / "BENCHMARKS.md"
