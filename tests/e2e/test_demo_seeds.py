"""The demo as `make demo` runs it (`launch/demo.sh`: the deepspeed launcher, 2 ranks, ZeRO-2, then
`ds-omni data eval-demo`) learns to see for every seed: `benchmarks/demo_seeds.py` for seeds 0, 1
and 2, each seed's captions of eval-demo's 64 held-out images held to issue 27's bar."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.e2e.launch import REPO, run

pytestmark = pytest.mark.e2e
# issue 27's bar, written here apart from the script's copy: caption accuracy per attribute
TARGETS = {"colour": 0.9, "place": 0.85, "size": 0.85, "shape": 0.8}


@pytest.mark.slow  # three demos one after the other: about 9 minutes on 2 quiet cores
@pytest.mark.timeout(2700)  # over the suite's 600 s per test; the script bounds each demo
def test_demo_reaches_the_caption_targets_for_three_seeds(tmp_path):
    results = tmp_path / "demo_seeds.json"
    res = run([sys.executable, str(REPO / "benchmarks" / "demo_seeds.py"), "--seeds", "0", "1", "2",
               "--results", str(results)], timeout=2400)
    assert results.exists(), res.stdout[-5000:]
    result = json.loads(results.read_text())
    assert [r["seed"] for r in result["runs"]] == [0, 1, 2]
    for r in result["runs"]:
        missed = {a: r["accuracy"][a] for a, t in TARGETS.items() if r["accuracy"][a] < t}
        assert not missed, f"seed {r['seed']} below the targets {TARGETS}: {missed}"
        # the eval source was evaluated, and the held-out loss is far below the text prior's
        assert math.isfinite(r["last_eval_loss"]) and r["last_eval_loss"] < 0.2
    assert result["all_reached"] and res.returncode == 0
