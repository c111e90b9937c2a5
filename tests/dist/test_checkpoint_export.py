"""Checkpoints of every ZeRO stage export to HF with exactly the trained weights; frozen parts
get no gradient, no optimizer state and do not move; LoRA under ZeRO 2 and 3 trains only its
adapters (and the parts kept trainable), resumes exactly and exports merged or as an adapter."""

import pytest
import torch

from tests.oracle import full_params as _full_params
from tests.fixtures import ds_config, tiny_config
from tests.harness import run_on_ranks

STAGES = (0, 1, 2, 3)


def _train_and_save(rank, world, root):
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train import checkpoint
    from ds_omni.train.setup import setup_training
    from ds_omni.train.step import train_step
    params = {}
    for stage in STAGES:
        cfg = tiny_config(f"{root}/zero{stage}", steps=1)
        plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
        built, loader, engine, ranks = setup_training(
            cfg, derive_ds_config(cfg, ds_config(stage), plan), rank, plan)
        train_step(engine, loader.next_step(), ranks)
        if rank == 0:
            checkpoint.save_model_meta(checkpoint.checkpoint_root(cfg.train.output_dir), built)
        checkpoint.save(engine, cfg.train.output_dir, 1, loader.state_dict(), rank)
        params[stage] = _full_params(engine)
    return {"plain": params, "lora": _lora_ranks(rank, world, root),
            "frozen": {stage: _frozen_ranks(rank, world, f"{root}/frozen{stage}", stage)
                       for stage in (2, 3)}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of 2 ranks: the plain runs of every stage, the LoRA runs, the frozen-part runs."""
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_on_ranks(_train_and_save, 2, args=(str(root),), timeout=600)[0]


@pytest.mark.dist
def test_every_zero_stage_exports_the_trained_weights(runs):
    from transformers import LlavaForConditionalGeneration
    from ds_omni.model.convert import export_checkpoint, model_from_meta
    tmp_path, trained = runs[0], runs[1]["plain"]
    for stage in STAGES:
        ckpt = tmp_path / f"zero{stage}" / "checkpoints"
        out = export_checkpoint(ckpt, tmp_path / f"hf{stage}")
        hf_state = LlavaForConditionalGeneration.from_pretrained(out).state_dict()
        omni, _ = model_from_meta(ckpt / "model")
        key_map = omni.hf_key_map()
        assert set(hf_state) == set(key_map)
        for hf_key, omni_key in key_map.items():
            assert torch.equal(hf_state[hf_key], trained[stage][omni_key]), (stage, hf_key)


def _frozen_ranks(rank, world, root, stage):
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.setup import setup_training
    from ds_omni.train.step import train_step
    cfg = tiny_config(root, steps=2)
    cfg.model.freeze = ["vision", "projector"]
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    built, loader, engine, ranks = setup_training(
        cfg, derive_ds_config(cfg, ds_config(stage), plan), rank, plan)
    before = _full_params(engine)
    for _ in range(2):
        train_step(engine, loader.next_step(), ranks)
    after = _full_params(engine)
    groups = engine.optimizer.fp16_groups if stage == 3 else engine.optimizer.bit16_groups
    in_optimizer = {id(p) for g in groups for p in g}
    names = {n for n, p in engine.module.named_parameters() if id(p) in in_optimizer}
    return before, after, names


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parts_have_no_optimizer_state_and_stay_put(runs, stage):
    before, after, in_optimizer = runs[1]["frozen"][stage]
    frozen = [n for n in before if n.startswith("encoders.vision.")]
    assert frozen and not (set(frozen) & in_optimizer)
    assert in_optimizer == {n for n in before if n.startswith("backbone.")}
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    assert any(not torch.equal(before[n], after[n]) for n in in_optimizer)


LORA = dict(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"], trainable=["projector"])


def _lora_ranks(rank, world, root):
    """Per ZeRO stage (2, 3): train a step and save; under ZeRO-3 train another, then a fresh
    engine resumes from the checkpoint and trains that second step again."""
    from ds_omni.config import LoraConfig
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train import checkpoint
    from ds_omni.train.setup import setup_training
    from ds_omni.train.step import train_step
    out = {}
    for stage, export in ((2, "merged"), (3, "adapter")):
        cfg = tiny_config(f"{root}/lora{stage}", steps=2)
        cfg.model.lora = LoraConfig(**LORA, export=export)
        plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
        ds = derive_ds_config(cfg, ds_config(stage), plan)
        built, loader, engine, ranks = setup_training(cfg, ds, rank, plan)
        before = _full_params(engine)
        train_step(engine, loader.next_step(), ranks)
        if rank == 0:
            checkpoint.save_model_meta(checkpoint.checkpoint_root(cfg.train.output_dir), built)
        checkpoint.save(engine, cfg.train.output_dir, 1, loader.state_dict(), rank)
        groups = engine.optimizer.fp16_groups if stage == 3 else engine.optimizer.bit16_groups
        in_optimizer = {id(p) for g in groups for p in g}
        out[stage] = dict(before=before, saved=_full_params(engine),
                          in_optimizer={n for n, p in engine.module.named_parameters()
                                        if id(p) in in_optimizer})
    second = train_step(engine, loader.next_step(), ranks).loss
    after = _full_params(engine)
    _, loader, engine, ranks = setup_training(cfg, ds, rank, plan)
    step, state = checkpoint.load(engine, cfg.train.output_dir, rank)
    loader.load_state_dict(state)
    resumed = train_step(engine, loader.next_step(), ranks).loss
    out["resume"] = dict(step=step, second=second, after=after, resumed=resumed,
                         resumed_params=_full_params(engine))
    return out


@pytest.mark.dist
def test_lora_under_zero_2_and_3_trains_adapters_resumes_exactly_and_exports(runs):
    """Only the adapters and the projector train (and have optimizer state); a resumed run
    repeats the second step exactly (ZeRO-3); the checkpoint exports merged (plain transformers)
    or as base + adapter directory (PeftModel.from_pretrained), both giving the trained logits."""
    tmp_path, results = runs[0], dict(runs[1]["lora"])
    resume = results.pop("resume")
    for stage, got in results.items():
        trained = {n for n in got["before"] if "lora_" in n or ".projector." in n}
        assert got["in_optimizer"] == trained and any("lora_B" in n for n in trained), stage
        moved = {n for n in got["before"] if not torch.equal(got["before"][n], got["saved"][n])}
        assert moved and moved <= trained, (stage, sorted(moved - trained)[:3])
        _check_lora_export(tmp_path, stage, got["saved"])
    assert resume["step"] == 1 and resume["resumed"] == resume["second"]
    for name, want in resume["after"].items():
        torch.testing.assert_close(resume["resumed_params"][name], want, rtol=0, atol=0)


def _check_lora_export(tmp_path, stage, saved):
    import peft
    from transformers import LlavaForConditionalGeneration
    from ds_omni.config import LoraConfig
    from ds_omni.model.build import build_model
    from ds_omni.model.convert import export_checkpoint
    from tests.family_checks import omni_logits
    from tests.unit.model.test_family_llava import _hf_inputs, _samples
    out = export_checkpoint(tmp_path / f"lora{stage}" / "checkpoints", tmp_path / f"lora_hf{stage}")
    hf = LlavaForConditionalGeneration.from_pretrained(str(out))
    if stage == 3:  # export "adapter"
        hf = peft.PeftModel.from_pretrained(hf, str(out / "adapter"))
    cfg = tiny_config(str(tmp_path / "ref"))
    cfg.model.lora = LoraConfig(**LORA)
    built = build_model(cfg.model)
    built.model.load_state_dict(saved, strict=False)
    samples = _samples(built)
    with torch.no_grad():
        _, ours = omni_logits(built, samples)
        for sample, want in zip(samples, ours):
            torch.testing.assert_close(hf(**_hf_inputs(sample)).logits[0], want, rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"ZeRO-{stage}: {m}")
