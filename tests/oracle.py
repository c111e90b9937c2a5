"""The correctness oracle of every parallel plan: one process, no DeepSpeed, the same global batch.

- The global batch of each step comes from `dp` loaders in plain loader order, built here
  (`reference_step_keys`), not from what the ranks report: reordering, sequence sharding,
  resharding and packing under test cannot shape the batch they are judged against.
- The reference trains plain PyTorch on it: the same init, loss = sum of token losses / global
  target tokens, torch AdamW (with the config's weight decay), the same clipping, and the LR
  schedule the test writes itself (`warmup_cosine_lr`, from DeepSpeed's documented formula, never
  by calling DeepSpeed's or ds_omni's scheduler code).
- It checks its own targets against the raw rows (`check_targets`): packing and the sample
  processor are shared with the code under test, so an error there would be on both sides.
- It compares the losses, the full reduced gradients of every step (before clipping and Adam,
  which would hide a uniform error in gradient size: Adam's first steps are close to
  lr x sign(g)); a later step's at the parameters the ranks made it at (`Reference.grads_at`:
  float noise, which Adam amplifies in near-zero gradients, leaves the two sides' parameters
  apart by more than a gradient's rtol can absorb), the clipping coefficient where the ranks can see it (ZeRO-0), and the
  parameters after the last step, each tensor relative to the size of its own update.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests import plants
from tests.fixtures import ADAM_EPS

# Gradients agree to rtol, plus an atol of this fraction of the largest gradient of the model:
# gradients that are zero in exact arithmetic (a key bias cannot change a softmax) hold only float
# noise of reduction order, ~1e-11 here.
GRAD_RTOL, GRAD_ATOL_FRAC = 1e-4, 1e-6
# A parameter tensor agrees to this fraction of its own update (final - init, its largest
# element): Adam normalises each element's step, so reduction-order noise in a gradient moves
# the step by about the gradient's relative error (1e-4 above), not more. A tensor whose
# gradient is zero in exact arithmetic (a key bias) moves by Adam's step of noise alone (~1e-9
# here, lr x noise / eps, up to 1e-8 seen): it is held to 1e-4 of the model's largest update.
PARAM_UPDATE_FRAC, PARAM_NOISE_FRAC, PARAM_RTOL = 1e-3, 1e-4, 1e-6
END_OF_TURN = re.compile(r"<\|[^<>|\s]+\|>|</?s>")  # ChatML's <|im_end|>, Llama's </s>


def full_params(engine) -> dict[str, torch.Tensor]:
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()),
                                           enabled=engine.zero_optimization_stage() == 3):
        return _whole(engine, {n: p.detach().clone().float() for n, p in params.items()})


def _whole(engine, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Under parallel.tp: the backbone's AutoTP shards gathered whole (every rank calls it)."""
    if getattr(engine.module, "tp_counts", None) is None:
        return tensors
    from ds_omni.parallelize.tensor_parallel import gather_tp
    return gather_tp(engine.module, tensors)


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole reduced gradient (any ZeRO stage); call on all ranks."""
    from deepspeed.utils import safe_get_full_grad
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            g = safe_get_full_grad(p)
            if g is not None:
                out[name] = g.detach().clone().float()
    return _whole(engine, out)


def reference_step_keys(cfg, built, dp: int, steps: int) -> list[list[str]]:
    """Sorted sample keys of each step's global batch: `dp` loaders in loader order, one process."""
    from ds_omni.data.build import build_loader
    plain = _with_loader_order(cfg)
    loaders = [build_loader(plain, built, dp_rank=r, dp_size=dp, num_micro=1) for r in range(dp)]
    keys = [sorted(k for loader in loaders for k in loader.next_step().keys) for _ in range(steps)]
    for loader in loaders:
        loader.close()
    return keys


def _with_loader_order(cfg):
    """`cfg` for plain loaders: loader order, and no parallel plan (no long-sequence blocks)."""
    import copy
    from ds_omni.config import ParallelConfig, ReorderConfig
    plain = copy.deepcopy(cfg)
    plain.data.reorder = ReorderConfig(mode="loader_order")
    plain.parallel = ParallelConfig()
    return plain


