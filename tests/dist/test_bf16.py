"""bf16 training equals one process training in bf16 on the same global batch, as far as bf16 can.

One 2-rank launch trains, 3 steps each under `"bf16": {"enabled": true}`: the demo composition
(LLaVA) data-parallel under ZeRO 0-3, under Ulysses SP=2 (ZeRO-2), with the encoder pool
(ZeRO-1, rank 0's rows hold every image), and over 2 pipeline stages, where DeepSpeed steps with
its `BF16_Optimizer`: the image+audio composition with "uniform" and "bubbles" encoder placement
(ZeRO-0; "bubbles" also against "uniform"), LLaVA
with its encoder on stage 0 under ZeRO-0 and under ZeRO-1 with fp32 gradient accumulation
(`data_types.grad_accum_dtype`, the ZeRO-1 path to BF16_Optimizer; plain bf16 ZeRO-1 steps with
ZeRO's own optimizer); then every shipped `ds_configs/*_bf16.json` for 2 steps, and the planted
errors of `tests/plants/bf16.py` whose launch is "bf16".

The reference (`bf16_reference`) is mixed precision as DeepSpeed does it, built here in plain
PyTorch: the model in bf16 from the same init, fp32 master weights made from those bf16 weights,
each micro-batch's bf16 gradient added into an fp32 gradient, clipping and torch's AdamW on the
masters, the masters copied back into the bf16 model after each step. Its global batches are the
oracle's (`tests/oracle/`: `dp` loaders in loader order, built apart from the ranks).

What "equal" means in bf16 (8 significant bits: a rounding moves a value by up to 2^-9 of it, and
the spacing of bf16 numbers is 2^-8 = 0.39 % of a value): the ranks and the reference compute the
same sums in another order and another split (packing, micro-batches, reductions in bf16 on
ZeRO 1-3), so every activation differs by a few roundings.
- Loss, every step: relative `LOSS_RTOL` = 2^-6 (1.6 %, 4 spacings). A step's loss is a mean
  over ~100 target tokens of values each carrying the roundings of ~10 bf16 matmuls and norms
  along its path; independent roundings of 2^-9 over that path give about sqrt(10) x 2^-9 = 0.6 %
  on one token and less on the mean, so 4 spacings leaves a margin of ~3x over what bf16 noise
  gives, while a lost sample (1 of 16, ~6 %) or a 2x scale is far outside it.
- The update of the fp32 master weights (final - initial masters, summed over the steps),
  compared as a direction: the cosine between the ranks' and the reference's update vector,
  whole-model (`UPDATE_COS` 0.99) and of each parameter tensor whose reference update is not
  noise (`TENSOR_COS` 0.9). Adam normalises each element's step to about lr x sign(g), so the
  update vector is nearly a sign vector: a cosine of 0.99 says that about 0.5 % of its mass points
  the other way (elements whose gradient is within bf16 noise of 0), and a tensor that did not
  train (its gradient dropped) has a cosine of ~0. Element-wise equality is not asked for: bf16
  noise in a near-zero gradient flips that element's full-size Adam step.
`test_plant_is_caught` shows the check fails on each planted error of this launch, both ways
BF16_Optimizer loses a gradient made outside the span it watches: it zeroes the bf16 gradients
when a backward pass starts (DeepSpeed's backward prologue, fired by a hook on the module's
output) and adds them into the fp32 ones when it ends. The encoders' gradients under "uniform"
placement come after the last backward (`ds_omni.parallelize.pipeline.late_grads_to_master` adds
them); an LM head applied in the engine's `loss_fn`, after the module's output, has its gradient
made before the prologue zeroes it (its fp32 master never moved: why the pipeline's last stage
makes the loss inside its layers, `ds_omni.parallelize.pipeline.HeadStage`).
"""

import json
from pathlib import Path

import pytest
import torch

from tests import oracle, plants
from tests.data_files import skewed_source
from tests.dist import pipeline
from tests.dist.test_parity import PP_BATCH, _config
from tests.fixtures import ADAM_EPS, ds_config, text_source
from tests.harness import run_on_ranks

