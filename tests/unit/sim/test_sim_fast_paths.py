"""The simulator's fast paths predict what the straightforward code predicted, to the last bit.

The 1,024-GPU search (`test_sim_search.py`) needed the simulator faster; none of its speed-ups
may change a prediction:
- a round's resharding is priced from `reshard.place_items` (the planner's decisions) without
  `plan_reshard`'s receive side: checked against `plan_reshard` itself on random rows, every
  mode and group size (`reference_work` below is the charge the simulator used to make);
- the rows' sums, the placement's collective seconds and bytes are kept between the plans of a
  search (`RoundRows`, `RoundWork.memo`), the timeline finds each group's last arrival in
  arrays: checked against `fixtures/sim_predictions_0bfff07.json`, the step time, the critical
  path, per-rank compute / comm / idle, all-to-all bytes and peak memory of 14 plans (tp alone,
  tp x sp, tp + pool, sp, pool, split_all, replicated, pp, per-sequence SP, ZeRO 1-3) as the
  simulator of commit 0bfff07 (before the speed-ups, with Ulysses' four calls a layer) predicted them; with and without a cache
  shared by the plans (the search's path), and the cache's second use (every memo hit);
- a counter: a plan sharing another's placement runs no all-to-all pricing again;
- planted errors (a shard one token too long in the fast charge; the encoders' Ulysses
  backward priced as its forward through the memo) make the checks fail.

To write the fixture again from the unoptimized code: check out 0bfff07 into DIR and run
`PYTHONPATH=DIR python tests/unit/sim/test_sim_fast_paths.py tests/unit/sim/fixtures/sim_predictions_0bfff07.json`
(this file imports nothing that commit lacks at module level).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_omni.data.cost import EncoderDims, ModelDims
from ds_omni.sim import ModelSpec, SimPlan, WorkloadSpec, cluster, comm, simulate

FIXTURE = Path(__file__).parent / "fixtures" / "sim_predictions_0bfff07.json"
PLANS = [dict(tp=2, zero_stage=1), dict(tp=2, sp=2, zero_stage=2), dict(tp=2, encoder_mode="pool"),
         dict(sp=4, zero_stage=3), dict(sp=2, encoder_mode="pool", checkpointing=False),
         dict(tp=4, sp=2, zero_stage=2, checkpointing=False), dict(zero_stage=3, reorder_group=4),
         dict(pp=2, sp=2, zero_stage=1), dict(max_sequence_sp=4, zero_stage=2),
         dict(tp=2, sp=2, encoder_mode="split_all"), dict(tp=2, sp=4, encoder_mode="replicated"),
         dict(tp=8, zero_stage=2), dict(sp=8, encoder_mode="split_all"),
         dict(tp=4, encoder_mode="pool", zero_stage=2)]


def vlm() -> ModelSpec:
    dims = ModelDims(hidden=2048, layers=8, intermediate=5504, vocab=32000, kv_hidden=512,
                     encoders={"vision": EncoderDims(hidden=1024, layers=8, intermediate=4096)})
    return ModelSpec.from_dims(dims, heads=16, kv_heads=4)


def case():
    """32 GPUs (4 nodes of 8), 64 samples of up to 8k tokens with images, seed 3; flat links,
    as 0bfff07's preset had them (hierarchical since)."""
    from ds_omni.sim.cluster import Cluster
    flat = {"hierarchical": False} if "hierarchical" in Cluster.__dataclass_fields__ else {}
    return cluster("h100", 32, 8, **flat), vlm(), WorkloadSpec(max_tokens=8192).draw(64, 3, ("vision",))


def predictions(cache=None) -> list[dict]:
    c, m, samples = case()
    out = []
    for fields in PLANS:
        r = simulate(c, m, samples, SimPlan(global_batch=64, micro_batches=2, pack_tokens=8192,
                                            **fields), cache=cache)
        out.append(dict(plan=fields, report=json.loads(json.dumps(dict(
            step_time=r.step_time, critical_path=r.critical_path, compute=r.compute,
            comm=r.comm, idle=r.idle, all_to_all_bytes=r.all_to_all_bytes,
            peak_memory=r.peak_memory, critical_phase=r.critical_phase)))))
    return out