@dataclass
class Reference:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]  # each step's, after its last backward (before clipping)
    params: dict[str, torch.Tensor]  # after the last step
    init: dict[str, torch.Tensor]
    with_grad: set[str]
    grad_norms: list[float]  # each step's gradient norm before clipping
    targets: list[int]  # each step's target tokens (the global batch's)
    clip: float  # the gradient_clipping the reference applied
    # (step, parameters) -> the gradients of that step's global batch at those parameters
    grads_at: Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]

    def clip_coefs(self) -> list[float]:
        """Each step's factor on the gradients, as torch and DeepSpeed's ZeRO-0 compute it."""
        return [min(1.0, self.clip / (n + 1e-6)) for n in self.grad_norms]


def warmup_cosine_lr(step: int, lr: float, warmup: int, total: int, warmup_min_ratio: float,
                     cos_min_ratio: float) -> float:
    """The LR of optimizer step `step` under DeepSpeed's WarmupCosineLR (linear warm-up), as its
    documentation describes it, written here so the reference does not run the code it checks:
    a linear warm-up from warmup_min_ratio x lr over `warmup` steps (DeepSpeed warms up over at
    least 2), then a cosine decay to cos_min_ratio x lr that has taken its first step at the first
    step after the warm-up and ends at `total`."""
    warmup = max(2, warmup)
    if step < warmup:
        return lr * (warmup_min_ratio + (1 - warmup_min_ratio) * step / warmup)
    progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
    return lr * (cos_min_ratio + (1 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def stream_reference(cfg, dp: int, steps: int) -> tuple[list[list[str]], list[float]]:
    """(`reference_step_keys`, the losses of `run_reference`) in one pass over the data: it trains
    on the micro-batches the `dp` loaders pack in loader order instead of fetching every sample
    again by key (the same sums: packing never mixes samples), so long runs stay cheap."""
    from ds_omni.data.build import build_loader
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    plain = _with_loader_order(cfg)
    loaders = [build_loader(plain, built, dp_rank=r, dp_size=dp, num_micro=1) for r in range(dp)]
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(0.9, 0.95), eps=ADAM_EPS,
                            weight_decay=cfg.train.weight_decay)
    keys, losses = [], []
    for _ in range(steps):
        batches = [loader.next_step() for loader in loaders]
        keys.append(sorted(k for b in batches for k in b.keys))
        micro_batches = [mb for b in batches for mb in b.micro_batches]
        total = sum(mb.num_targets for mb in micro_batches)
        opt.zero_grad()
        loss_sum = 0.0
        for mb in micro_batches:
            out = built.model(mb)
            (out.loss_sum / total).backward()
            loss_sum += out.loss_sum.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss_sum / total)
    for loader in loaders:
        loader.close()
    return keys, losses


def run_reference(cfg, step_keys: list[list[str]], clip: float = 1.0,
                  lr_at: Callable[[int], float] | None = None) -> Reference:
    """Train the global batches `step_keys` in one process (gradient norm clipped to `clip`, as
    the DeepSpeed config's `gradient_clipping`; step k at LR `lr_at(k)`, default the config's
    constant `train.lr`)."""
    from ds_omni.data.build import build_loader
    from ds_omni.data.packing import pack
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    model = built.model
    model.train()  # as the trainer does
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    fetch = build_loader(_with_loader_order(cfg), built, dp_rank=0, dp_size=1, num_micro=1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(0.9, 0.95), eps=ADAM_EPS,
                            weight_decay=cfg.train.weight_decay)
    losses, grads, with_grad, norms, targets, step_samples = [], [], set(), [], [], []
    for step, keys in enumerate(step_keys):
        samples = fetch.load_samples(keys)
        step_samples.append(samples)
        check_targets(fetch, built, keys, samples)
        micro_batches = [pack(samples[i:i + 3], built.item_processors)  # any split: same sums
                         for i in range(0, len(samples), 3)]
        total = sum(mb.num_targets for mb in micro_batches)
        targets.append(total)
        opt.zero_grad()
        loss_sum = 0.0
        for mb in micro_batches:
            out = model(mb)
            (out.loss_sum / total).backward()
            loss_sum += out.loss_sum.item()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        with_grad |= {n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
        for p in params:  # DeepSpeed steps every trainable parameter: off the path, weight decay
            if p.grad is None:  # alone moves it (torch's AdamW would skip it)
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        for group in opt.param_groups:
            group["lr"] = cfg.train.lr if lr_at is None else lr_at(step)
        opt.step()
        losses.append(loss_sum / total)
    fetch.close()
    return Reference(losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()},
                     init, with_grad, norms, targets, clip,
                     _gradients_at(cfg, step_samples, targets))