STEPS = 3
BF16 = {"bf16": {"enabled": True}}
LOSS_RTOL = 2.0 ** -6  # 4 bf16 spacings (module docstring)
UPDATE_COS = 0.99  # whole-model cosine of the master-weight updates
TENSOR_COS = 0.9  # per tensor, for tensors whose reference update is above noise
REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "ds_configs").glob("*_bf16.json"))

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _shipped(path: Path) -> dict:
    """A shipped bf16 config as it is, but with torch's AdamW: on CPU DeepSpeed's fused Adam
    would compile for ~75 s (on CUDA it is the point of the file; `benchmarks/gpu_check.py` runs
    the files unchanged there)."""
    ds = json.loads(path.read_text())
    ds["optimizer"]["params"]["torch_adam"] = True
    return ds


def _cases(tmp) -> dict:
    text = text_source(tmp)
    vision = [{"name": "shapes", "path": "builtin:shapes"}, text]
    uniform = {"stage": 0, "placement": "uniform", "model": pipeline.COMPOSED, "split": "layers",
               "sources": [pipeline.SHAPES_TONES, text], "max_seq_len": 160, "train": PP_BATCH}
    stage0 = {"placement": "stage0", "sources": vision, "train": PP_BATCH}
    return {
        **{f"zero{s}": {"stage": s, "sources": vision} for s in range(4)},
        "sp2": {"stage": 2, "sp": 2},
        "pool": {"stage": 1, "pool": True, "sources": [skewed_source(tmp / "skewed")],
                 "reorder": {"mode": "loader_order"}},
        "pp_uniform": uniform,
        "pp_bubbles": {**uniform, "placement": "bubbles"},
        "pp_stage0": {**stage0, "stage": 0},
        "pp_stage0_zero1": {**stage0, "stage": 1,
                            "ds": {"data_types": {"grad_accum_dtype": "fp32"}}},
        **{f"shipped_{p.stem}": {"shipped": p.name, "steps": 2, "train": {"warmup_steps": 1}}
           for p in SHIPPED},
        **{plant: {**uniform, "plant": plant, "steps": 2} for plant in plants.for_launch("bf16")},
    }


def _case_config(case: dict, out_dir: str):
    cfg = _config(case, out_dir)
    cfg.parallel.sp = case.get("sp", 1)
    return cfg


def _ds_json(case: dict) -> dict:
    if "shipped" in case:
        return _shipped(REPO / "ds_configs" / case["shipped"])
    return ds_config(case["stage"], **BF16, **case.get("ds", {}))


def _train_ranks(rank, world, cases, out_dir):
    return {name: oracle.train_on_rank(rank, world, _case_config(case, f"{out_dir}/{name}"),
                                       _ds_json(case), case.get("steps", STEPS), case.get("plant"),
                                       read_params=master_params)
            for name, case in cases.items()}


def master_params(engine) -> dict[str, torch.Tensor]:
    """The fp32 master weight of each parameter this rank's optimizer holds, by the engine's
    names (every rank calls it: ZeRO gathers them). ZeRO 1-3 and `BF16_Optimizer` link each
    parameter to its master (`safe_get_full_fp32_param`); ZeRO-0 without the pipeline
    (`FP16_Optimizer` in bf16) keeps flat fp32 groups, unflattened here."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.utils import safe_get_full_fp32_param
    from torch._utils import _unflatten_dense_tensors
    opt, flat = engine.optimizer, {}
    if isinstance(opt, FP16_Optimizer):
        for masters, params in zip(opt.fp32_groups_flat, opt.fp16_groups):
            flat.update(zip(map(id, params), _unflatten_dense_tensors(masters, params)))
    if isinstance(opt, FP16_UnfusedOptimizer):  # torch's AdamW: one master per parameter
        for masters, params in zip(opt.fp32_groups, opt.fp16_groups):
            flat.update(zip(map(id, params), masters))
    out = {}
    for name, p in engine.module.named_parameters():
        master = flat[id(p)] if id(p) in flat else safe_get_full_fp32_param(p)
        if master is not None:  # None: a replica under "uniform", its owner stage holds it
            out[name] = master.detach().float().clone()
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return _cases(tmp_path_factory.mktemp("bf16_data"))


@pytest.fixture(scope="module")
def results(cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16")
    return run_on_ranks(_train_ranks, 2, args=(cases, str(out)), timeout=1200)


def test_bf16_matches_single_process_in_bf16(cases, results, tmp_path):
    checked = [name for name, case in cases.items()
               if not {"plant", "shipped", "placement"} & set(case)]
    for name in checked:
        _check(name, cases[name], results, tmp_path)
    assert {"zero0", "zero1", "zero2", "zero3", "sp2", "pool"} <= set(checked)


PIPELINE = ["pp_uniform", "pp_bubbles", "pp_stage0", "pp_stage0_zero1"]


@pytest.mark.parametrize("name", PIPELINE)
def test_bf16_pipeline_matches_single_process_in_bf16(name, cases, results, tmp_path):
    """PP=2 under DeepSpeed's BF16_Optimizer: "uniform" placement (ZeRO-0), "stage0" (ZeRO-0 and
    ZeRO-1 with fp32 accumulation). Every master moves as the reference's, the LM head's and
    the encoders' included (module docstring: both were lost once)."""
    assert cases[name].get("placement") and "plant" not in cases[name]
    _check(name, cases[name], results, tmp_path)


