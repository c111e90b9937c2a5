"""Checkpoints of composed plans (slow tier, one 4-rank launch): exported to HF's layout equal to
one process, and resumed on another plan.

Each case trains 2 steps (ZeRO-1, 4 micro-batches a step) and saves before the second step and
after it: pp2 x tp2 (the tiny LLaVA), pp2 x ep2 and ep2 x tp2 (the tiny LLaVA with a Qwen3-MoE
LLM: 4 experts, top-2, aux loss on). The final checkpoint exports (`export_checkpoint`: the
pipeline's names mapped, AutoTP's shards joined, AutoEP's experts stacked) to a folder that plain
transformers loads, and its weights equal the oracle's one-process run (`tests/oracle`) to the
parity tolerance. The checkpoint saved before the second step is resumed in the same launch on
the same plan (DeepSpeed's own loading) and on other plans (ds_omni's consolidation,
`ds_omni.train.reshard`): pp2 x tp2 -> tp2, pp2, dp4; pp2 x ep2 -> ep2. The resumed step's
loss equals the loss of that step on the plan that wrote it (1e-6 relative; exactly on the same
plan). The export's planted errors are caught in one process (tests/unit/model/test_consolidate.py).
"""

import shutil
from pathlib import Path

import pytest

from tests import oracle
from tests.dist.test_expert_parallel import hf_layout
from tests.oracle import ranks as oracle_ranks
from tests.fixtures import ds_config, tiny_config
from tests.harness import run_on_ranks

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]

STEPS = 2
BATCH = {"global_batch_size": 4, "micro_batch_size": 1}
CASES = {"pp2_tp2": ({"pp": 2, "tp": 2}, False), "pp2_ep2": ({"pp": 2, "ep": 2}, True),
         "ep2_tp2": ({"ep": 2, "tp": 2}, True)}
# resumed from the checkpoint before the last step: the same plan, and others (the data position
# is elastic: on another data-parallel degree the next global batch holds other rows)
RESUMES = {"pp2_tp2": {"same": {"pp": 2, "tp": 2}, "tp4": {"tp": 4}, "tp2": {"tp": 2},
                       "pp2": {"pp": 2}, "dp4": {}},
           "pp2_ep2": {"ep2_tp2": {"ep": 2, "tp": 2}, "ep2": {"ep": 2}}}
SAME_BATCH = {"same", "tp4", "ep2_tp2"}  # the writing plan's data-parallel degree


def make_config(out_dir: str, degrees: dict, moe: bool):
    from tests.dist.test_expert_parallel import MOE
    cfg = tiny_config(out_dir, steps=STEPS, weight_decay=0.1, **BATCH)
    if moe:
        cfg.model.llm.config = dict(MOE)
    for key, value in degrees.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _setup(cfg, rank, world, weights=None):
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.train.setup import setup_training
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    return plan, setup_training(cfg, derive_ds_config(cfg, ds_config(1), plan), rank, plan,
                                weights)


def _train_and_save(rank, world, cfg) -> dict:
    """STEPS steps, a checkpoint before the last and after it; the losses, each step's keys."""
    from ds_omni.train import checkpoint
    from ds_omni.train.step import train_step
    _, (built, loader, engine, groups) = _setup(cfg, rank, world)
    if rank == 0:
        checkpoint.save_model_meta(checkpoint.checkpoint_root(cfg.train.output_dir), built)
    out = {"losses": [], "keys": []}
    for step in range(STEPS):
        if step == STEPS - 1:
            checkpoint.save(engine, cfg.train.output_dir, step, loader.state_dict(), rank)
        batch = loader.next_step()
        out["keys"].append(batch.keys)
        out["losses"].append(train_step(engine, batch, groups).loss)
    checkpoint.save(engine, cfg.train.output_dir, STEPS, loader.state_dict(), rank)
    loader.close()
    return out