def _gradients_at(cfg, step_samples: list[list], targets: list[int]):
    """(step, parameters) -> the gradients of step's samples at `parameters` (OmniModel names),
    on a model of its own (the reference's training is left alone)."""
    from ds_omni.data.packing import pack
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    model = built.model
    model.train()

    def grads_at(step: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing, unexpected = model.load_state_dict(params, strict=False)
        assert not unexpected and not set(missing) & set(params), (missing, unexpected)
        model.zero_grad(set_to_none=True)
        samples = step_samples[step]
        for i in range(0, len(samples), 3):  # as `run_reference` packs them
            (model(pack(samples[i:i + 3], built.item_processors)).loss_sum /
             targets[step]).backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()
                if p.grad is not None}
    return grads_at


def check_targets(fetch, built, keys: list[str], samples: list) -> None:
    """Each sample's targets are exactly its raw row's trained text, found here from the row
    (the assistant turns of a conversation, a plain text whole) and not by the sample processor
    or `sample_targets`, which the code under test shares: decoded without special tokens and
    `END_OF_TURN`s (end-of-turn tokens are trained, and dropped here), spaces aside, they are that
    text; and no target is an encoder's placeholder token (special, so decoding would hide it)."""
    from ds_omni.data.sample_reader import key_locator
    from ds_omni.data.packing import sample_targets
    from ds_omni.batch import IGNORE_INDEX
    placeholders = {int(t) for enc in built.model.encoders.values() for t in enc.placeholder_ids}
    for key, sample in zip(keys, samples):
        loc = key_locator(key)
        source = fetch.sources[loc.source]
        text, _, _ = source.parts(source.fetch(loc), loc)
        targets = sample_targets(sample)
        trained = targets[targets != IGNORE_INDEX]
        bad = sorted(placeholders & set(trained.tolist()))
        assert not bad, f"{key}: placeholder tokens {bad} are targets"
        want = text if isinstance(text, str) else "".join(
            turn["value"] for turn in text if turn.get("from", turn.get("role")) in
            ("gpt", "assistant"))
        got = built.tokenizer.decode(trained, skip_special_tokens=True)
        got = END_OF_TURN.sub("", got)  # some tokenizers do not mark theirs special
        assert "".join(got.split()) == "".join(want.split()), \
            f"{key}: the targets are {got!r}, the row trains {want!r}"


def assert_matches(ref: Reference, got: dict, where: str) -> None:
    """`got` (one rank's losses, every step's gradients and final parameters, or every stage's
    together: `merge_stages`) equals the reference."""
    assert got["losses"] == pytest.approx(ref.losses, rel=1e-6, abs=1e-7), (
        f"{where}: losses {got['losses']}, the reference's {ref.losses}")
    assert len(got["grads"]) == len(ref.grads) == len(got["step_params"]) + 1, where
    for step, have in enumerate(got["grads"]):
        # step 0 at the shared init; later steps at the parameters the ranks trained them at:
        # the two sides' parameters differ by float noise (which Adam amplifies in near-zero
        # gradients) and a gradient made at other parameters can differ by far more than its rtol
        want = ref.grads[0] if step == 0 else ref.grads_at(step, got["step_params"][step - 1])
        assert_grads_match(want, have, f"{where} step {step}")
    for coefs in got.get("stage_clip_coefs") or [got.get("clip_coefs") or []]:
        for step, (want, have) in enumerate(zip(ref.clip_coefs(), coefs or [])):
            assert have == pytest.approx(want, rel=1e-5), \
                f"{where} step {step}: the gradients were clipped by {have}, the reference " \
                f"by {want}"
    assert_params_match(ref, got["params"], where)


def assert_params_match(ref: Reference, got: dict, where: str) -> None:
    """Every parameter tensor equals the reference's to PARAM_UPDATE_FRAC of its own update (or
    PARAM_NOISE_FRAC of the model's largest, if more)."""
    assert got.keys() == ref.params.keys(), where
    updates = {k: float((want - ref.init[k]).abs().max()) for k, want in ref.params.items()}
    noise = PARAM_NOISE_FRAC * max(updates.values())
    for key, want in ref.params.items():
        update = updates[key]
        torch.testing.assert_close(got[key], want, rtol=PARAM_RTOL,
                                   atol=max(PARAM_UPDATE_FRAC * update, noise),
                                   msg=lambda m: f"{where} param {key} (update {update:.2e}): {m}")