def check_predictions_match_the_unoptimized_simulator() -> None:
    """Against the fixture, with the encoder pool's planning charge left out: that mechanism
    came after 0bfff07 (`step.plan_pool`: its metadata all-gather and its planning CPU, both
    before the rounds, none of the fast paths'), and `tests/unit/sim/test_sim_pool.py` checks it
    exactly; that it runs at all is checked below."""
    from unittest import mock

    from ds_omni.sim import step as sim_step
    saved = json.loads(FIXTURE.read_text())
    assert [s["plan"] for s in saved] == PLANS
    cache: dict = {}
    with mock.patch.object(sim_step, "plan_pool", lambda step: None):
        runs = (predictions(), predictions(cache), predictions(cache))  # cold, filling, hits
    for run in runs:
        for got, want in zip(run, saved):
            for key, value in _fixed(want).items():
                assert got["report"][key] == value, (want["plan"], key)  # exact, bit for bit
    pooled = [i for i, plan in enumerate(PLANS) if plan.get("encoder_mode") == "pool"]
    charged = predictions()  # the pool's planning in: those plans' steps only, and later
    assert all((charged[i]["report"]["step_time"] > saved[i]["report"]["step_time"])
               == (i in pooled) for i in range(len(PLANS)))


def _fixed(want: dict) -> dict:
    """The fixture's report with the one bug fixed since 0bfff07 (issue 37): under pp the
    Ulysses bytes of all the layers were counted on every stage, pp times the bytes sent (its
    seconds were right). Exact division by a power of two: still bit for bit."""
    report = dict(want["report"])
    pp = want["plan"].get("pp", 1)
    if pp > 1 and "llm_ulysses" in report["all_to_all_bytes"]:
        a2a = dict(report["all_to_all_bytes"])
        a2a["llm_ulysses"] = a2a["llm_ulysses"] / pp
        report["all_to_all_bytes"] = a2a
    return report


@pytest.mark.slow  # ~3 s: 42 simulations
def test_predictions_match_the_unoptimized_simulator_bit_for_bit():
    check_predictions_match_the_unoptimized_simulator()


# ------------------------------------------------------------- the charge of a round's rows
def reference_work(rows, layout, world: int, mode: str, long_items: bool, heads, order):
    """What the simulator charged before: `plan_reshard`'s whole plan per row, read rank by
    rank (sp = tp = 1 modes "reshard" / "split_all", rows of 2+ ranks)."""
    from ds_omni.parallel import reshard
    from ds_omni.parallel.long_short import LongItems
    flops, positions, sends, split = np.zeros(world), np.zeros(world), [], []
    for row in rows:
        slots, ids, tokens = layout.slots(row)
        g = len(row.ranks)
        long = LongItems(0.0 if mode == "split_all" else None, heads) \
            if (long_items or mode == "split_all") else None
        plans = reshard.plan_reshard(slots, g, math.ceil(tokens / g), order, long)
        key = {(s.encoder, s.index): k for k, s in enumerate(slots)}
        for plan in plans:
            r = row.ranks[plan.rank]
            for enc, indices in plan.encode.items():
                for index in indices:
                    flops[r] += slots[key[(enc, index)]].cost
                    positions[r] += layout.s.item_len[ids[key[(enc, index)]]]
            sends += [(int(r), int(row.ranks[d]), n * layout.hidden * 2)
                      for d, n in enumerate(plan.send_counts) if n and d != plan.rank]
        for enc, pieces in plans[0].split.items():
            for index, _ in pieces:
                k = key[(enc, index)]
                flops[row.ranks] += slots[k].cost / g
                positions[row.ranks] += int(layout.s.item_len[ids[k]]) / g
                split.append((row.ranks.tolist(), int(layout.s.item_len[ids[k]]) / g, enc))
    return flops, positions, sends, split