def _resume(rank, world, cfg, source: Path) -> dict:
    """Resume `cfg`'s plan from the checkpoint `source` wrote before its last step (a copy,
    without the final one) and train that step again."""
    import torch.distributed as dist
    from ds_omni.train import checkpoint, reshard
    from ds_omni.train.loop import resume_from
    from ds_omni.train.step import train_step
    root = checkpoint.checkpoint_root(cfg.train.output_dir)
    if rank == 0:
        shutil.copytree(checkpoint.checkpoint_root(source), root,
                        ignore=shutil.ignore_patterns(checkpoint.tag_for(STEPS)))
        (root / "latest").write_text(checkpoint.tag_for(STEPS - 1))
    dist.barrier()
    plan = oracle_plan(cfg, world)
    weights = reshard.resharded_weights(cfg.train.output_dir, plan, rank)
    _, (built, loader, engine, groups) = _setup(cfg, rank, world, weights)
    start = resume_from(engine, loader, cfg.train.output_dir, rank, resharded=weights is not None)
    with hf_layout({}):  # the weights as loaded, whole (TP gathered, experts in HF's layout)
        params, names = oracle_ranks.full_params(engine), oracle_ranks.omni_names(engine, built)
    batch = loader.next_step()
    loss = train_step(engine, batch, groups).loss
    loader.close()
    return {"start": start, "loss": loss, "keys": batch.keys, "resharded": weights is not None,
            "dp": plan.dp, "params": {names[k]: v for k, v in params.items()}}


def oracle_plan(cfg, world):
    from ds_omni.parallel.plan import ParallelPlan
    return ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)


def _ranks(rank, world, out):
    results = {}
    for name, (degrees, moe) in CASES.items():
        results[name] = _train_and_save(rank, world, make_config(f"{out}/{name}", degrees, moe))
        for plan_name, other in RESUMES.get(name, {}).items():
            results[f"{name}->{plan_name}"] = _resume(
                rank, world, make_config(f"{out}/{name}-{plan_name}", other, moe),
                Path(f"{out}/{name}"))
    return results


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_plans")
    return out, run_on_ranks(_ranks, 4, args=(str(out),), timeout=1200)


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_composed_checkpoint_exports_to_hf_equal_to_one_process(case, launch, tmp_path):
    from transformers import AutoModelForImageTextToText
    from ds_omni.model.build import build_model
    from ds_omni.model.convert import consolidate_checkpoint, export_checkpoint
    out, _ = launch
    degrees, moe = CASES[case]
    root = out / case / "checkpoints"
    hf_dir = export_checkpoint(root, tmp_path / "hf")
    hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir))  # plain transformers
    state = consolidate_checkpoint(root)
    cfg = make_config(str(tmp_path / "ref"), {}, moe)
    plan = oracle_plan(make_config(str(tmp_path / "p"), degrees, moe), 4)
    ref = oracle.run_reference(cfg, oracle.reference_step_keys(cfg, build_model(cfg.model),
                                                               plan.dp, STEPS))
    oracle.assert_params_match(ref, state, f"{case} export")
    key_map = build_model(cfg.model).model.hf_key_map()
    hf_state = hf.state_dict()
    assert set(hf_state) == set(key_map), sorted(set(hf_state) ^ set(key_map))[:5]
    for hf_key, omni_key in key_map.items():
        assert hf_state[hf_key].equal(state[omni_key]), (case, hf_key)


@pytest.mark.dist
def test_a_checkpoint_resumes_on_another_plan_with_its_weights_and_next_loss(launch):
    """Right after the load every plan holds the checkpoint's weights exactly (its consolidated
    state); the resumed step's loss equals the writing plan's exactly on the same plan, and to
    1e-6 relative on another plan of the same data-parallel degree (the same global batch)."""
    from ds_omni.model.convert import consolidate_checkpoint
    from ds_omni.train.checkpoint import tag_for
    out, results = launch
    for name, plans in RESUMES.items():
        saved = consolidate_checkpoint(out / name / "checkpoints", tag_for(STEPS - 1))
        want = results[0][name]["losses"][STEPS - 1]
        want_keys = {k for r in results for k in r[name]["keys"][STEPS - 1]}
        for plan_name in plans:
            got = [r[f"{name}->{plan_name}"] for r in results]
            where = f"{name} -> {plan_name}"
            assert all(g["start"] == STEPS - 1 for g in got), where
            assert all(g["resharded"] == (plan_name != "same") for g in got), where
            loaded = {k: v for g in got for k, v in g["params"].items()}
            assert loaded.keys() == saved.keys(), (where, sorted(loaded.keys() ^ saved.keys()))
            for key, value in saved.items():
                assert loaded[key].equal(value), f"{where}: {key} not loaded as saved"
            if plan_name in SAME_BATCH:
                keys = {k for g in got for k in g["keys"]}
                assert keys == want_keys, f"{where}: the resumed step trained other rows"
            loss = got[0]["loss"]
            if plan_name == "same":
                assert loss == want, (where, loss, want)
            elif plan_name in SAME_BATCH:
                assert loss == pytest.approx(want, rel=1e-6), (where, loss, want)