def merge_stages(stages: list[dict]) -> dict:
    """One result of pipeline stages' results (data-parallel rank 0 of each, in stage order):
    the last stage's losses, each step's gradients and the parameters it was made at, the final
    parameters of all stages (an encoder replica's, under "uniform", the last stage's copy), and
    each stage's clip coefficients (each stage clips its own gradients by the pipeline's one
    norm)."""
    steps = len(stages[0]["grads"])
    return {"losses": stages[-1]["losses"],
            "grads": [{k: g for r in stages for k, g in r["grads"][s].items()}
                      for s in range(steps)],
            "step_params": [{k: p for r in stages for k, p in r["step_params"][s].items()}
                            for s in range(steps - 1)],
            "params": {k: p for r in stages for k, p in r["params"].items()},
            "stage_clip_coefs": [r.get("clip_coefs") for r in stages]}


def assert_grads_match(want: dict, got: dict, where: str) -> None:
    nonzero = {k for k, g in want.items() if g.any()}
    assert nonzero, where
    missing = sorted(nonzero - set(got))
    assert not missing, f"{where}: no gradient for {missing[:5]}"
    atol = GRAD_ATOL_FRAC * max(float(want[k].abs().max()) for k in nonzero)
    for key in nonzero:
        torch.testing.assert_close(got[key], want[key], rtol=GRAD_RTOL, atol=atol,
                                   msg=lambda m: f"{where} grad of {key}: {m}")


def assert_moved(ref: Reference, where: str, with_grad: float = 0.7) -> None:
    """The comparison is not between two untouched inits: more than `with_grad` of the parameter
    tensors got a gradient (only layers off the model's path, e.g. vision layers after the
    feature layer, get none), and each of those moved."""
    assert len(ref.with_grad) > with_grad * len(ref.params), where
    assert not [k for k in ref.with_grad if torch.equal(ref.params[k], ref.init[k])], where


# ----------------------------------------------------------------------------- the ranks' side
def train_on_rank(rank: int, world: int, cfg, ds_json: dict, steps: int,
                  plant: str | None = None, resume_at: int | None = None,
                  read_params=full_params) -> dict:
    """Train `steps` steps of `cfg` on this rank through the real DeepSpeed engine.

    Returns the losses, every step's sample keys, counts of micro-batches with nothing to encode
    Returns the losses, every step's sample keys and target counts, counts of micro-batches with
    nothing to encode here, the encoder pool's moved items and "uniform"'s owner broadcasts, the
    SP work (`sp_metrics`, the token shards), the clipping coefficients under ZeRO-0
    (`_ClipWatch`), the eval result after the last step when the config has eval sources, and (on
    rank 0, or data-parallel rank 0 of each pipeline stage, to keep results small) every step's
    reduced gradients and the final parameters. `plant` puts in a known error
    (`tests/plants.py`), from before the engine is built: the oracle must see it. `resume_at`:
    save a checkpoint before that step, and after the last step resume from it and train the rest
    again (`_resume_and_rerun`); the final parameters are then the rerun's. `read_params(engine)`
    reads the final parameters (by the engine's names; every rank calls it).
    """
    with plants.applied(plant, rank):  # from the start: some plants change the setup
        return _train(rank, world, cfg, ds_json, steps, resume_at, read_params)