def check_charge_matches_plan_reshard() -> int:
    """Random rounds on 32 ranks, groups of 2, 4, 8: the fast charge equals `plan_reshard`'s.
    Returns how many rows were compared."""
    from ds_omni.sim.encode_sim import Row, RowLayout, round_work
    m, rows_seen = vlm(), 0
    heads, order = {n: m.heads(n) for n in m.dims.encoders}, m.cost.encoder_names
    for seed, g in ((0, 2), (1, 4), (2, 8), (3, 8)):
        samples = WorkloadSpec(max_tokens=8192).draw(48, seed, ("vision",))
        cost = m.cost.encoder_cost("vision", samples.item_len)  # every item is an image
        layout = RowLayout(samples, cost, m.dims.hidden)
        rng = np.random.default_rng(seed)
        picks = np.array_split(rng.permutation(len(samples)), 32 // g)
        rows = [Row(np.arange(i * g, (i + 1) * g), p) for i, p in enumerate(picks)]
        for mode, long_items in (("reshard", True), ("reshard", False), ("split_all", False)):
            work = round_work(rows, layout, 32, mode, long_items, heads, order)
            flops, positions, sends, split = reference_work(rows, layout, 32, mode, long_items,
                                                            heads, order)
            assert work.flops.tolist() == flops.tolist()  # the same additions, in order
            assert work.positions.tolist() == positions.tolist()
            assert [(int(s), int(d), b) for s, d, b in work.sends] == sends
            assert [(r.tolist(), n, e) for r, n, e in work.split_positions] == split
            rows_seen += len(rows)
    return rows_seen


def test_fast_charge_is_plan_reshards_on_random_rows():
    assert check_charge_matches_plan_reshard() == 3 * (16 + 8 + 4 + 4)


# ------------------------------------------------------------------- the memo is used
def test_a_plan_sharing_a_placement_prices_no_all_to_all_again(monkeypatch):
    c, m, samples = case()
    calls = []
    original = comm.all_to_all_pairs
    monkeypatch.setattr(comm, "all_to_all_pairs", lambda *a: calls.append(1) or original(*a))
    cache: dict = {}
    plan = SimPlan(sp=4, tp=2, global_batch=64, micro_batches=2, pack_tokens=8192)
    first = simulate(c, m, samples, plan, cache=cache)
    cold = len(calls)
    again = simulate(c, m, samples, plan.replace(zero_stage=2, checkpointing=False), cache=cache)
    assert cold > 0 and len(calls) == cold  # the second plan priced nothing again
    assert again.all_to_all_bytes["reshard"] == first.all_to_all_bytes["reshard"] > 0
    assert again.all_to_all_bytes["encoder_ulysses"] == first.all_to_all_bytes["encoder_ulysses"]


def test_pool_plans_under_tp_share_the_pipelines_folded_pool_plans(monkeypatch):
    """A pp = 1 pool plan under tp reads its rounds' pool plans from the pipeline's folded ones
    (`step._pool_folded`, one dp x sp): the same reports as cold, no pool planned again."""
    from ds_omni.sim import encode_sim
    c, m, samples = case()
    base = SimPlan(global_batch=64, micro_batches=2, pack_tokens=8192, encoder_mode="pool")
    plans = [base.replace(pp=2), base.replace(tp=2), base.replace(pp=2, tp=2), base.replace(tp=4)]
    calls, original = [], encode_sim.pool_round
    monkeypatch.setattr(encode_sim, "pool_round", lambda *a: calls.append(1) or original(*a))
    cache: dict = {}
    for k, plan in enumerate(plans):
        before = len(calls)
        shared = simulate(c, m, samples, plan, cache=cache)
        # the pp plans fill the folded plans (2 rounds); the tp plans after them plan none
        assert len(calls) - before == (2 if k % 2 == 0 else 0), plan
        cold = simulate(c, m, samples, plan)
        assert (shared.step_time, shared.critical_path, shared.all_to_all_bytes) == (
            cold.step_time, cold.critical_path, cold.all_to_all_bytes)
        assert np.asarray(shared.compute).tolist() == np.asarray(cold.compute).tolist()


# ------------------------------------------------------------------------- planted errors
from tests import plants  # noqa: E402  (after the checks: the plants patch what they call)


@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("sim_fast_paths"))
def test_plant_sim_fast_paths(plant):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_predictions_match_the_unoptimized_simulator()
        if plant == "sim_reshard_shard_off_by_one":
            with pytest.raises(AssertionError):
                check_charge_matches_plan_reshard()


if __name__ == "__main__":  # write the fixture (from the code on PYTHONPATH: see the docstring)
    Path(sys.argv[1]).write_text(json.dumps(predictions(), indent=0))
