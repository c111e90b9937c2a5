"""The composed backbone in the simulator (issue 37): pp x tp x sp, pp x ep, ep beside tp,
tp x max_sequence_sp and tp x sp x pool. Each composition's collectives against the same plan
without the pipeline (the bytes are the model's, not the schedule's), its model states against
hand counts, its bound never above its simulated step (the search's pruning stays exact), and
the search ranking composed plans instead of dropping them."""

from __future__ import annotations

import pytest

from ds_omni.sim import SimPlan, cluster, simulate
from ds_omni.sim import bounds, model_parallel, pipeline_sim
from ds_omni.sim.search import SearchSpace, search
from ds_omni.sim.step import loader_plan
from tests.unit.sim.test_sim_search import small_moe, small_vlm, text

BASE = dict(zero_stage=1, global_batch=32, micro_batches=4, pack_tokens=16384)
SAMPLES = [1000, 3000, 500, 2000, 1000, 3000, 500, 14000] * 4


def _run(model, gpus=32, **plan):
    return simulate(cluster("h100", gpus, 8), model, text(SAMPLES), SimPlan(**BASE, **plan))


def _shards(model, gpus, **plan):
    """Each stage's ZeRO shards of a rank ([stage][shard])."""
    shell = bounds.Shell(cluster("h100", gpus, 8), model, text(SAMPLES), SimPlan(**BASE, **plan))
    return shell, [model_parallel.state_shards(shell, s, pipeline_sim.held_params(shell, s))
                   for s in range(shell.pplan.pp)]


def test_tp_inside_stages_moves_the_bytes_of_tp_alone():
    """Every decoder layer all-reduces its activations over TP once in whichever stage holds it:
    pp2 x tp2 moves the bytes tp2 moves; a stage's rank holds half its layers."""
    m = small_vlm()
    alone, staged = _run(m, tp=2), _run(m, tp=2, pp=2)
    assert staged.all_to_all_bytes["llm_tp"] == pytest.approx(alone.all_to_all_bytes["llm_tp"])
    shell, tp_shards = _shards(m, 32, tp=2, pp=2)
    _, pp_shards = _shards(m, 32, pp=2)
    for s in range(2):
        layers = len(shell.stage_plan.decoder_layers(s))
        assert 0 < layers < m.dims.layers
        assert tp_shards[s][0].params == pytest.approx(
            pp_shards[s][0].params - layers * m.llm_layer_params() / 2)
        assert tp_shards[s][0].group_size == shell.pplan.dp  # ZeRO over a TP rank's dp ranks


def test_ulysses_and_experts_inside_stages_move_the_bytes_of_the_flat_plan():
    moe = small_moe()
    for flat, staged in ((dict(sp=2), dict(sp=2, pp=2)), (dict(ep=2), dict(ep=2, pp=2))):
        a, b = _run(moe, **flat), _run(moe, **staged)
        for key in ("llm_ulysses", "llm_experts", "llm_tp"):
            assert b.all_to_all_bytes[key] == pytest.approx(a.all_to_all_bytes[key]), (staged, key)


def test_experts_beside_tp_spread_over_dp_x_tp():
    """ep 4 beside tp 2 on 8 GPUs (dp 4): a rank holds the non-expert layers / 2 and 1/4 of the
    experts, partitioned by ZeRO over the 4 data ranks of its TP rank and the 8 / 4 ranks
    holding the same experts."""
    moe = small_moe()
    _, [[rest, experts]] = _shards(moe, 8, tp=2, ep=4)
    total = moe.expert_params()
    dense = moe.dims.layers * moe.llm_layer_params() - total
    assert rest.params == pytest.approx(moe.total_params() - dense / 2 - total)
    assert (rest.group_size, experts.group_size) == (4, 2)
    assert experts.params == pytest.approx(total / 4)
    r = _run(moe, gpus=8, tp=2, ep=4)
    assert r.all_to_all_bytes["llm_experts"] > 0 and r.all_to_all_bytes["llm_tp"] > 0


@pytest.mark.parametrize("kind,plan", [
    ("vlm", dict(pp=2, tp=2)), ("vlm", dict(pp=2, tp=2, sp=2)),
    ("vlm", dict(pp=2, tp=2, sp=2, encoder_placement="uniform")),
    ("vlm", dict(tp=2, max_sequence_sp=2)), ("vlm", dict(tp=2, sp=2, encoder_mode="pool")),
    ("moe", dict(ep=4, tp=2)), ("moe", dict(pp=2, ep=2))],
    ids=str)
def test_bounds_never_exceed_the_composed_step(kind, plan):
    c, m = cluster("h100", 32, 8), small_vlm() if kind == "vlm" else small_moe()
    samples = text(SAMPLES)
    sim_plan = SimPlan(**BASE, **plan)
    r = simulate(c, m, samples, sim_plan)
    shell = bounds.Shell(c, m, samples, sim_plan)
    totals = bounds.totals_of(m, samples)
    assignment = loader_plan(totals["per_sample"]["cost"], samples.tokens, shell.pplan, sim_plan)
    refined = bounds.refined_bound(shell, assignment, totals)
    assert 0 < bounds.lower_bound(shell, totals) <= refined <= r.step_time
    states, _ = bounds.states_bytes(shell)
    assert states <= r.peak_memory
    if "max_sequence_sp" in plan:
        assert r.all_to_all_bytes["llm_ulysses"] > 0  # the long sample's block ran Ulysses


def test_search_ranks_composed_plans():
    """On 16 GPUs an MoE's pp x tp, pp x ep and ep x tp plans are searched, none dropped for
    composing (the per-sequence degree beside pp or sp still is), and the exhaustive ranking's
    top is the bound's."""
    space = SearchSpace(degrees=(1, 2), zero_stages=(1,), encoder_modes=("reshard",),
                        reorder_groups=(4,), checkpointing=(True,))
    c, m, samples = cluster("h100", 16, 8), small_moe(), text(SAMPLES[:16])
    base = SimPlan(global_batch=16, micro_batches=2, pack_tokens=16384)
    fast = search(c, m, samples, base, top=3, space=space, baselines=False)
    full = search(c, m, samples, base, top=3, space=space, baselines=False, prune=False)
    assert [r.step_time for r in fast.top] == [r.step_time for r in full.top]
    refused = [d for d in full.dropped if "cannot be combined" in d["reason"]]
    # what training still refuses: a per-sequence degree under pp, ep x tp under pp or sp, cp
    # beside pp (the table's rows)
    assert refused and all(d["reason"].startswith(("parallel.max_sequence_sp", "parallel.ep=",
                                                   "parallel.tp=", "parallel.cp="))
                           for d in refused)
    # ring attention beside tp and ep (ZeRO-1) is searched, not dropped: c9bb8e2 dropped 3
    assert not [d for d in refused if "parallel.cp=" in d["reason"]], refused
    ranked = {(p.plan.pp > 1, p.plan.tp > 1, p.plan.ep > 1) for p in full.top}
    assert full.simulated >= 20 and ranked
