"""Data-parallel training under ZeRO 0-3 equals one process running the same global batches.

Oracle: plain PyTorch in one process (no DeepSpeed): same model init, same global batches, loss =
sum of token losses / global target tokens, torch AdamW, the same gradient clipping. After two
steps with gradient accumulation, the losses and every parameter must agree to fp32 precision.
"""

import pytest
import torch

from ds_omni.data.loader import StepBatch
from tests.fixtures import ADAM_EPS, ds_config, tiny_config
from tests.harness import run_on_ranks

STEPS = 2
STAGES = (0, 1, 2, 3)


def _full_params(engine) -> dict[str, torch.Tensor]:
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().clone().float() for n, p in params.items()}


def _train_ranks(rank, world, out_dir):
    from ds_omni.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.engine import setup_training, train_step
    results = {}
    for stage in STAGES:
        cfg = tiny_config(out_dir, steps=STEPS)
        plan = ParallelPlan.from_config(cfg.parallel, world)
        built, loader, engine = setup_training(cfg, derive_ds_config(cfg, ds_config(stage), plan),
                                               rank, plan)
        assert engine.gradient_accumulation_steps() == 2
        losses = [train_step(engine, loader.next_step(), plan.dp).loss for _ in range(STEPS)]
        results[stage] = {"losses": losses, "params": _full_params(engine)}
    return results


def _reference(out_dir):
    from ds_omni.model.build import build_model
    from ds_omni.train.engine import build_loader
    cfg = tiny_config(out_dir, steps=STEPS)
    built = build_model(cfg.model)
    model = built.model
    loader = build_loader(cfg, built, dp_rank=0, dp_size=1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(0.9, 0.95), eps=ADAM_EPS,
                            weight_decay=cfg.train.weight_decay)
    torch.manual_seed(cfg.train.seed)
    losses = []
    for _ in range(STEPS):
        batch: StepBatch = loader.next_step()
        total = sum(mb.num_targets for mb in batch.micro_batches)
        opt.zero_grad()
        loss_sum = 0.0
        for mb in batch.micro_batches:
            out = model(mb)
            (out.loss_sum / total).backward()
            loss_sum += out.loss_sum.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss_sum / total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.dist
def test_zero_stages_match_single_process(tmp_path):
    ref_losses, ref_params = _reference(str(tmp_path / "ref"))
    results = run_on_ranks(_train_ranks, 2, args=(str(tmp_path / "dp"),), timeout=240)
    for stage in STAGES:
        for rank_result in results:
            got = rank_result[stage]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-7), f"ZeRO-{stage}"
            assert got["params"].keys() == ref_params.keys()
            for name, ref in ref_params.items():
                torch.testing.assert_close(got["params"][name], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"ZeRO-{stage} {name}: {m}")
    # the parameters did move: the comparison is not between two untouched inits
    from ds_omni.model.build import build_model
    init = dict(build_model(tiny_config(str(tmp_path / "i")).model).model.named_parameters())
    # (CLIP's post_layernorm is off LLaVA's feature path: it gets no gradient)
    trained = [n for n in ref_params if "post_layernorm" not in n]
    assert not [n for n in trained if torch.equal(ref_params[n], init[n].detach())]