def _train(rank: int, world: int, cfg, ds_json: dict, steps: int, resume_at: int | None,
           read_params) -> dict:
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.parallelize import router_of
    from ds_omni.train.loop import pool_metrics, sp_metrics
    from ds_omni.train.setup import setup_training
    from ds_omni.train.step import train_step
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    built, loader, engine = setup_training(cfg, derive_ds_config(cfg, ds_json, plan), rank, plan)
    # HF's from_pretrained (the model_dir families) hands models over in eval mode
    assert engine.module.training and all(m.training for m in engine.module.modules()), \
        "the trainer must run the model in train mode (dropout on)"
    out = {"losses": [], "keys": [], "nothing_to_encode": 0, "row_without_items": 0,
           "block_rows": 0, "block_rows_with_items": 0, "long_items": 0,
           "optimizer_encoders": _optimizer_encoders(engine, built), "targets": [],
           "shards": [], "sp_rows": 0, "rows_with_items": 0}
    grads, step_params, clip = [], [], _ClipWatch(engine)
    for step in range(steps):
        if step == resume_at:
            _save(cfg, built, engine, loader, step, rank)
        batch = loader.next_step()
        _count_encoder_work(batch, out)
        _record_shards(batch, plan, rank, out)
        out["keys"].append(batch.keys)
        out["targets"].append(sum(mb.num_targets for mb in batch.micro_batches))
        if step > 0:  # the parameters this step's gradients are made at (every rank gathers)
            step_params.append(full_params(engine))
        out["losses"].append(train_step(engine, batch, loader.comm,
                                              lambda e: grads.append(clip.grab(e))).loss)
        out.setdefault("pool_moved", []).append(  # the metric data_pool_moved
            pool_metrics(engine.module).get("data_pool_moved"))
    counts = getattr(loader, "loader", loader).counts  # what this rank read and decoded
    out["read_counts"] = (counts.rows, counts.bytes, counts.items)
    out["clip_coefs"] = list(clip.coefs)  # a resumed rerun steps on: not its steps
    tp_counts = getattr(engine.module, "tp_counts", None)  # parallel.tp: AutoTP's layers
    if tp_counts is not None:
        import dataclasses
        out["tp_counts"] = dataclasses.asdict(tp_counts)
        out["local_shapes"] = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    router = router_of(engine.module)
    if router is not None and router.tp_encoders is not None:  # the encoders' split over TP
        import dataclasses
        out["tp_encode"] = dataclasses.asdict(router.tp_encoders.counts)
    # the SP work of training (the metrics sp_*), before evaluation runs forwards of its own
    out["sp"] = sp_metrics(engine.module)
    if out["sp"]:  # Ulysses calls one SP row makes: every decoder layer, again when recomputed
        backbone = built.model.backbone
        out["ulysses_per_row"] = len(backbone.layers) * (2 if backbone.checkpoint_layers else 1)
    if plan.pp_enabled:  # the stage boundaries the engine was built with
        out["parts"] = list(engine.module.parts)
    joint = getattr(engine.module, "joint", None)  # "uniform": the owners' broadcasts issued
    out["encoder_broadcasts"] = joint.shards.broadcasts if joint is not None else 0
    router = router_of(engine.module)
    pool = router.encoder_pool if router is not None else None  # items encoded for another rank
    out["pool_items_moved"] = pool.items_moved if pool is not None else 0
    if pool is not None:  # the per-step metric adds up to the items this rank encoded for others
        assert sum(out["pool_moved"]) == pool.items_moved, (out["pool_moved"], pool.items_moved)
    if cfg.data.eval_sources:  # validation after the last step, on every rank
        from ds_omni.train.evaluate import Evaluator
        out["eval"] = Evaluator(cfg, built, loader).run(engine)
    params = read_params(engine)
    if resume_at is not None:
        out["resumed"] = _resume_and_rerun(cfg, built, engine, loader, resume_at, steps, rank)
        first, params = params, full_params(engine)
        out["resumed"]["params_differ"] = [n for n, p in params.items()
                                           if not torch.equal(p, first[n])]
    loader.close()
    if rank == 0 or (plan.pp_enabled and plan.coords(rank).dp_rank == 0):  # every stage's own
        names = omni_names(engine, built)
        out.update(grads=[{names[k]: g for k, g in step.items()} for step in grads],
                   step_params=[{names[k]: p for k, p in at.items()} for at in step_params],
                   params={names[k]: p for k, p in params.items()})
    return out


class _ClipWatch:
    """Each step's clipping coefficient, seen where it can be: under ZeRO-0 the engine clips
    (DeepSpeed's `clip_grad_norm_`) and then calls the torch optimizer, so the norm of the
    optimizer's gradients before the step's clipping (`grab`) and when the optimizer starts gives
    it. ZeRO-1/2/3 clip inside their optimizer step: no coefficient (`coefs` stays empty)."""

    def __init__(self, engine):
        self.engine, self.coefs, self._before = engine, [], None
        optimizer = engine.optimizer
        if engine.zero_optimization_stage() == 0 and isinstance(optimizer, torch.optim.Optimizer):
            step = optimizer.step
            self.params = [p for g in optimizer.param_groups for p in g["params"]]

            def watched(*args, **kwargs):
                if self._before:
                    self.coefs.append(self._norm() / self._before)
                return step(*args, **kwargs)
            optimizer.step = watched

    def grab(self, engine) -> dict[str, torch.Tensor]:
        """The reduced gradients (`full_grads`), and the norm before clipping."""
        if hasattr(self, "params"):
            self._before = self._norm()
        return full_grads(engine)

    def _norm(self) -> float:
        grads = [p.grad.detach().double() for p in self.params if p.grad is not None]
        return float(torch.sqrt(sum((g * g).sum() for g in grads))) if grads else 0.0


