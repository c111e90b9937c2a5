"""The loader of one data-parallel rank: streams, mixing, grouped reordering, packing, state.

One global step, on every data-parallel rank, in three phases:
  1. read (`sample_reader.py`): the mixer picks a source for each of this rank's slots; each
     source's cursor streams this rank's chunks; each row is *measured* (tokens, encoder
     sequence lengths, modelled cost) without decoding its media;
  2. plan (`step_plan.py`): the G ranks of the group all-gather only these measurements and each
     computes the same assignment of the group's samples to ranks and micro-batches
     (`reorder.py`), in "fixed" or "budget" mode;
  3. load (`step_load.py`): each rank reads and preprocesses only the samples assigned to it
     (no payload crosses ranks) and packs each micro-batch into one row.

The state (`loader_state.py`) is JSON: every rank's cursors and mixer, and each group's buffer,
gathered to a single file that resumes under another data-parallel size. `OmniLoader` composes
the phases and keeps the step count; what it is told about its ranks, its collectives and the
splitting of long work comes in the values of `rank_place.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds_omni.batch import MicroBatch
from ds_omni.config import DataConfig
from ds_omni.data.cost import CostModel
from ds_omni.data.loader_state import LoaderState
from ds_omni.data.mixer import Mixer, MixSchedule
from ds_omni.batch import MicroBatch
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.rank_place import LoaderComms, LongSplits, RankPlace
from ds_omni.data.sample_reader import SampleReader, key_locator
from ds_omni.data.sources import Source
from ds_omni.data.step_load import MicroBatchLoader
from ds_omni.data.step_plan import StepPlanner
from ds_omni.data.workers import resolve_workers
from ds_omni.errors import DataError
from ds_omni.parallel.plan import check_per_sequence


@dataclass
class StepBatch:
    """What one rank trains on in one optimizer step."""

    step: int
    micro_batches: list[MicroBatch]
    keys: list[str] = field(default_factory=list)  # this rank's samples, in micro-batch order
    modelled_cost: float = 0.0  # this rank's summed modelled cost
    stats: dict = field(default_factory=dict)  # skipped, outliers, delays, ...
    error: str | None = None  # a data error on this rank: the trainer stops all ranks with it
    stop: str | None = None  # a source ran out under on_exhausted="stop"
    filler: MicroBatch | None = None
    """Per-sequence SP: a zero-weight micro-batch the trainer appends until every rank runs as
    many micro-batches as the busiest (their number varies with the step's long sequences)."""


class OmniLoader:
    """This rank's loader. Call `next_step()` on every rank in lockstep (it communicates).

    `place`: its ranks and micro-batches per step; `comms`: its collectives (alone by default);
    `splits`: per-sequence and long-short SP (none by default)."""

    def __init__(self, sources: list[Source], processors: dict[str, SampleProcessor],
                 cost_model: CostModel, cfg: DataConfig, *, global_batch_size: int,
                 place: RankPlace, comms: LoaderComms | None = None,
                 splits: LongSplits | None = None):
        comms, splits = comms or LoaderComms(), splits or LongSplits()
        self.sources = {s.name: s for s in sources}
        self.processors, self.cost_model, self.cfg = processors, cost_model, cfg
        self.global_batch_size = global_batch_size
        self.num_micro, self.dp_rank, self.dp_size = place.num_micro, place.dp_rank, place.dp_size
        self.comm = comms.data
        # the all-gathers of `next_step`: groups of their own when steps run on a prefetch thread
        self.step_comm = comms.step
        self.mode = cfg.reorder.mode
        self.group_size = place.reorder_group
        if global_batch_size % self.dp_size:
            raise DataError(f"the global batch of {global_batch_size} samples does not split over "
                            f"{self.dp_size} data-parallel ranks")
        self.max_degree = splits.max_sequence_sp  # per-sequence SP: blocks of up to this many ranks
        if self.max_degree > 1:
            check_per_sequence(self.mode, self.group_size, self.max_degree)
        self.pack_tokens = cfg.pack_tokens or cfg.max_seq_len * max(1, global_batch_size // (
            self.dp_size * self.num_micro))
        self.schedule = MixSchedule({s.name: s.cfg.weight for s in sources}, cfg.schedule)
        for s in sources:
            s.fit_chunks(self.dp_size)
        self.reader = SampleReader(self.sources, processors, cost_model, Mixer(self.schedule), cfg,
                                   place)
        self.planner = StepPlanner(self.reader, self.step_comm, cfg.reorder, place,
                                   group_size=self.group_size,
                                   samples_per_rank=global_batch_size // self.dp_size,
                                   pack_tokens=self.pack_tokens, max_degree=self.max_degree)
        self.batches = MicroBatchLoader(self.reader, processors, cost_model, place, splits,
                                        resolve_workers(cfg.workers))
        self.state = LoaderState(self.reader, self.planner, self.schedule, cfg, place, self.comm)
        self.step = 0

    # ------------------------------------------------------------- what the phases hold
    @property
    def skipped(self) -> dict[str, int]:
        return self.reader.skipped

    @property
    def item_processors(self) -> dict:
        return self.batches.item_processors

    @property
    def family(self):
        return self.batches.family

    @property
    def shard(self):
        """This rank's place in its Ulysses group (None without SP)."""
        return self.batches.shard

    @property
    def pool(self):
        """The data worker processes (None: the loader packs itself)."""
        return self.batches.pool

    # --------------------------------------------------------------------------- public API
    def set_weights(self, weights: dict[str, float]) -> None:
        """Change mixing weights from the next global batch on (call on every rank)."""
        self.schedule.set_weights(weights, from_step=self.step)

    def next_step(self) -> StepBatch:
        """This rank's micro-batches. A data problem does not raise here (the other ranks would
        wait in a collective): it is reported in `error` / `stop`, for the trainer to act on
        after its all-reduce, on every rank at once. Nor does any other exception of the data
        path (a bug, a failing HF processor): it becomes `error` the same way."""
        problem = self.reader.problem = {}
        self._step_start = self._position()
        try:
            mine, stats = self.planner.plan(self.step)
        except Exception as e:  # DataError: the plan is the same on every rank of the group
            if isinstance(e, torch.distributed.DistError):  # a collective failed: nothing to tell
                raise
            mine, stats = [[] for _ in range(self.num_micro)], {}
            problem.setdefault("error", self.reader.failure(e, "planning the step"))
        micro, keys, problems, cost = self.batches.load(mine, stats, self.step)
        batch = StepBatch(step=self.step, micro_batches=micro, keys=keys, stats=stats,
                          error=problems[0] if problems else None, modelled_cost=cost,
                          filler=self.batches.filler())
        batch.error = batch.error or problem.get("error")
        batch.stop = problem.get("stop")
        self.step += 1
        return batch

    def take_skipped(self) -> list[dict]:
        """The samples skipped since the last call (id, source, step, kind, reason)."""
        return self.reader.take_skipped()

    def load_samples(self, keys: list[str]) -> list:
        """The processed samples of `keys` (e.g. to replay another run's batch in one process)."""
        return [self._sample(k) for k in keys]

    def _sample(self, key: str):
        loc = key_locator(key)
        source = self.sources[loc.source]
        row = self.reader.rows.pop(key, None)
        if row is None:
            row = source.fetch(loc)
        try:
            text, media, sid = source.parts(row, loc)
            return self.processors[loc.source](text=text, media=media, sample_id=sid,
                                               source=loc.source)
        except DataError as e:
            e = source.explain(e, row)
            e.sample_id = source.sample_id(row, loc)
            raise e from None

    def close(self) -> None:
        """Close the open streams and stop the data workers."""
        for cursor in self.reader.cursors.values():
            cursor.close()
        self.batches.close()

    # --------------------------------------------------------------------------------- state
    def rewind(self) -> None:
        """Undo the last `next_step`, whose batch was not trained (the run stopped before it):
        the position goes back to where that step began, so a resumed run reads its samples."""
        self.restore(self._step_start)

    def restore(self, position: dict) -> None:
        """Go back (or forward) to a position `_position` returned."""
        self.step = self.state.restore(position)

    def _position(self) -> dict:
        """A copy of this rank's data position (what `rewind` goes back to)."""
        return self.state.position(self.step)

    def state_dict(self, position: dict | None = None) -> dict:
        """The whole run's data state (call on every rank; every rank gets the same dict), now or
        at a `position` of this loader's (`_position()`: the prefetcher's steps taken)."""
        return self.state.state_dict(position or self._position())

    def load_state_dict(self, state: dict) -> None:
        self.step = self.state.load_state_dict(state)
