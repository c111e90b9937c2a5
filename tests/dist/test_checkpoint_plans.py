"""Checkpoints of composed plans (slow tier, one 4-rank launch): exported to HF's layout equal to
one process, and resumed on another plan.

Each case trains 3 steps (ZeRO-1, 4 micro-batches a step) and saves after the first step and after
the last: pp2 x tp2 (the tiny LLaVA), pp2 x ep2 and ep2 x tp2 (the tiny LLaVA with a Qwen3-MoE
LLM: 4 experts, top-2, aux loss on). The final checkpoint exports (`export_checkpoint`: the
pipeline's names mapped, AutoTP's shards joined, AutoEP's experts stacked) to a folder that plain
transformers loads, and its weights equal the oracle's one-process run (`tests/oracle`) to the
parity tolerance. The checkpoint saved after the first step is resumed in the same launch on the
same plan (DeepSpeed's own loading) and on other plans (ds_omni's consolidation and the whole
moments each save writes, `ds_omni.train.reshard` / `moments`): pp2 x tp2 -> tp4 (ZeRO-2), tp2
(ZeRO-0), pp2, dp4; pp2 x ep2 -> ep2 x tp2, ep2 (ZeRO-2); each trains the last two steps again.
Right after the load every plan holds the checkpoint's weights exactly; the two resumed steps'
losses and the parameters after them equal the oracle trained on the same rows (the first step's
rows, then the resumed ones: on another data-parallel degree the data position is elastic), and,
on a plan of the writing plan's data-parallel degree, the writing plan's own losses (exactly on
the same plan, 1e-6 relative on another). Planted errors (`tests/plants/checkpoint.py`: a TP
shard's moments joined in the wrong order, the experts' moments stacked in the wrong order) each
resume once and must fail it; the export's are caught in one process
(tests/unit/model/test_consolidate.py).
"""

import shutil
from pathlib import Path

import pytest

from tests import oracle, plants
from tests.dist.test_expert_parallel import hf_layout
from tests.oracle import ranks as oracle_ranks
from tests.fixtures import ds_config, tiny_config
from tests.harness import run_on_ranks

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]

STEPS = 3
RESUME_AT = 1  # the checkpoint resumed from: after the first step (two steps follow)
BATCH = {"global_batch_size": 4, "micro_batch_size": 1}
CASES = {"pp2_tp2": ({"pp": 2, "tp": 2}, False), "pp2_ep2": ({"pp": 2, "ep": 2}, True),
         "ep2_tp2": ({"ep": 2, "tp": 2}, True)}
# resumed from the checkpoint after the first step: the same plan, and others (degrees, ZeRO stage)
RESUMES = {"pp2_tp2": {"same": ({"pp": 2, "tp": 2}, 1), "tp4": ({"tp": 4}, 2),
                       "tp2": ({"tp": 2}, 0), "pp2": ({"pp": 2}, 1), "dp4": ({}, 1)},
           "pp2_ep2": {"ep2_tp2": ({"ep": 2, "tp": 2}, 1), "ep2": ({"ep": 2}, 2)}}
SAME_BATCH = {"same", "tp4", "ep2_tp2"}  # the writing plan's data-parallel degree
PLANTED = {"ckpt_moments_tp_order": ("pp2_tp2", "tp4"),
           "ckpt_moments_expert_order": ("pp2_ep2", "ep2_tp2")}  # plant -> (case, resumed plan)


def make_config(out_dir: str, degrees: dict, moe: bool):
    from tests.dist.test_expert_parallel import MOE
    cfg = tiny_config(out_dir, steps=STEPS, weight_decay=0.1, **BATCH)
    if moe:
        cfg.model.llm.config = dict(MOE)
    for key, value in degrees.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _setup(cfg, rank, world, weights=None, zero: int = 1):
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.train.setup import setup_training
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    return plan, setup_training(cfg, derive_ds_config(cfg, ds_config(zero), plan), rank, plan,
                                weights)