def _save(cfg, built, engine, loader, step: int, rank: int) -> None:
    """A checkpoint as training writes it (with the model/ directory an export needs)."""
    from ds_omni.train import checkpoint
    if rank == 0:
        checkpoint.save_model_meta(checkpoint.checkpoint_root(cfg.train.output_dir), built)
    checkpoint.save(engine, cfg.train.output_dir, step, loader.state_dict(), rank)


def _resume_and_rerun(cfg, built, engine, loader, at: int, steps: int, rank: int) -> dict:
    """Resume from the checkpoint saved before step `at` as `--resume` does (weights, optimizer,
    LR, RNG, data position), train steps `at`.. again and save the final checkpoint; returns the
    rerun's losses and sample keys."""
    from ds_omni.train.loop import resume_from
    from ds_omni.train.step import train_step
    got = {"start": resume_from(engine, loader, cfg.train.output_dir, rank), "losses": [],
           "keys": [], "output_dir": cfg.train.output_dir}
    for _ in range(at, steps):
        batch = loader.next_step()
        got["keys"].append(batch.keys)
        got["losses"].append(train_step(engine, batch, loader.comm).loss)
    _save(cfg, built, engine, loader, steps, rank)
    return got


def _optimizer_encoders(engine, built) -> list[str]:
    """The encoder parameters (OmniModel names) this rank's optimizer holds, read from the
    optimizer itself where its groups hold the parameters (ZeRO-0 fp32: torch's AdamW; ZeRO-1
    holds flat partitions instead, and this is empty)."""
    ours = {id(p): n for n, p in built.model.named_parameters()}
    groups = getattr(engine.optimizer, "param_groups", None) or []
    return sorted(ours[id(p)] for g in groups for p in g["params"]
                  if ours.get(id(p), "").startswith("encoders."))


def omni_names(engine, built) -> dict[str, str]:
    """The engine module's parameter names -> the OmniModel's (a pipeline stage names them by
    layer index), found by tensor identity."""
    ours = {id(p): n for n, p in built.model.named_parameters()}
    return {n: ours[id(p)] for n, p in engine.module.named_parameters()}


def _record_shards(batch, plan, rank: int, out: dict) -> None:
    """Each micro-batch's tokens on this rank, with the SP group the plan splits its row over
    ((first rank, size); static SP: every row over the rank's group, per-sequence SP: a long
    sequence's row over its block) and the whole padded row's length; no group: a row run
    whole. Taken from the plan and the loader, not from the model, so a row the model runs
    whole under SP still counts as split."""
    # the group's first rank (its SP ranks are tp apart: consecutive without tp)
    static = (rank - plan.coords(rank).sp_rank * plan.tp, plan.sp) if plan.sp > 1 else None
    for i, mb in enumerate(batch.micro_batches):
        group = mb.route.sp_block or static
        out["shards"].append((len(out["keys"]), i, group, mb.input_ids[0].tolist(),
                              int(mb.cu_seqlens[-1])))
        out["sp_rows"] += group is not None
        out["rows_with_items"] += bool(mb.route.reshard is not None and mb.route.reshard.group_rows)


