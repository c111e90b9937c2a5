"""benchmarks/sim_bytescale.py: its cases are plans training accepts, and a case with no figure
says why. The committed results once held figures for SP degrees training refuses (64 / 256 over
Llama-2-7B's 32 heads, 256 over Llama-3-70B's 64): the simulator refuses them too since it runs
training's `SimPlan.check_model`, so those cases printed a bare "-"."""

from __future__ import annotations

import pytest

from benchmarks import sim_bytescale, sim_common
from ds_omni.sim.cluster import cluster
from ds_omni.sim.plan_spec import SimPlan


@pytest.mark.parametrize("case", list(sim_bytescale.CASES), ids=lambda c: f"{c}")
def test_case_degrees_are_trainable(case):
    """Every per-sequence SP degree a case tries is a plan the simulator accepts: up to the
    LLM's query heads a divisor of them, past them (7B's 64 over 32 heads) Ulysses over the
    heads inside and ring attention across (`hdp.ulysses_ring_split`)."""
    llm, _gpus, _context = case
    model = sim_common.model_spec(None, llm)
    for degree in sim_bytescale.CASES[case]:
        SimPlan(max_sequence_sp=degree, reorder_group=degree).check_model(model)


def test_no_figure_names_the_refusal_and_the_memory():
    """A refused plan's line carries training's message; a plan over the GPUs' memory its peak."""
    c = cluster("h100", 1024)
    search = sim_common.Search(c, sim_common.model_spec(None, "llm_7b"),
                               sim_bytescale.workload(262144).draw(8 * 1024, 0, ()))
    base = SimPlan(global_batch=8 * 1024, micro_batches=4, pack_tokens=32768, zero_stage=1)
    search.run(base.replace(sp=64, pack_tokens=64 * 32768, reorder="loader_order"))
    lines = sim_bytescale.no_figure(search)
    assert len(lines) == 1 and "sp=64" in lines[0] and "refused" in lines[0]
    assert "must divide the LLM's attention heads (32)" in lines[0]
    ours = {"fits": True, "tokens_per_s": 1.0}
    case = {"ds_omni": ours, "baselines": {"bytescale": {"fits": False}}}
    assert sim_bytescale.no_plan(case) == "static CP without a fitting plan"
    case = {"ds_omni": None, "baselines": {"bytescale": None}}
    assert sim_bytescale.no_plan(case) == "ds_omni and static CP without a fitting plan"