def _train_and_save(rank, world, cfg) -> dict:
    """STEPS steps, a checkpoint after the first and after the last; each step's loss and keys."""
    from ds_omni.train import checkpoint
    from ds_omni.train.step import train_step
    _, (built, loader, engine, groups) = _setup(cfg, rank, world)
    if rank == 0:
        checkpoint.save_model_meta(checkpoint.checkpoint_root(cfg.train.output_dir), built)
    out = {"losses": [], "keys": []}
    for step in range(STEPS):
        if step == RESUME_AT:
            checkpoint.save(engine, cfg.train.output_dir, step, loader.state_dict(), rank)
        batch = loader.next_step()
        out["keys"].append(batch.keys)
        out["losses"].append(train_step(engine, batch, groups).loss)
    checkpoint.save(engine, cfg.train.output_dir, STEPS, loader.state_dict(), rank)
    loader.close()
    return out


def _resume(rank, world, cfg, source: Path, zero: int) -> dict:
    """Resume `cfg`'s plan (under ZeRO `zero`) from the checkpoint `source` wrote after its first
    step (a copy, without the final one) and train the last steps again: the weights as loaded
    and after those steps (whole, OmniModel names), each step's loss and keys."""
    import torch.distributed as dist
    from ds_omni.train import checkpoint, reshard
    from ds_omni.train.loop import resume_from
    from ds_omni.train.step import train_step
    root = checkpoint.checkpoint_root(cfg.train.output_dir)
    if rank == 0:
        shutil.copytree(checkpoint.checkpoint_root(source), root,
                        ignore=shutil.ignore_patterns(checkpoint.tag_for(STEPS)))
        (root / "latest").write_text(checkpoint.tag_for(RESUME_AT))
    dist.barrier()
    plan = oracle_plan(cfg, world)
    resharded = reshard.resharded_checkpoint(cfg.train.output_dir, plan, rank)
    _, (built, loader, engine, groups) = _setup(
        cfg, rank, world, resharded.weights if resharded is not None else None, zero)
    coords = plan.coords(rank)
    keep = coords.dp_rank == coords.tp_rank == 0  # a stage's whole parameters: one rank's
    out = {"start": resume_from(engine, loader, cfg.train.output_dir, rank, resharded),
           "resharded": resharded is not None, "dp_rank": coords.dp_rank,
           "loaded": _whole_params(engine, built, keep), "losses": [], "keys": []}
    for _ in range(RESUME_AT, STEPS):
        batch = loader.next_step()
        out["keys"].append(batch.keys)
        out["losses"].append(train_step(engine, batch, groups).loss)
    out["params"] = _whole_params(engine, built, keep)
    loader.close()
    return out


def _whole_params(engine, built, keep: bool) -> dict:
    """The engine's parameters whole (TP gathered, experts in HF's layout), OmniModel names;
    every rank gathers, those that `keep` them return them."""
    with hf_layout({}):
        params, names = oracle_ranks.full_params(engine), oracle_ranks.omni_names(engine, built)
    return {names[k]: v for k, v in params.items()} if keep else {}


def oracle_plan(cfg, world):
    from ds_omni.parallel.plan import ParallelPlan
    return ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)