def assert_split_work(ref: Reference, per_rank: list[dict], where: str, *,
                      pooled: bool = False) -> None:
    """Sequence parallelism really split the work, which the loss and gradients cannot show:
    ZeRO sums the gradients of an SP group's ranks, so ranks that each computed the whole row
    would double the targets and the loss alike and still match the oracle.

    - each target token of a step was trained on exactly one rank (the ranks' targets add up to
      the reference's);
    - the ranks of a split row held different shards of it, each 1 / size of the padded row;
    - each rank's counts (`ds_omni.parallel.evidence`): Ulysses attention in every decoder layer
      of every split row, one resharding all-to-all per split row with items (at least that
      under the encoder pool, which exchanges over the whole pool), its piece of each long item;
      and the embedding rows sent between ranks are the rows received.
    """
    for step, want in enumerate(ref.targets):
        got = [r["targets"][step] for r in per_rank]
        assert sum(got) == want, (f"{where} step {step}: the ranks trained {sum(got)} target "
                                  f"tokens ({got}), the global batch has {want}: some were "
                                  "trained on more than one rank (or on none)")
    _assert_shards_differ(per_rank, where)
    for rank, r in enumerate(per_rank):
        counts = r["sp"]
        assert counts, f"{where} rank {rank}: the model reports no SP counts (sp_metrics)"
        assert counts["sp_ulysses_calls"] == r["ulysses_per_row"] * r["sp_rows"], (
            f"{where} rank {rank}: {counts['sp_ulysses_calls']} Ulysses attention calls for "
            f"{r['sp_rows']} split rows x {r['ulysses_per_row']}: a row ran without its group")
        exchanges, rows = counts["sp_reshard_exchanges"], r["rows_with_items"]
        assert exchanges >= rows if pooled else exchanges == rows, (
            f"{where} rank {rank}: {exchanges} resharding all-to-alls for {rows} split rows "
            "with encoder items")
        assert counts["sp_encoder_pieces"] == r["long_items"], (where, rank, counts)
    sent = sum(r["sp"]["sp_rows_sent"] for r in per_rank)
    assert sent == sum(r["sp"]["sp_rows_received"] for r in per_rank), (where, sent)


def _assert_shards_differ(per_rank: list[dict], where: str) -> None:
    """Every split row (`_record_shards`) is on each rank of its group, as a shard of its own."""
    rows: dict[tuple, dict[int, tuple[list[int], int]]] = {}
    for rank, r in enumerate(per_rank):
        for step, i, group, ids, row_len in r["shards"]:
            if group is not None:
                rows.setdefault((step, i, group), {})[rank] = (ids, row_len)
    assert rows, f"{where}: no row was split over an SP group"
    for (step, i, (first, size)), shards in rows.items():
        at = f"{where} step {step} micro-batch {i}, ranks {first}..{first + size - 1}"
        assert sorted(shards) == list(range(first, first + size)), f"{at}: {sorted(shards)} hold it"
        (row_len,) = {n for _, n in shards.values()}
        assert all(len(ids) * size == row_len for ids, _ in shards.values()), (
            f"{at}: shards of {[len(ids) for ids, _ in shards.values()]} tokens, not 1/{size} of "
            f"the {row_len}-token row each")
        tokens = [tuple(ids) for ids, _ in shards.values()]
        assert len(set(tokens)) == size, f"{at}: two ranks hold the same shard"


def _count_encoder_work(batch, out: dict) -> None:
    for mb in batch.micro_batches:
        out["nothing_to_encode"] += not mb.encoder_inputs
        route = mb.route
        out["row_without_items"] += bool(route.reshard is not None and not route.reshard.group_rows)
        out["block_rows"] += route.sp_block is not None
        out["block_rows_with_items"] += bool(route.sp_block is not None and route.reshard.group_rows)
        # items the whole SP group encoded, each rank its piece (long-short SP)
        out["long_items"] += sum(map(len, route.reshard.split.values())) if route.reshard else 0


# ------------------------------------------------------------------------------- validation
def reference_eval_losses(cfg, params_sets: list[dict[str, torch.Tensor]]) -> list[float]:
    """The eval loss of `cfg.data.eval_sources` in one process, under each of `params_sets`
    (OmniModel names): every row, read by streaming each source's chunks in order (not by the
    evaluator's locators), packed into one micro-batch, the model in eval mode; sum of token
    losses / targets."""
    from ds_omni.data.build import sample_processors
    from ds_omni.data.packing import pack
    from ds_omni.data.sources import Source
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    built.model.eval()
    processors = sample_processors(cfg, built, cfg.data.eval_sources)
    samples = []
    for scfg in cfg.data.eval_sources:
        source = Source(scfg)
        for chunk in source.chunks:
            for loc, row in source.stream(chunk, chunk.start):
                text, media, sid = source.parts(row, loc)
                samples.append(processors[scfg.name](text=text, media=media, sample_id=sid,
                                                     source=scfg.name))
    mb = pack(samples, built.item_processors)
    losses = []
    for params in params_sets:
        missing, unexpected = built.model.load_state_dict(params, strict=False)
        assert not unexpected and not set(missing) & set(params), (missing, unexpected)
        with torch.no_grad():
            out = built.model(mb)
        losses.append(out.loss_sum.item() / out.num_targets)
    return losses
