"""Checkpoints of every ZeRO stage export to HF with exactly the trained weights; frozen parts
get no gradient, no optimizer state and do not move."""

import pytest
import torch

from tests.oracle import full_params as _full_params
from tests.fixtures import ds_config, tiny_config
from tests.harness import run_on_ranks

STAGES = (0, 1, 2, 3)


def _train_and_save(rank, world, root):
    from ds_omni.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train import checkpoint
    from ds_omni.train.engine import setup_training, train_step
    params = {}
    for stage in STAGES:
        cfg = tiny_config(f"{root}/zero{stage}", steps=1)
        plan = ParallelPlan.from_config(cfg.parallel, world)
        built, loader, engine = setup_training(cfg, derive_ds_config(cfg, ds_config(stage), plan),
                                               rank, plan)
        train_step(engine, loader.next_step(), loader.comm)
        if rank == 0:
            checkpoint.save_model_meta(checkpoint.checkpoint_root(cfg.train.output_dir), built)
        checkpoint.save(engine, cfg.train.output_dir, 1, loader.state_dict(), rank)
        params[stage] = _full_params(engine)
    return params


@pytest.mark.dist
def test_every_zero_stage_exports_the_trained_weights(tmp_path):
    from transformers import LlavaForConditionalGeneration
    from ds_omni.model.convert import export_checkpoint, model_from_meta
    trained = run_on_ranks(_train_and_save, 2, args=(str(tmp_path),), timeout=240)[0]
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
    from ds_omni.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.engine import setup_training, train_step
    cfg = tiny_config(root, steps=2)
    cfg.model.freeze = ["vision", "projector"]
    plan = ParallelPlan.from_config(cfg.parallel, world)
    built, loader, engine = setup_training(cfg, derive_ds_config(cfg, ds_config(stage), plan),
                                           rank, plan)
    before = _full_params(engine)
    for _ in range(2):
        train_step(engine, loader.next_step(), loader.comm)
    after = _full_params(engine)
    groups = engine.optimizer.fp16_groups if stage == 3 else engine.optimizer.bit16_groups
    in_optimizer = {id(p) for g in groups for p in g}
    names = {n for n, p in engine.module.named_parameters() if id(p) in in_optimizer}
    return before, after, names


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parts_have_no_optimizer_state_and_stay_put(tmp_path, stage):
    before, after, in_optimizer = run_on_ranks(_frozen_ranks, 2, args=(str(tmp_path), stage),
                                               timeout=180)[0]
    frozen = [n for n in before if n.startswith("encoders.vision.")]
    assert frozen and not (set(frozen) & in_optimizer)
    assert in_optimizer == {n for n in before if n.startswith("backbone.")}
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    assert any(not torch.equal(before[n], after[n]) for n in in_optimizer)
