"""By hand (not in the suite, for its time): resume on other numbers of ranks than the suite's
2 -> 1, with the suite's own functions and checks (tests/dist/test_fault_tolerance.py).

    PYTHONPATH=$PWD .venv/bin/python -m tests.dist.resize_check 1:2 4:2     # about 7 min

Each `old:new` trains ZeRO 1 and 3 runs (budget reordering, a changing mixing schedule) on `old`
ranks, saves after 2 steps, resumes on `new` ranks, and checks the fp32 weights, Adam moments,
step counts and LR right after the load and that every row of the data is trained once.
"""

import sys
import tempfile
import time
from pathlib import Path

from tests.dist import test_fault_tolerance as ft
from tests.harness import run_on_ranks

STAGES = (1, 3)


def check(old: int, new: int) -> float:
    root = Path(tempfile.mkdtemp(prefix=f"ds_omni_resize_{old}_{new}_"))
    sources = ft._resize_sources(root)
    t0 = time.monotonic()
    args = (str(root), sources, STAGES)
    saved = run_on_ranks(ft._resize_save, old, args=args, timeout=900)[0]
    resumed = run_on_ranks(ft._resize_load, new, args=args, timeout=900)
    assert all(r[s]["after"] == resumed[0][s]["after"] for r in resumed for s in STAGES)
    ft._check_resize(saved, resumed[0], sources)
    return time.monotonic() - t0


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["1:2", "4:2"]:
        old, new = map(int, spec.split(":"))
        print(f"{old} -> {new}: ZeRO {STAGES} resumed exactly ({check(old, new):.0f} s)",
              flush=True)
