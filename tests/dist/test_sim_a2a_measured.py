"""The simulator's all-to-all bytes against a measured 2-rank run (slow).

`sim_validation.py`'s "sp2_static_image" plan (tiny LLaVA, sp=2, encoder_sp off, 16 samples a
step, image-heavy) trains 3 steps on 2 CPU ranks with `torch.distributed.all_to_all_single`
wrapped: every call's bytes sent to the OTHER ranks of its group are counted, by who called it
(DeepSpeed's Ulysses `DistributedAttention` in the LLM's layers; ds_omni's embedding resharding,
`parallel/reshard.py`, forward and backward). Each step's samples are read back from the loader
and simulated (`from_config.model_spec` / `sim_plan`: the config's own model and plan, what
`simulate_config` runs, on the measured batch instead of a drawn one). The simulator counts
activations in bf16 (2 bytes), the CPU run moves fp32: measured bytes are compared / 2.
Tolerance: 2 % for Ulysses (the sim cuts a row into sp shards of ceil(T / sp) tokens, training
pads the row to a multiple of sp). One run: measured 8,503,296 / 8,871,936 / 8,503,296 bytes,
simulated -0.2 % / -0.4 % / -0.4 % (before the fix of Ulysses' backward: 1.50x).
The resharding's bytes are counted and printed but NOT held to the measurement: they differ
(measured 31,744 / 4,096 / 31,744, simulated 2,048 / 1,024 / 4,096) because which rows cross a
shard boundary depends on where placeholders sit in the packed row, and the simulator's layout
(samples in the loader plan's order, items first) is not training's (docs/simulator.md).
"""

from __future__ import annotations


import pytest

from tests import plants

STEPS = 3
NAME = "sp2_static_image"
KINDS = {"sequence/layer.py": "llm_ulysses", "parallel/reshard.py": "reshard"}


def _kind(stack) -> str:
    """Who called the all-to-all: Ulysses' attention, resharding, or other."""
    where = "".join(f.filename for f in stack)
    return next((k for path, k in KINDS.items() if path in where), "other")


def _ranks(rank: int, world: int, out_dir: str, sources: dict) -> list[dict]:
    import torch
    from deepspeed.utils import groups as ds_groups
    from benchmarks import sim_validation as sv
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.train.setup import setup_training
    from ds_omni.train.step import train_step
    from tests.fixtures import ds_config
    torch.set_num_threads(1)
    cfg = sv.config(NAME, out_dir, sources, STEPS)
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    _, loader, engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_config(1), plan),
                                               rank, plan)
    ds_groups.mpu = engine.mpu
    from benchmarks.ep_all_to_all import count_all_to_alls
    counts: dict = {}
    count_all_to_alls(counts, _kind)
    log = []
    for _ in range(STEPS):
        batch = loader.next_step()
        counts.clear()
        train_step(engine, batch, groups)
        log.append({"a2a": dict(counts), "keys": sorted(batch.keys)})
    for record in log:
        record["samples"] = sv.sample_meta(loader, record.pop("keys"))
    return log


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory):
    """(the per-rank logs of the 2-rank run, the config's model and plan, the samples' config)"""
    from benchmarks import sim_validation as sv
    from ds_omni.sim.from_config import model_spec, sim_plan
    from tests.fixtures import ds_config, long_source, text_source
    from tests.harness import run_on_ranks
    tmp_path = tmp_path_factory.mktemp("a2a")
    tmp = str(tmp_path)
    sources = {"text": text_source(tmp_path), "long": long_source(tmp_path, weight=0.14)}
    per_rank = run_on_ranks(_ranks, 2, args=(tmp, sources), timeout=800)
    cfg = sv.config(NAME, tmp, sources, STEPS)
    return per_rank, model_spec(cfg), sim_plan(cfg, ds_config(1), 2)


def check_against_measured(per_rank, model, plan) -> None:
    from benchmarks import sim_validation as sv
    from ds_omni.sim import simulate
    from ds_omni.sim.cluster import cluster
    assert plan.sp == 2 and not plan.long_items
    for s in range(STEPS):
        measured = {k: sum(r[s]["a2a"].get(k, 0) for r in per_rank) / 2  # fp32 -> bf16
                    for k in KINDS.values()}
        got = simulate(cluster("h100", 2, 2), model, sv.samples_of(per_rank, s),
                       plan).all_to_all_bytes
        predicted = {k: got[k] for k in measured}
        print(f"step {s}: measured (bf16-equivalent) {measured}, simulated {predicted}")
        assert measured["llm_ulysses"] > 0  # the counter saw DeepSpeed's all-to-alls
        assert predicted["llm_ulysses"] == pytest.approx(measured["llm_ulysses"], rel=0.02), s
        assert measured["reshard"] > 0 and predicted["reshard"] > 0  # both move some rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_simulated_all_to_all_bytes_match_a_measured_sp2_run(measured_run):
    check_against_measured(*measured_run)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("plant", plants.for_launch("sim_a2a_measured"))
def test_plant_sim_a2a_measured(plant, measured_run):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_against_measured(*measured_run)
