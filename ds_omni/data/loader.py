"""The loader of one data-parallel rank: streams, mixing, grouped reordering, packing, state.

One global step, on every data-parallel rank, in three phases:
  1. read (`sample_reader.py`): the mixer picks a source for each slot; each source streams this
     rank's chunks; each row is measured (tokens, encoder lengths, modelled cost) undecoded;
  2. plan (`step_plan.py`): the G ranks of a group all-gather the measurements and each computes
     the same assignment to ranks and micro-batches (`reorder.py`);
  3. load (`step_load.py`): each rank reads and preprocesses only its own samples and packs each
     micro-batch into one row.
Under SP or TP with `data.shared_reading` one rank of the group runs these phases and sends its
peers their shards (`shared_read.py`). The state (`loader_state.py`) is JSON and resumes under
another data-parallel size. `OmniLoader` composes the phases; its ranks, collectives and the
splitting of long work come in the values of `rank_place.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ds_omni.batch import MicroBatch
from ds_omni.config import DataConfig
from ds_omni.data.cost import CostModel
from ds_omni.data.loader_state import LoaderState
from ds_omni.data.mixer import Mixer, MixSchedule
from ds_omni.data import shared_read
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.rank_place import LoaderComms, LongSplits, RankPlace
from ds_omni.data.sample_reader import SampleReader, key_locator
from ds_omni.data.sources import Source
from ds_omni.data.step_load import MicroBatchLoader
from ds_omni.data.step_plan import StepPlanner
from ds_omni.data.workers import resolve_workers
from ds_omni.errors import DataError


def pack_tokens(cfg: DataConfig, global_batch_size: int, dp_size: int, num_micro: int) -> int:
    """A packed row's token budget: data.pack_tokens, else max_seq_len times the samples of one
    micro-batch of one data-parallel rank (also the simulator's, `ds_omni/sim/from_config.py`)."""
    return cfg.pack_tokens or cfg.max_seq_len * max(1, global_batch_size // (dp_size * num_micro))


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
    `splits`: per-sequence and long-short SP (none by default); `worker_cores`: the cores of its
    pack workers (`cores.py`; none: unpinned)."""

    def __init__(self, sources: list[Source], processors: dict[str, SampleProcessor],
                 cost_model: CostModel, cfg: DataConfig, *, global_batch_size: int,
                 place: RankPlace, comms: LoaderComms | None = None,
                 splits: LongSplits | None = None,
                 worker_cores: tuple[tuple[int, ...], ...] = ()):
        comms, splits = comms or LoaderComms(), splits or LongSplits()
        self.sources = {s.name: s for s in sources}
        self.processors, self.cost_model, self.cfg = processors, cost_model, cfg
        self.global_batch_size = global_batch_size
        self.num_micro, self.dp_rank, self.dp_size = place.num_micro, place.dp_rank, place.dp_size
        self.sp_size = place.sp_size
        self.comm = comms.data
        # the all-gathers of `next_step`: groups of their own when steps run on a prefetch thread
        self.step_comm = comms.step
        self.mode = cfg.reorder.mode
        self.group_size = place.reorder_group
        if global_batch_size % self.dp_size:
            raise DataError(f"the global batch of {global_batch_size} samples does not split over "
                            f"{self.dp_size} data-parallel ranks")
        self.max_degree = place.max_sequence_sp  # per-sequence SP: blocks of up to this many ranks
        self.pack_tokens = pack_tokens(cfg, global_batch_size, self.dp_size, self.num_micro)
        self.schedule = MixSchedule({s.name: s.cfg.weight for s in sources}, cfg.schedule)
        for s in sources:
            s.fit_chunks(self.dp_size)
        self.reader = SampleReader(self.sources, processors, cost_model, Mixer(self.schedule), cfg,
                                   place)
        self.planner = StepPlanner(self.reader, self.step_comm, cfg.reorder, place,
                                   group_size=self.group_size,
                                   samples_per_rank=global_batch_size // self.dp_size,
                                   pack_tokens=self.pack_tokens, max_degree=self.max_degree)
        # one reader per sp x tp group (`shared_read.py`): None, or this rank's place in it
        shared = comms.shared
        self.shared = shared if shared is not None and shared.comm.size > 1 else None
        if self.shared is not None and shared_read.shard_of(
                shared.comm.rank, shared.comm.size, place.sp_size) != place.sp_rank:
            raise ValueError(f"the loader's reader group puts this rank at {shared.comm.rank} of "
                             f"{shared.comm.size}, its place says sp_rank {place.sp_rank} of "
                             f"{place.sp_size}")
        self.batches = MicroBatchLoader(self.reader, processors, cost_model, place, splits,
                                        resolve_workers(cfg.workers), every_shard=self.shared is not None,
                                        worker_cores=worker_cores)
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
        path (a bug, a failing HF processor): it becomes `error` the same way.

        Under one reader per sp x tp group (`shared_read.py`) the reader makes the step and sends
        each peer its part; a peer only receives."""
        if self.shared is None:
            return self._make_step()
        if self.shared.comm.rank > 0:
            return self._peer_step()
        skips_before = len(self.reader.skip_log)
        self.batches.peers = []
        try:
            batch = self._make_step()
        except Exception as e:  # the peers wait for a batch: send them the error instead
            if isinstance(e, torch.distributed.DistError):
                raise
            batch = self._failed_step(e)
        self._send_step(batch, self.reader.skip_log[skips_before:])
        return batch

    def _make_step(self) -> StepBatch:
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

    def _failed_step(self, e: Exception) -> StepBatch:
        """The reader failed making the step: an error batch (empty micro-batches)."""
        batch = StepBatch(step=self.step, micro_batches=[self.batches.empty()] * self.num_micro,
                          error=self.reader.failure(e, "making the step of its reader group"))
        self.step += 1
        return batch

    def _send_step(self, batch: StepBatch, skips: list[dict]) -> None:
        """The reader: each peer its step batch, this rank's position after it, its skips."""
        size, after = self.shared.comm.size, self._position()
        shards = self.batches.peers  # SP shards 1..sp-1 (none without SP)
        if len(shards) != self.sp_size - 1:  # the step failed before packing
            batch.error = batch.error or "the SP group's reader packed no shards for its peers"
            shards = [[self.batches.empty(r)] * len(batch.micro_batches)
                      for r in range(1, self.sp_size)]
        peers = shared_read.peer_shards(batch.micro_batches, shards, size)
        if self.shared.tp_apart > 1:  # TP rank g encodes its own items of each row only
            peers = [[mb if mb.route.sp_block is not None  # a block's row: split over its ranks
                      else self.batches.tp_share(mb, g, self.shared.tp_apart) for mb in micro]
                     for g, micro in enumerate(peers, start=1)]
        dummies = self.batches.dummy_cost(batch.micro_batches)
        parcels = [{"batch": dataclasses.replace(
            batch, micro_batches=[shared_read.peer_view(mb, self.shared.all_items) for mb in micro],
            modelled_cost=batch.modelled_cost - dummies + self.batches.dummy_cost(micro),
            filler=None), "after": after, "skips": skips} for micro in peers]
        shared_read.send(self.shared.comm, parcels)

    def _peer_step(self) -> StepBatch:
        """A peer: the step its reader made, and the reader's position after it as its own."""
        self._step_start = self._position()
        got = shared_read.receive(self.shared.comm, self.dp_rank)
        skip_log = self.reader.skip_log
        self.restore(got["after"])
        self.reader.skip_log = skip_log + got["skips"]
        batch = got["batch"]
        batch.filler = self.batches.filler()
        return batch

    @property
    def counts(self):
        """What this rank read and processed (`sample_reader.ReadCounts`)."""
        return self.reader.counts

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
