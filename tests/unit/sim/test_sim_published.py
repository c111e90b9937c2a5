"""The published-runs file and the dense step model held against it (benchmarks/sim_published.py):
every run cited, calibration on at most two runs a GPU type, predictions within the targets."""

import copy
import json
import statistics
from pathlib import Path

import pytest

from ds_omni.errors import ConfigError
from ds_omni.sim.gpus import KernelFit
from ds_omni.sim.published import Run, calibrate, ordered_pairs, reproduce, step_time

RUNS = Path(__file__).resolve().parents[3] / "benchmarks" / "published_runs.json"


@pytest.fixture(scope="module")
def doc():
    return json.loads(RUNS.read_text())


@pytest.fixture(scope="module")
def result(doc):
    return reproduce(doc)


def test_every_run_is_cited_and_fully_specified(doc):
    runs = doc["runs"]
    assert len(runs) >= 12 and len({r["source"] for r in runs}) >= 3
    gpus = [r["gpus"] for r in runs]
    assert min(gpus) <= 32 and max(gpus) >= 3000
    for r in runs:
        source = doc["sources"][r["source"]]
        assert source["cite"] and source["read_at"] and source["flops"] in ("model", "recompute")
        assert r["table"] and r["gpu"] and r["precision"]
        assert {"layers", "hidden", "vocab", "ffn", "seq"} <= set(r["model"])
        assert {"tp", "pp", "dp", "cp"} <= set(r["plan"]) and r["global_batch"] > 0
        assert r["measured"]["tflops_per_gpu"] > 0
        Run.of(r)  # degrees multiply to the GPU count, the batch splits into micro-batches


def test_calibration_uses_at_most_two_runs_a_gpu_type(doc, result):
    for gpu, names in doc["calibration"].items():
        assert 1 <= len(names) <= 2
        assert all(r["gpu"] == gpu for r in doc["runs"] if [r["source"], r["name"]] in names)
    roles = [r["role"] for r in result["runs"]]
    assert roles.count("calibration") <= 2 * len(doc["calibration"])
    too_many = copy.deepcopy(doc)
    too_many["calibration"]["a100"].append(["megatron_sc21", "GPT 18B"])
    with pytest.raises(ConfigError, match="at most 2"):
        reproduce(too_many)


def test_calibration_runs_are_reproduced(result):
    for r in result["runs"]:
        if r["role"] == "calibration":
            assert r["predicted"] == pytest.approx(r["measured"], rel=1e-3)


def test_validation_runs_within_targets(result):
    """Median |error| <= 15 %, none above 30 %; most pairs of one source ordered as measured."""
    errors = [abs(r["error"]) for r in result["runs"] if r["role"] == "validation"]
    assert len(errors) >= 12
    assert statistics.median(errors) <= 0.15
    assert max(errors) <= 0.30
    agree, total = ordered_pairs(result["runs"])
    assert total >= 50 and agree / total >= 0.8


def test_the_model_sees_what_it_claims(doc):
    """Bubble, TP and DP terms respond to the plan: more micro-batches shrink the bubble, tp
    overlap hides TP time, a cut network slows a multi-node data-parallel run."""
    fit = KernelFit(0.7, 150.0)
    base = next(r for r in doc["runs"] if r["name"] == "GPT 1T")
    b = step_time(Run.of(base), fit)
    assert b.bubble > 0 and b.tp > 0 and b.p2p > 0
    more = copy.deepcopy(base)
    more["global_batch"] *= 2
    assert step_time(Run.of(more), fit).bubble / step_time(Run.of(more), fit).step < \
        b.bubble / b.step
    hidden = copy.deepcopy(base)
    hidden["plan"]["tp_comm_overlap"] = True
    assert step_time(Run.of(hidden), fit).tp < b.tp
    interleaved = copy.deepcopy(base)
    interleaved["plan"]["vp"] = 2
    assert step_time(Run.of(interleaved), fit).bubble < b.bubble


def test_one_run_calibration_and_bad_inputs(doc):
    run = doc["runs"][0]
    fit = calibrate([run], [doc["sources"][run["source"]]["flops"]])
    assert fit.elementwise == 0 and 0 < fit.gemm <= 1
    with pytest.raises(ConfigError, match="one or two runs"):
        calibrate([], [])
    bad = copy.deepcopy(run)
    bad["plan"]["dp"] += 1
    with pytest.raises(ConfigError, match="not the run's"):
        Run.of(bad)


def test_links_are_hierarchical():
    """A data-parallel group with several ranks a node sends 1/k of the bytes across nodes; a
    slower network slows only groups that span nodes."""
    from ds_omni.sim import links
    from ds_omni.sim.cluster import cluster
    fast, slow = cluster("h100", 64), cluster("h100", 64, inter_bw=5e9)
    nbytes = 1e9
    one_a_node = links.all_reduce(fast, nbytes, 8, 1)  # 8 ranks on 8 nodes
    eight_a_node = links.all_reduce(fast, nbytes, 64, 8)  # 64 ranks, 8 on each node
    assert eight_a_node < one_a_node  # NVLink carries 7/8 of it first
    assert links.all_reduce(slow, nbytes, 8, 8) == links.all_reduce(fast, nbytes, 8, 8)
    assert links.all_reduce(slow, nbytes, 8, 1) > 5 * one_a_node
    assert links.reduce_scatter(fast, nbytes, 64, 8) < links.all_reduce(fast, nbytes, 64, 8)