def _ranks(rank, world, out):
    results = {}
    for name, (degrees, moe) in CASES.items():
        results[name] = _train_and_save(rank, world, make_config(f"{out}/{name}", degrees, moe))
        for plan_name, (other, zero) in RESUMES.get(name, {}).items():
            results[f"{name}->{plan_name}"] = _resume(
                rank, world, make_config(f"{out}/{name}-{plan_name}", other, moe),
                Path(f"{out}/{name}"), zero)
    for plant, (name, plan_name) in PLANTED.items():
        other, zero = RESUMES[name][plan_name]
        with plants.applied(plant, rank):
            results[f"plant-{plant}"] = _resume(
                rank, world, make_config(f"{out}/plant-{plant}", other, CASES[name][1]),
                Path(f"{out}/{name}"), zero)
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


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The oracle of a case trained on given rows, one run per distinct rows (cached)."""
    made = {}

    def reference(name: str, step_keys: list[list[str]]):
        key = (name, tuple(tuple(k) for k in step_keys))
        if key not in made:
            cfg = make_config(str(tmp_path_factory.mktemp("ref")), {}, CASES[name][1])
            made[key] = oracle.run_reference(cfg, step_keys)
        return made[key]
    return reference


def _check_resume(out: Path, results: list[dict], name: str, plan_name: str, got: list[dict],
                  references) -> None:
    """One resume of case `name` on `plan_name` (`got`: every rank's result) continues as the
    writing plan would: the weights loaded as saved, the resumed steps' losses and the
    parameters after them equal the oracle's on the same rows (and the writing plan's own
    losses where the data-parallel degree is the same)."""
    from ds_omni.model.build import build_model
    from ds_omni.model.convert import consolidate_checkpoint
    from ds_omni.train.checkpoint import tag_for
    where = f"{name} -> {plan_name}"
    assert all(g["start"] == RESUME_AT for g in got), where
    assert all(g["resharded"] == (plan_name != "same") for g in got), where
    saved = consolidate_checkpoint(out / name / "checkpoints", tag_for(RESUME_AT))
    loaded = {k: v for g in got for k, v in g["loaded"].items()}
    assert loaded.keys() == saved.keys(), (where, sorted(loaded.keys() ^ saved.keys()))
    for key, value in saved.items():
        assert loaded[key].equal(value), f"{where}: {key} not loaded as saved"
    readers = {}  # each data-parallel rank's first rank: the rows it trained
    for g in got:
        readers.setdefault(g["dp_rank"], g)
    resumed = [sorted(k for g in readers.values() for k in g["keys"][i])
               for i in range(STEPS - RESUME_AT)]
    writer = results[0][name]
    cfg = make_config(str(out / "keys"), {}, CASES[name][1])
    first = oracle.reference_step_keys(cfg, build_model(cfg.model),
                                       oracle_plan(make_config(str(out / "p"), CASES[name][0],
                                                               CASES[name][1]), 4).dp, RESUME_AT)
    ref = references(name, first + resumed)
    losses = got[0]["losses"]
    assert losses == pytest.approx(ref.losses[RESUME_AT:], rel=1e-6, abs=1e-7), (
        f"{where}: resumed losses {losses}, the oracle's {ref.losses[RESUME_AT:]}")
    if plan_name in SAME_BATCH:
        for i, keys in enumerate(resumed):
            assert set(keys) == {k for r in results for k in r[name]["keys"][RESUME_AT + i]}, \
                f"{where}: resumed step {i} trained other rows"
        want = writer["losses"][RESUME_AT:]
        assert losses == (want if plan_name == "same" else pytest.approx(want, rel=1e-6)), (
            f"{where}: resumed losses {losses}, the writing plan's {want}")
    oracle.assert_params_match(ref, {k: v for g in got for k, v in g["params"].items()}, where)


@pytest.mark.dist
@pytest.mark.parametrize("resume", [f"{n}->{p}" for n, plans in RESUMES.items() for p in plans])
def test_a_checkpoint_resumes_on_another_plan_and_continues_as_the_writing_plan(
        resume, launch, references):
    """The loaded weights are the checkpoint's exactly; two steps on: losses and parameters
    equal the oracle's on the same rows (Adam's moments and step carried across plans)."""
    out, results = launch
    name, plan_name = resume.split("->")
    _check_resume(out, results, name, plan_name, [r[resume] for r in results], references)


def test_every_checkpoint_plant_has_a_case():
    assert sorted(PLANTED) == plants.for_launch("ckpt_plans")


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("ckpt_plans"))
def test_plant_is_caught(plant, launch, references):
    out, results = launch
    name, plan_name = PLANTED[plant]
    with pytest.raises(AssertionError, match="losses|param"):
        _check_resume(out, results, name, plan_name, [r[f"plant-{plant}"] for r in results],
                      references)
