"""The oracle's one-process reference: plain PyTorch, no DeepSpeed, the same global batch.

- The global batch of each step comes from `dp` loaders in plain loader order, built here
  (`reference_step_keys`), not from what the ranks report: reordering, sequence sharding,
  resharding and packing under test cannot shape the batch they are judged against.
- The reference trains plain PyTorch on it (`run_reference`): the same init, loss = sum of token
  losses / global target tokens, torch AdamW (with the config's weight decay), the same clipping,
  and the LR schedule the test writes itself (`warmup_cosine_lr`, from DeepSpeed's documented
  formula, never by calling DeepSpeed's or ds_omni's scheduler code).
- It checks its own targets against the raw rows (`check_targets`): packing and the sample
  processor are shared with the code under test, so an error there would be on both sides.
- `reference_eval_losses`: the validation loss of the eval sources, in one process.

Callers import it through `tests/oracle/`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tests.fixtures import ADAM_EPS

END_OF_TURN = re.compile(r"<\|[^<>|\s]+\|>|</?s>")  # ChatML's <|im_end|>, Llama's </s>


def reference_step_keys(cfg, built, dp: int, steps: int) -> list[list[str]]:
    """Sorted sample keys of each step's global batch: `dp` loaders in loader order, one process."""
    from ds_omni.data.build import build_loader
    from ds_omni.parallel.groups import RankGroups
    from ds_omni.parallel.plan import ParallelPlan
    plain = with_loader_order(cfg)
    loaders = [build_loader(plain, built, ParallelPlan(world_size=dp, dp=dp), RankGroups.alone(r),
                            num_micro=1) for r in range(dp)]
    keys = [sorted(k for loader in loaders for k in loader.next_step().keys) for _ in range(steps)]
    for loader in loaders:
        loader.close()
    return keys


def with_loader_order(cfg):
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
    from ds_omni.parallel.groups import RankGroups
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    plain = with_loader_order(cfg)
    loaders = [build_loader(plain, built, ParallelPlan(world_size=dp, dp=dp), RankGroups.alone(r),
                            num_micro=1) for r in range(dp)]
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
    fetch = build_loader(with_loader_order(cfg), built, num_micro=1)
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
