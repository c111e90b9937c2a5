"""Data-parallel training equals one process running the same global batches.

Oracle: plain PyTorch in one process (no DeepSpeed): same model init, the same global batches
(the samples the ranks trained on, by key, loaded again in one process), loss = sum of token
losses / global target tokens, torch AdamW, the same gradient clipping. After two steps with
gradient accumulation, the losses and every parameter must agree to fp32 precision.

Cases: the demo composition (LLaVA) under ZeRO 0-3; every other family under ZeRO-3 (images of
several sizes, M-RoPE positions, audio clips), with text-only samples mixed in so that some ranks
have micro-batches with nothing to encode (where DeepSpeed's ZeRO-3 would otherwise hang).
"""

import json

import pytest
import torch

from tests.fixtures import ADAM_EPS, ds_config, tiny_config
from tests.harness import run_on_ranks

STEPS = 2
LR = 1e-3  # tiny_config's learning rate
# Adam turns reduction-order noise in near-zero gradients into updates of up to the step size:
# parameters must agree to within 0.2% of the total step size (4e-6)
PARAM_ATOL = 2e-3 * LR * STEPS


def _full_params(engine) -> dict[str, torch.Tensor]:
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()),
                                           enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().clone().float() for n, p in params.items()}


def _config(case: dict, out_dir: str):
    cfg = tiny_config(out_dir, steps=STEPS, **case.get("train", {}))
    if case.get("reorder"):
        from ds_omni.config import ReorderConfig
        cfg.data.reorder = ReorderConfig(**case["reorder"])
    if case.get("model_dir"):
        cfg.model.pretrained, cfg.model.tokenizer = case["model_dir"], None
        cfg.model.vision = cfg.model.llm = None
    if case.get("sources"):
        from ds_omni.config import SourceConfig, from_dict
        cfg.data.sources = [from_dict(SourceConfig, s) for s in case["sources"]]
    return cfg


def _train_ranks(rank, world, cases, out_dir):
    from ds_omni.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.engine import setup_training, train_step
    results = {}
    for name, case in cases.items():
        for stage in case["stages"]:
            cfg = _config(case, f"{out_dir}/{name}{stage}")
            plan = ParallelPlan.from_config(cfg.parallel, world)
            built, loader, engine = setup_training(
                cfg, derive_ds_config(cfg, ds_config(stage), plan), rank, plan)
            losses, keys, empty = [], [], 0
            for _ in range(STEPS):
                batch = loader.next_step()
                empty += sum(not mb.encoder_inputs for mb in batch.micro_batches)
                keys.append(batch.keys)
                losses.append(train_step(engine, batch, plan.dp, loader.comm.dp_group).loss)
            results[(name, stage)] = {"losses": losses, "params": _full_params(engine),
                                      "keys": keys, "empty_micro_batches": empty}
    return results


def _reference(case, out_dir, step_keys):
    """One process, no DeepSpeed, on the samples the ranks trained on (`step_keys[step]`)."""
    from ds_omni.data.build import build_loader
    from ds_omni.data.packing import pack
    from ds_omni.model.build import build_model
    cfg = _config(case, out_dir)
    built = build_model(cfg.model)
    model = built.model
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    loader = build_loader(cfg, built, dp_rank=0, dp_size=1, num_micro=1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(0.9, 0.95), eps=ADAM_EPS,
                            weight_decay=cfg.train.weight_decay)
    losses, with_grad = [], set()
    for keys in step_keys:
        samples = loader.load_samples(keys)
        micro_batches = [pack(samples[i:i + 3], built.item_processors)  # any split: same sums
                         for i in range(0, len(samples), 3)]
        total = sum(mb.num_targets for mb in micro_batches)
        opt.zero_grad()
        loss_sum = 0.0
        for mb in micro_batches:
            out = model(mb)
            (out.loss_sum / total).backward()
            loss_sum += out.loss_sum.item()
        with_grad |= {n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss_sum / total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, init, with_grad


def _text_source(tmp_path) -> dict:
    rows = [{"id": f"t{i}", "text": f"A plain sentence number {i} with no picture."} for i in range(64)]
    path = tmp_path / "text.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {"name": "text", "path": str(path), "weight": 3.0,
            "schema": {"text": "text", "image": None}}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from tests import family_dirs
    tmp = tmp_path_factory.mktemp("families")
    text = _text_source(tmp)
    shapes = {"name": "shapes", "path": "builtin:shapes"}
    tones = {"name": "tones", "path": "builtin:tones",
             "schema": {"text": "conversations", "image": None, "audio": "audio"}}
    vision = [shapes, text]
    return {
        "demo": {"stages": [0, 1, 2, 3]},
        "llava_next": {"stages": [3], "model_dir": str(family_dirs.make_llava_next_dir(tmp / "n")),
                       "sources": vision},
        "qwen2_vl": {"stages": [3], "model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q")),
                     "sources": vision},
        "qwen2_audio": {"stages": [3], "model_dir": str(family_dirs.make_qwen2_audio_dir(tmp / "a")),
                        "sources": [tones, text]},
    }


@pytest.mark.dist
def test_data_parallel_matches_single_process(cases, tmp_path):
    results = run_on_ranks(_train_ranks, 2, args=(cases, str(tmp_path / "dp")), timeout=420)
    for name, case in cases.items():
        _check(name, case, results, tmp_path, samples_per_step=8)


@pytest.mark.dist
def test_budget_mode_in_two_groups_of_two_ranks(tmp_path):
    """4 ranks, reorder groups of 2, budget mode: each rank's share varies per step."""
    cases = {"budget": {"stages": [2], "reorder": {"mode": "budget", "group_size": 2},
                        "train": {"micro_batch_size": 1}}}
    results = run_on_ranks(_train_ranks, 4, args=(cases, str(tmp_path / "dp")), timeout=420)
    _check("budget", cases["budget"], results, tmp_path, samples_per_step=None)


def _check(name, case, results, tmp_path, samples_per_step):
    first = case["stages"][0]
    step_keys = [sorted(k for r in results for k in r[(name, first)]["keys"][s])
                 for s in range(STEPS)]
    assert all(len(keys) == len(set(keys)) > 0 for keys in step_keys)
    if samples_per_step:
        assert all(len(keys) == samples_per_step for keys in step_keys)
    ref_losses, ref_params, init, with_grad = _reference(case, str(tmp_path / f"ref_{name}"),
                                                         step_keys)
    for stage in case["stages"]:
        for rank_result in results:
            got = rank_result[(name, stage)]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-7), (name, stage)
            assert got["params"].keys() == ref_params.keys()
            for key, ref in ref_params.items():
                torch.testing.assert_close(got["params"][key], ref, rtol=1e-5, atol=PARAM_ATOL,
                                           msg=lambda m: f"{name} ZeRO-{stage} {key}: {m}")
    # the parameters moved: the comparison is not between two untouched inits (only layers
    # off the model's path, e.g. vision layers after the feature layer, get no gradient)
    assert len(with_grad) > 0.7 * len(ref_params), name
    assert not [k for k in with_grad if torch.equal(ref_params[k], init[k])], name
    if case.get("sources"):  # text-only micro-batches really happened somewhere
        assert sum(r[(name, case["stages"][0])]["empty_micro_batches"] for r in results) > 0, name