def test_bf16_bubbles_equals_uniform(cases, results):
    """"bubbles" under bf16 (encoder backwards in the cool-down slots, their gradients kept apart
    from the engine's bf16 passes, `kept_apart_under_bf16`) trains as "uniform" does, in this
    launch's terms: the same global batches, losses within LOSS_RTOL, the fp32 masters' updates
    in the same direction (UPDATE_COS whole-model, TENSOR_COS each tensor)."""
    bubbles_equal_uniform(cases, results)


def bubbles_equal_uniform(cases, results) -> tuple[float, list, list]:
    """(whole-model update cosine, losses of "bubbles", of "uniform"): `results` of the
    pp_bubbles and pp_uniform cases compared."""
    got, want = ([r[name] for r in results] for name in ("pp_bubbles", "pp_uniform"))
    assert [r["keys"] for r in got] == [r["keys"] for r in want]
    assert got[0]["losses"] == pytest.approx(want[0]["losses"], rel=LOSS_RTOL)
    masters = [{k: v for r in rs if "params" in r for k, v in r["params"].items()}
               for rs in (got, want)]
    whole, per = update_cosines(_initial_masters(cases["pp_uniform"]), masters[1], masters[0])
    low = {n: round(c, 3) for n, c in per.items() if c < TENSOR_COS}
    assert whole > UPDATE_COS and not low, (whole, low)
    assert any(n.startswith("encoders.") for n in per)  # the encoders' updates were compared
    return whole, got[0]["losses"], want[0]["losses"]


def test_shipped_bf16_configs_train_two_steps(cases, results):
    """Each shipped `*_bf16.json` starts and trains 2 steps: finite losses, every master weight
    of the model moved by the steps and still finite."""
    assert len(SHIPPED) >= 2
    for path in SHIPPED:
        got = results[0][f"shipped_{path.stem}"]
        assert len(got["losses"]) == 2 and torch.isfinite(torch.tensor(got["losses"])).all()
        init = _initial_masters(cases[f"shipped_{path.stem}"])
        assert set(got["params"]) == set(init), path.name
        assert all(torch.isfinite(p).all() for p in got["params"].values()), path.name
        moved = [n for n, p in got["params"].items() if not torch.equal(p, init[n])]
        # only layers off the model's path (vision layers after the feature layer) stay put
        assert len(moved) > 0.7 * len(init), (path.name, len(moved), len(init))


def _initial_masters(case) -> dict[str, torch.Tensor]:
    """The fp32 masters DeepSpeed starts from: the built model's weights rounded to bf16."""
    from ds_omni.model.build import build_model
    model = build_model(_case_config(case, "unused").model).model
    return {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()
            if p.requires_grad}


# where each plant's error shows: the check's message names it
CAUGHT_IN = {"bf16_encoder_grads_dropped": "differs in the encoders",
             "bf16_lm_head_in_loss_fn": "backbone.lm_head.weight"}


@pytest.mark.parametrize("plant", plants.for_launch("bf16"))
def test_plant_is_caught(plant, cases, results, tmp_path):
    with pytest.raises(AssertionError, match=CAUGHT_IN[plant]):
        _check(plant, cases[plant], results, tmp_path)


