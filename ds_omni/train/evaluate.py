"""Validation: the loss over a fixed eval set (`data.eval_sources`), split over every rank.

The eval set is every row of every eval source, in file order, the same rows each time.
Data-parallel rank r evaluates rows r, r + dp, r + 2 dp, ... (the ranks of one SP group the same
rows, each its sequence shard), `train.micro_batch_size` rows per packed micro-batch. Every rank
runs the same number of forwards, one with an empty micro-batch where it has run out of rows:
under ZeRO-3 each forward gathers parameters on all ranks, under SP the ranks of a group exchange
activations, so a rank that sat one out would leave the others waiting.

The loss is the sum of token losses over the whole set / its target tokens (token-weighted), the
number one process evaluating the whole set gets, up to the order of the summation. No gradient
is kept; the model runs in eval mode (no dropout) and goes back to its mode afterwards. Under
parallel.pp > 1 the pipeline engine's `eval_batch` runs the forwards (`PipelineForwards`).
"""

from __future__ import annotations

import math

import torch

from ds_omni.data.packing import empty_micro_batch, pack
from ds_omni.data.sources import Locator, Source
from ds_omni.errors import DataError
from ds_omni.parallel import dist
from ds_omni.parallelize.pipeline import engine_inputs, is_pipeline


def eval_plan(num_rows: int, dp_rank: int, dp_size: int, per_micro: int) -> list[list[int]]:
    """Row indices of each of this rank's eval micro-batches; every rank gets as many
    micro-batches as the rank with the most rows (empty ones where it has run out)."""
    mine = list(range(dp_rank, num_rows, dp_size))
    most = math.ceil(num_rows / dp_size)  # rank 0's rows
    rounds = math.ceil(most / per_micro)
    return [mine[i * per_micro:(i + 1) * per_micro] for i in range(rounds)]


def eval_due(step_done: int, every: int, last: int) -> bool:
    """Whether to evaluate after `step_done` optimizer steps: every `every` and after the last."""
    return step_done == last or bool(every) and step_done % every == 0


