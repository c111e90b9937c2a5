"""`ds_omni.sim.search` against exhaustive measurement on 2 CPU ranks (slow): four plans of
pipeline.py's image-heavy workload (dp=2, sp=2, pp=2 with the encoders on stage 0, pp=2 with
the joint pipeline) all train for real in one launch (`benchmarks/sim_validation.ranks`, the
busiest rank's CPU seconds, medians over rounds); the machine is fitted on runs of its own
(`sim_calibration.calibrate_compute`: other data seeds; dp and sp engines); the search then ranks the
space dp / sp / pp / tp / max_sequence_sp in {1, 2} x placements on the steps' own samples.

Like against like: the search ranks plans by step time, which includes a pipeline's bubble;
the CPU clock of a rank waiting in that bubble does not advance (gloo's receive blocks: in
sim_validation's measured pp2_stage0_text, stage 0 spent 0.26-0.40 CPU s of a 0.51-0.78 s
wall step, while a dp step's wall is within 0.02-0.1 s of its CPU time). The wall clock is
what the step time predicts, but on two cores shared with other jobs it measures the load
more than the plan (the 4-rank runs' wall is twice their CPU time). So each plan the search
ranked is compared by the quantity the CPU clock counts: its simulated busiest rank's busy
seconds (compute + communication, `sim_validation.busy_s`, the validation's figure too),
from the same simulation that gave the search its step time. It must order every two plans
the measurement tells apart (every round of one faster than every round of the other) as
measured, and find the measured best where the measurement tells it apart from all three
others. The step times and wall seconds are printed beside them
(docs/benchmarks/sim_validation.md)."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest

from benchmarks import sim_calibration as cal
from benchmarks import sim_validation as sv

MEASURED = {  # plan of sim_validation.CONFIGS -> the SimPlan fields it is in the search's space
    "dp2_image": dict(dp=2, sp=1, pp=1),
    "sp2_static_image": dict(dp=1, sp=2, pp=1),
    "pp2_stage0_image": dict(dp=1, sp=1, pp=2, encoder_placement="stage0"),
    "pp2_uniform_image": dict(dp=1, sp=1, pp=2, encoder_placement="uniform"),
}


def _searched(raw: dict, tmp: str, sources: dict) -> tuple[dict, dict]:
    """Plan name -> the median over the measured rounds of (the busiest rank's busy seconds,
    the step time) of the plan as the search simulated it."""
    from ds_omni.sim.cluster import cluster
    from ds_omni.sim.from_config import model_spec, sim_plan
    from ds_omni.sim.model_spec import ModelSpec
    from ds_omni.sim.search import SearchSpace, search
    from ds_omni.sim.step import simulate
    from ds_omni.train.calibrate import machine_fields
    from tests.fixtures import ds_config
    cfg = sv.config("dp2_image", tmp, sources, 1)
    base_model = model_spec(cfg)
    model = dataclasses.replace(ModelSpec.from_dims(base_model.dims, base_model.frozen),
                                bytes_per_param=4)
    base = sim_plan(cfg, ds_config(1), 2)
    machines = cluster(tmp + "/sim_validation_cluster.json", 2, 2,
                       **machine_fields(raw["compute"]["2"]["machine"]))
    space = SearchSpace(degrees=(1, 2), zero_stages=(1,), encoder_modes=("reshard",),
                        reorder_groups=(base.reorder_group,), checkpointing=(base.checkpointing,))
    times = {name: [] for name in MEASURED}
    steps = {name: [] for name in MEASURED}
    logs = raw["logs"]["dp2_image"]
    for s in range(raw["warmup"], len(logs[0])):
        result = search(machines, model, sv.samples_of(logs, s), base, top=64, space=space)
        assert result.simulated >= len(MEASURED)  # the search simulated them (no shortcut)
        for ranked in result.top:
            for name, fields in MEASURED.items():
                f = ranked.plan.as_dict()
                if f["tp"] == 1 and f["max_sequence_sp"] == 1 and all(
                        f[k] == v for k, v in fields.items()):
                    report = simulate(machines, model, sv.samples_of(logs, s), ranked.plan)
                    assert report.step_time == pytest.approx(ranked.step_time)  # that plan
                    times[name].append(sv.busy_s(report))
                    steps[name].append(ranked.step_time)
    assert all(len(v) == len(logs[0]) - raw["warmup"] for v in times.values()), times
    return ({name: statistics.median(v) for name, v in times.items()},
            {name: statistics.median(v) for name, v in steps.items()})


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_search_orders_the_plans_the_measurement_tells_apart(tmp_path):
    from ds_omni.sim.calibrate_comm import calibrate as calibrate_comm
    from tests.fixtures import long_source, text_source
    from tests.harness import run_on_ranks
    import json
    tmp = str(tmp_path)
    sources = {"text": text_source(tmp_path), "long": long_source(tmp_path, weight=0.14)}
    names = list(MEASURED)
    # calibrate_comm.SIZES reach 8 MiB: on a quiet machine a gloo call of <= 512 KiB costs its
    # latency alone, and a fit on those sizes alone finds no bandwidth term and refuses.
    comm = calibrate_comm((2,), repeats=3)
    cluster_file = Path(tmp, "sim_validation_cluster.json")
    cluster_file.write_text(json.dumps(comm["cluster"]))
    compute = cal.calibrate_compute(names, tmp, sources, batches=1, cluster_file=str(cluster_file),
                                   engine_steps=2)
    per_rank = run_on_ranks(sv.ranks, 2, args=(names, tmp, sources, 4, 1), timeout=1200)
    raw = {"logs": {n: [r[n] for r in per_rank] for n in names}, "compute": compute, "warmup": 1}
    rounds = {n: sv.measured(raw["logs"][n], 1)["measured_cpu_per_round"] for n in names}
    measured = {n: statistics.median(v) for n, v in rounds.items()}
    predicted, step_time = _searched(raw, tmp, sources)
    wall = {n: statistics.median(sv.measured(raw["logs"][n], 1)["measured_wall_per_round"])
            for n in names}
    print({n: dict(cpu=round(measured[n], 3), busy=round(predicted[n], 3),
                   wall=round(wall[n], 3), step=round(step_time[n], 3)) for n in names})
    # what the measurement knows: plan a is faster than plan b when every round of a was
    # (the plans' rounds do not overlap); closer plans swap places from run to run on a shared
    # machine (dp=2 and the two pipelines are within 10 % of each other), so they are not known
    known = [(a, b) for a in names for b in names if max(rounds[a]) < min(rounds[b])]
    assert known, ("no two plans measured apart: the measurement decides nothing", rounds)
    wrong = [(a, b) for a, b in known if not predicted[a] < predicted[b]]
    assert not wrong, ("the search orders these measured-apart plans the other way", wrong,
                       measured, predicted)
    best = min(measured, key=measured.get)
    if all((best, b) in known for b in names if b != best):  # a best the measurement knows
        assert min(predicted, key=predicted.get) == best, (measured, predicted)