def bf16_reference(cfg, step_keys: list[list[str]], clip: float = 1.0):
    """(losses, initial masters, final masters) of mixed-precision training in one process
    (module docstring), on the global batches `step_keys`."""
    from ds_omni.data.build import build_loader
    from ds_omni.data.packing import pack
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    model = built.model.to(torch.bfloat16).train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    masters = {n: p.detach().float() for n, p in params.items()}
    init = {n: m.clone() for n, m in masters.items()}
    opt = torch.optim.AdamW(list(masters.values()), lr=cfg.train.lr, betas=(0.9, 0.95),
                            eps=ADAM_EPS, weight_decay=cfg.train.weight_decay)
    fetch = build_loader(oracle.with_loader_order(cfg), built, num_micro=1)
    losses = []
    for keys in step_keys:
        samples = fetch.load_samples(keys)
        micro_batches = [pack(samples[i:i + 3], built.item_processors)
                         for i in range(0, len(samples), 3)]
        total = sum(mb.num_targets for mb in micro_batches)
        for m in masters.values():
            m.grad = torch.zeros_like(m)
        loss_sum = 0.0
        for mb in micro_batches:
            out = model(mb)
            (out.loss_sum / total).backward()
            loss_sum += out.loss_sum.item()
            for n, p in params.items():  # accumulated in fp32, as DeepSpeed's bf16 optimizers do
                if p.grad is not None:
                    masters[n].grad += p.grad.float()
                    p.grad = None
        torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)
        opt.step()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
        losses.append(loss_sum / total)
    fetch.close()
    return losses, init, masters


def update_cosines(init, want, got) -> tuple[float, dict[str, float]]:
    """(whole-model cosine, each tensor's cosine) of the updates `got - init` against `want -
    init`; a tensor counts only if its reference update is above bf16 noise (its norm is at
    least 1 % of the largest tensor's update norm per element)."""
    dw = {n: want[n] - init[n] for n in want}
    dg = {n: got[n] - init[n] for n in want}
    cat = lambda d: torch.cat([t.reshape(-1) for t in d.values()])  # noqa: E731
    whole = float(torch.nn.functional.cosine_similarity(cat(dw), cat(dg), dim=0))
    rms = {n: float(d.pow(2).mean().sqrt()) for n, d in dw.items()}
    floor = 0.01 * max(rms.values())
    # a key bias adds one score to all keys of a query, which softmax ignores: its gradient is
    # zero in exact arithmetic and rounding noise here, which Adam turns into full-size steps
    per = {n: float(torch.nn.functional.cosine_similarity(dw[n].reshape(-1), dg[n].reshape(-1),
                                                           dim=0))
           for n in dw if rms[n] > floor and not n.endswith("k_proj.bias")}
    return whole, per


def _check(name, case, results, tmp_path) -> dict:
    """Case `name` (every rank's result) against `bf16_reference`; returns the measures."""
    from ds_omni.model.build import build_model
    steps = case.get("steps", STEPS)
    cfg = _case_config(case, str(tmp_path / f"ref_{name}"))
    dp = 1 if case.get("placement") or case.get("sp") else 2
    per_rank = [r[name] for r in results]
    got_keys = [sorted(k for r in per_rank[:dp] for k in r["keys"][s]) for s in range(steps)]
    if case.get("pool"):  # loader order: the ranks' keys are the reference's (the pool moves no sample)
        step_keys = got_keys
    else:
        step_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), dp, steps)
        assert got_keys == step_keys, f"{name}: the ranks trained another global batch"
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), name
    masters = {k: v for r in per_rank if "params" in r for k, v in r["params"].items()}
    losses, init, want = bf16_reference(cfg, step_keys, case.get("clip", 1.0))
    assert set(masters) == set(want), f"{name}: masters of {sorted(set(want) ^ set(masters))[:3]}"
    assert per_rank[0]["losses"] == pytest.approx(losses, rel=LOSS_RTOL), f"{name}: losses"
    whole, per = update_cosines(init, want, masters)
    low = {n: round(c, 3) for n, c in per.items() if c < TENSOR_COS}
    where = "encoders" if any(n.startswith("encoders.") for n in low) else "LLM"
    assert whole > UPDATE_COS and not low, \
        f"{name}: update direction of the fp32 masters differs in the {where}: whole-model " \
        f"cosine {whole:.4f}, tensors below {TENSOR_COS}: {low}"
    if case.get("pool"):  # the text-only rank really encoded rank 0's items
        assert [r["pool_items_moved"] > 0 for r in per_rank] == [False, True], name
    return {"whole": whole, "min_tensor": min(per.values()), "losses": (per_rank[0]["losses"], losses)}