class Evaluator:
    """This rank's part of the eval set and the loop that evaluates it (call `run` on all ranks)."""

    def __init__(self, cfg, built, loader, groups=None):
        from ds_omni.data.build import sample_processors
        self.sources = {s.name: Source(s, chunk_rows=cfg.data.chunk_rows)
                        for s in cfg.data.eval_sources}
        self.processors = sample_processors(cfg, built, cfg.data.eval_sources)
        self.item_processors, self.family = loader.item_processors, loader.family
        self.shard = loader.shard
        # the ranks whose micro-batches hold the eval set once (`RankGroups`; None: one process)
        self.comm = groups.comm if groups is not None else None
        self.every, self.last = cfg.train.eval_every, cfg.train.steps
        rows = [Locator(s.name, f, r) for s in self.sources.values()
                for f, n in enumerate(s.file_rows) for r in range(n)]
        self.num_rows = len(rows)
        self.plan = [[rows[i] for i in idx] for idx in eval_plan(
            len(rows), loader.dp_rank, loader.dp_size, cfg.train.micro_batch_size)]

    def due(self, step_done: int) -> bool:
        return eval_due(step_done, self.every, self.last)

    def run(self, engine) -> dict:
        """{"eval_loss", "eval_targets", "eval_samples"[, "eval_skipped"]}, the same on every rank."""
        module = engine.module
        was_training = module.training
        module.eval()
        pipe = PipelineForwards(engine) if is_pipeline(engine) else None
        loss_sum, targets, skipped = 0.0, 0, 0
        try:
            with torch.no_grad():
                for locators in self.plan:
                    samples, error, bad = self._load(locators)
                    skipped += bad
                    (failed,) = dist.all_reduce_sum([float(error is not None)])
                    if failed:  # every rank stops here, before a forward could hang
                        raise DataError(error or "a bad sample in data.eval_sources on another rank")
                    mb = pack(samples, self.item_processors, self.shard) if samples else \
                        empty_micro_batch(self.family, self.item_processors, self.shard)
                    if pipe is None:
                        loss_sum += float(engine(mb.to(engine.device)).loss_sum)
                    else:
                        pipe.add(mb)
                    targets += mb.num_targets
                if pipe is not None:
                    loss_sum = pipe.finish()
        finally:
            module.train(was_training)
        sp = getattr(self.comm, "sp_size", 1)  # the ranks of an SP group skip the same samples
        group = getattr(self.comm, "token_group", None)
        if pipe is not None:  # the last stage's ranks hold the loss: they count, over the world
            group, last = None, engine.is_last_stage()
            targets, skipped = (targets, skipped) if last else (0, 0)
        total, count, skipped = dist.all_reduce_sum([loss_sum, targets, skipped], group)
        if not count:
            raise DataError("data.eval_sources hold no target tokens: nothing to evaluate")
        skipped = int(skipped) // sp
        return {"eval_loss": total / count, "eval_targets": int(count),
                "eval_samples": self.num_rows - skipped, **({"eval_skipped": skipped} if skipped else {})}

    def _load(self, locators: list[Locator]) -> tuple[list, str | None, int]:
        """(processed samples, this rank's first error, bad samples skipped); nothing raises
        here, so that a problem on one rank stops every rank at the same point."""
        samples, error, bad = [], None, 0
        for loc in locators:
            source = self.sources[loc.source]
            try:
                row = source.fetch(loc)
                text, media, sid = source.parts(row, loc)
                samples.append(self.processors[loc.source](text=text, media=media, sample_id=sid,
                                                           source=loc.source))
            except DataError as e:
                if source.cfg.on_bad_sample == "skip":
                    bad += 1
                    continue
                error = error or (f"data.eval_sources: {e}. To leave such samples out of the "
                                  f"eval set, set data.eval_sources[{loc.source}].on_bad_sample "
                                  "to \"skip\"")
            except Exception as e:  # a bug or a failing library: not a bad sample
                error = error or f"evaluating {loc}: {type(e).__name__}: {e}"
        return samples, error, bad


class PipelineForwards:
    """Eval forwards through DeepSpeed's pipeline engine (`eval_batch`: its inference schedule,
    up to its gradient-accumulation count of micro-batches a call). Every stage's ranks hold the
    same micro-batches; the last stage's layers sum each one's token loss (`HeadStage`), read
    back here. Under "uniform" placement stage 0 encodes every item (its encoders are current:
    each owner broadcasts its parameters after every step)."""

    def __init__(self, engine):
        self.engine, self.pending, self.loss_sum = engine, [], 0.0

    def add(self, mb) -> None:
        self.pending.append(mb.to(self.engine.device))
        if len(self.pending) == self.engine.gradient_accumulation_steps():
            self._run()

    def finish(self) -> float:
        """This rank's summed token loss (0 off the last stage)."""
        self._run()
        return self.loss_sum

    def _run(self) -> None:
        if not self.pending:  # every rank has as many micro-batches (`eval_plan`): all skip
            return
        inputs = self.engine.module.step_inputs
        inputs.batches, inputs.scale = self.pending, 1.0
        try:
            self.engine.eval_batch(iter(engine_inputs(self.pending)), reduce_output=None,
                                   bcast_loss=False, num_micro_batches=len(self.pending))
            self.loss_sum += float(torch.stack(inputs.sums).double().sum()) if inputs.sums else 0.0
        finally:
            inputs.sums, inputs.batches, self.pending = [], [], []


def build_evaluator(cfg, built, loader, groups=None) -> Evaluator | None:
    """The evaluator of this rank (its sums over `groups`, this rank's `RankGroups`), or None
    when the config has no eval sources."""
    return Evaluator(cfg, built, loader, groups) if cfg.data.eval_sources else None
