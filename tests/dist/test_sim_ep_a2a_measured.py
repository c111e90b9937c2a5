"""The simulator's expert-parallel all-to-all bytes against a measured 2-rank ep=2 run (slow).

`benchmarks/ep_all_to_all.py`'s run (the MoE composition of `test_expert_parallel.py`: CLIP +
Qwen3-MoE, 2 MoE layers, 4 experts, top-2, ep=2, 16 samples a step, 3 steps on 2 CPU ranks) with
`torch.distributed.all_to_all_single` counted by caller: AutoEP's dispatch and combine of every
MoE layer, forward and backward. Each step's samples are read back and simulated on the same
global batch (the config's own model and plan); bf16 in the simulator, fp32 measured (halved).

Two claims a step:
- exact (rel 1e-9): the routed volume, every token copy AutoEP's calls handle (kept or sent)
  x width x 2 bytes x (ep - 1) / ep, is the simulator's bytes: its calls (dispatch + combine,
  forward + backward, + the recompute under checkpointing), top-k copies and width are training's;
- within TOLERANCE: the bytes that really left a rank. The simulator takes routing as uniform
  ((ep - 1) / ep leave); the tiny model's random router is not quite (one run: 0.995-1.035x,
  sent shares 0.50-0.52). The per-expert count exchange (128 bytes a step) the simulator
  prices by its latency (`model_parallel.split_exchange`) and leaves out of these bytes.
`test_expert_load_metrics_count_every_routed_token`: the loop's moe_* metrics (`expert_load`)
count the step's tokens x top-k. `test_plant_sim_ep_a2a_measured`: the simulator's EP
all-to-alls priced in forward only (`sim_ep_no_backward`) fail the check.
"""

from __future__ import annotations

import pytest

from benchmarks import ep_all_to_all as bench
from tests import plants

STEPS = 3
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory):
    """(the per-rank logs of the 2-rank run, the config's simulator model and plan)"""
    return bench.measure(str(tmp_path_factory.mktemp("ep_a2a")), STEPS)


def check_against_measured(per_rank, model, plan) -> None:
    assert plan.ep == 2 and plan.sp == 1 and plan.tp == 1  # sim_plan carries the config's ep
    for s, row in enumerate(bench.compare(per_rank, model, plan)):
        print(f"step {s}: {row}")
        assert row["measured_bytes"] > 0 and row["rows"] > 0  # the counter saw AutoEP's calls
        assert row["predicted_bytes"] == pytest.approx(row["uniform_bytes"], rel=1e-9), (s, row)
        assert row["predicted_bytes"] == pytest.approx(row["measured_bytes"], rel=TOLERANCE), \
            (s, row)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_simulated_ep_all_to_all_bytes_match_a_measured_ep2_run(measured_run):
    check_against_measured(*measured_run)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_expert_load_metrics_count_every_routed_token(measured_run):
    """`expert_load` (the loop's moe_* metrics): the most loaded layer's tokens per expert,
    summed over the ranks, are the step's LLM tokens x top-k (counted from the samples the
    loader read back), and max / mean is those counts' ratio."""
    from benchmarks import sim_validation as sv
    per_rank = measured_run[0]
    for s in range(STEPS):
        load = per_rank[0][s]["load"]
        assert all(r[s]["load"] == load for r in per_rank)  # reduced: every rank logs the same
        counts = [v for k, v in sorted(load.items()) if k.startswith("moe_tokens_expert")]
        assert len(counts) == bench.MOE["num_experts"]
        tokens = int(sv.samples_of(per_rank, s).tokens.sum())
        assert sum(counts) == tokens * bench.MOE["num_experts_per_tok"], (s, load, tokens)
        mean = sum(counts) / len(counts)
        assert load["moe_load_max_over_mean"] == pytest.approx(max(counts) / mean, rel=1e-6)
        assert load["moe_load_max_over_mean"] >= load["moe_load_max_over_mean_mean"] >= 1.0


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("plant", plants.for_launch("sim_ep_a2a_measured"))
def test_plant_sim_ep_a2a_measured(plant, measured_run):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_against_measured(*measured_run)
