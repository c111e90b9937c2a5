"""AutoEP's MoE layer as the simulator prices it beyond its active FLOPs and its dispatch and
combine, against hand counts: the split-size exchange (one latency-bound all-to-all of E int32
counts a MoE layer, forward and recompute), the calibrated routing work a token-expert
assignment and the experts' small-matmul rate (`Cluster.moe_token_flops`,
`expert_half_tokens`: 0 on the GPU presets), the folded layer's TP collectives beside tp;
`fit_moe_layer` recovers known terms from timings made with them."""

from __future__ import annotations

import numpy as np
import pytest

from ds_omni.sim import SimPlan, cluster, comm, simulate
from ds_omni.sim.calibrate_moe import fit_moe_layer
from ds_omni.sim.model_parallel import ep_balance, ep_seconds, fold_seconds
from ds_omni.sim.step import Step
from tests.unit.sim.test_sim_search import small_moe, text

PLAN = dict(zero_stage=1, global_batch=8, micro_batches=2, pack_tokens=4096,
            reorder="loader_order")


def test_split_exchange_by_hand():
    """Each MoE layer's dispatch waits for one all-to-all of E counts (forward, and again in
    the recompute under checkpointing); the presets price it by the link's latency."""
    m, c = small_moe(), cluster("h100", 4, 4)
    step = Step(c, m, text([1000] * 8), SimPlan(ep=2, **PLAN))
    link = comm.link_of(c, [0, 1])

    def a2a(n):  # 2 ranks: one message of half the bytes
        return link.latency + n / 2 / link.bandwidth
    layers, rows = 4, 1000 * 2 * 1024 * 2  # MoE layers; a rank's top-2 copies, bf16
    counts = a2a(8 * 4)  # 8 experts' int32 counts
    assert ep_seconds(step, 1000, False) == pytest.approx(2 * layers * a2a(rows)
                                                          + layers * counts)
    assert ep_seconds(step, 1000, True) == pytest.approx(4 * layers * a2a(rows)
                                                         + layers * counts)
    assert ep_seconds(step, 0, True) == 0.0


def test_routing_and_small_expert_matmuls_by_hand():
    """`moe_token_flops` a routed token-expert assignment; the experts spread over the group at
    n / (n + `expert_half_tokens`) of the rate, n an expert's tokens of the pass. 0 (presets):
    the spread alone, FLOPs kept."""
    m = small_moe()
    tok = np.array([800.0, 200.0, 500.0, 500.0])
    per_token = m.expert_flops_per_token()
    llm = tok * 1e9 + tok * per_token
    plain = Step(cluster("h100", 4, 4), m, text([1000] * 8), SimPlan(ep=2, **PLAN))
    assert plain.cluster.moe_token_flops == plain.cluster.expert_half_tokens == 0.0
    assert ep_balance(plain, llm, tok).sum() == pytest.approx(llm.sum())
    c = cluster("h100", 4, 4, moe_token_flops=1e6, expert_half_tokens=100.0)
    step = Step(c, m, text([1000] * 8), SimPlan(ep=2, **PLAN))
    out = ep_balance(step, llm, tok)
    # group {0, 1}: 1,000 tokens x top-2 over 8 experts = 250 an expert: 250 / 350 of the rate
    shared = (800 + 200) / 2 * per_token * (1 + 100 / 250)
    assert out[0] == pytest.approx(800 * 1e9 + shared + 800 * 2 * 4 * 1e6)
    assert out[1] == pytest.approx(200 * 1e9 + shared + 200 * 2 * 4 * 1e6)
    # beside tp a rank routes its row's tokens (`routed`) and dispatches 1/tp of them
    folded = ep_balance(step, llm, tok / 2, routed=tok)
    assert folded[0] - folded[1] == pytest.approx(600 * (1e9 + per_token / 2 + 2 * 4 * 1e6))
    # the whole step: both terms only add (pp x ep prices them the same way)
    for extra in (dict(), dict(pp=2)):
        slow = simulate(c, m, text([1000] * 8), SimPlan(ep=2, **PLAN, **extra))
        fast = simulate(plain.cluster, m, text([1000] * 8), SimPlan(ep=2, **PLAN, **extra))
        assert slow.step_time > fast.step_time


def test_folded_tp_collectives_by_hand():
    """ep beside tp: a MoE layer's forward all-gathers 4 row sets over TP (each after its row
    counts) instead of all-reducing; backward adds an all-reduce per TP rank of the outputs'
    and weights' rows and the router's gradient sum."""
    m, c = small_moe(), cluster("h100", 8, 8)
    step = Step(c, m, text([1000] * 16), SimPlan(ep=2, tp=2, **dict(PLAN, global_batch=16)))
    link = comm.links_each(c, np.array([[0, 1]]))
    h, rows = 1024, 1000 * 2 / 2  # a TP rank's top-2 assignments of its 1,000 tokens

    def gather(n):  # 2 ranks: one message
        return c.intra_latency + n / c.intra_bw
    fwd = 4 * gather(8) + gather(rows * h * 2) + 2 * gather(rows * 8) + gather(rows * 2)

    def ar(n):
        return comm.all_reduce(n, 2, comm.link_of(c, [0, 1]))
    bwd = fwd + 2 * (ar(rows * h * 2) + ar(rows * 2)) + ar(8 * h * 2)  # + the recompute's
    tokens = np.array([1000.0])
    assert fold_seconds(step, tokens, link, False) == pytest.approx([4 * fwd])
    assert fold_seconds(step, tokens, link, True) == pytest.approx([4 * bwd])
    # the all-reduces: 2 a layer less the MoE block's forward one (and its recompute's)
    r = simulate(c, m, text([1000] * 16), SimPlan(ep=2, tp=2, **dict(PLAN, global_batch=16)))
    calls = (2 * 4 - 4) + 2 * 4 + (2 * 4 - 4)
    assert r.all_to_all_bytes["llm_tp"] == pytest.approx(calls * 2 * 16000 * h * 2)


def test_fit_moe_layer_recovers_known_terms():
    """Timings made from a dense rate, a half-rate token count and a routing cost give those
    back (the dense MLP of the same FLOPs is the reference rate)."""
    hidden, experts, top_k, inter, rate = 256, 4, 2, 256, 2e10
    tokens = np.array([256.0, 1024.0, 4096.0])
    dense = 3 * 2 * tokens * 3 * hidden * top_k * inter / rate
    per_expert = tokens * top_k / experts
    grouped = dense * (1 + 64.0 / per_expert)
    layer = grouped + tokens * top_k * 3e5 / rate
    fit = fit_moe_layer({"tokens": tokens.tolist(), "layer": layer.tolist(),
                         "experts": grouped.tolist(), "dense": dense.tolist(),
                         "shape": [hidden, experts, top_k, inter]})
    assert fit["expert_half_tokens"] == pytest.approx(64.0)
    assert fit["moe_token_flops"] == pytest.approx(3e5)
