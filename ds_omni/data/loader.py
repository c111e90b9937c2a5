"""The loader of one data-parallel rank: streams, mixing, grouped reordering, packing, state.

One global step, on every data-parallel rank:
  1. read: the mixer picks a source for each of this rank's slots; each source's cursor streams
     this rank's chunks (each read from its own position: a parquet row group, a jsonl byte
     offset); each row is *measured* (tokens, encoder sequence lengths, modelled cost) without
     decoding its media;
  2. plan: the G ranks of the group all-gather only these measurements and each computes the same
     assignment of the group's samples to ranks and micro-batches (`reorder.py`): in "fixed" mode
     the group's share of a fixed-size global batch is balanced, in "budget" mode every rank is
     filled to one cost budget from a lookahead buffer the group shares;
  3. load: each rank reads and preprocesses only the samples assigned to it (rows it read itself
     come from memory, others by locator from storage: no payload crosses ranks) and packs each
     micro-batch into one row.

The state is JSON: every rank's cursors and mixer, and each group's buffer. It is gathered to a
single file, records the data-parallel size, and resumes under another one (elastic): unread
chunk pieces and buffered samples are spread over the new ranks, so no sample is lost or read
twice. A step that was interrupted was never recorded, so its samples are read again.
"""

from __future__ import annotations

import copy
import logging
import sys
import traceback
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ds_omni.batch import MicroBatch
from ds_omni.config import DataConfig
from ds_omni.data import reorder
from ds_omni.data.cost import CostModel
from ds_omni.data.mixer import Mixer, MixSchedule
from ds_omni.data.packing import SeqShard, empty_micro_batch
from ds_omni.data.problems import kind_of
from ds_omni.data.processing import SampleProcessor, SampleSize
from ds_omni.data.sources import Locator, Source
from ds_omni.data.stream import SourceCursor, redistribute
from ds_omni.data.workers import ItemCost, Packed, PackJob, Packer, SampleFailure, WorkerPool
from ds_omni.errors import DataError
from ds_omni.parallel.hdp import check_degree
from ds_omni.parallel.long_short import LongItems

LOADER_STATE_VERSION = 2
QUIET_STEPS = 50  # steps without a long item before a numeric parallel.encoder_sp is questioned
log = logging.getLogger(__name__)


class DataComm(Protocol):
    """The collectives the loader needs (torch.distributed in training; threads in unit tests)."""

    def group_all_gather(self, obj) -> list:
        """`obj` of every rank of this rank's reorder group, in group-rank order."""

    def world_all_gather(self, obj) -> list:
        """`obj` of every data-parallel rank, in dp-rank order."""


class LocalComm:
    """One data-parallel rank alone."""

    def group_all_gather(self, obj) -> list:
        return [obj]

    def world_all_gather(self, obj) -> list:
        return [obj]


@dataclass(frozen=True)
class Measured:
    """One read sample as the group sees it (no payload)."""

    key: str  # "<epoch>/<source>:<file>:<row>": unique while the sample is in flight
    tokens: int
    cost: float


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


def reorder_group_size(cfg: DataConfig, dp_size: int) -> int:
    """G: ranks that share metadata (1 for loader order; never more than the dp ranks)."""
    if cfg.reorder.mode == "loader_order":
        return 1
    group = min(cfg.reorder.group_size, dp_size)
    if dp_size % group:
        raise DataError(f"data.reorder.group_size={group} must divide the data-parallel size "
                        f"{dp_size}; pick a divisor of {dp_size}")
    return group


def key_locator(key: str) -> Locator:
    return Locator.parse(key.split("/", 1)[1])


class OmniLoader:
    """This rank's loader. Call `next_step()` on every rank in lockstep (it communicates)."""

    def __init__(self, sources: list[Source], processors: dict[str, SampleProcessor],
                 cost_model: CostModel, cfg: DataConfig, *, global_batch_size: int,
                 num_micro: int, dp_rank: int, dp_size: int, comm: DataComm | None = None,
                 sp_rank: int = 0, sp_size: int = 1, max_sequence_sp: int = 1,
                 step_comm: DataComm | None = None, long_items: LongItems | None = None):
        self.sources = {s.name: s for s in sources}
        self.processors = processors
        self.item_processors = next(iter(processors.values())).item_processors
        self.family = next(iter(processors.values())).family
        self.cost_model, self.cfg = cost_model, cfg
        self.global_batch_size, self.num_micro = global_batch_size, num_micro
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # the ranks of one SP group read the same rows; each packs its own shard of them
        self._item_cost = ItemCost(cost_model)
        self.long_items = long_items  # encoder items a whole SP group encodes (long-short SP)
        self._steps_without_long_items = 0
        self.shard = (SeqShard(sp_rank, sp_size, self._item_cost, long_items) if sp_size > 1
                      else None)
        # decoding, HF processing and packing: here, or in `data.workers` processes
        self.packer = Packer(processors, self._item_cost, long_items)
        self.pool = WorkerPool(self.packer, cfg.workers) if cfg.workers else None
        self.comm = comm or LocalComm()
        # the all-gathers of `next_step`: groups of their own when steps run on a prefetch thread
        self.step_comm = step_comm or self.comm
        self.mode = cfg.reorder.mode
        self.group_size = reorder_group_size(cfg, dp_size)
        if global_batch_size % dp_size:
            raise DataError(f"the global batch of {global_batch_size} samples does not split over "
                            f"{dp_size} data-parallel ranks")
        self.group_rank = dp_rank % self.group_size
        self.max_degree = max_sequence_sp  # per-sequence SP: blocks of up to this many ranks
        if max_sequence_sp > 1:
            check_per_sequence(self.mode, self.group_size, max_sequence_sp)
        self.pack_tokens = cfg.pack_tokens or cfg.max_seq_len * max(1, global_batch_size // (
            dp_size * num_micro))
        self.schedule = MixSchedule({s.name: s.cfg.weight for s in sources}, cfg.schedule)
        self.mixer = Mixer(self.schedule)
        for s in sources:
            s.fit_chunks(dp_size)
        self.cursors = self._make_cursors()
        self.planner = (reorder.BudgetPlanner(self.group_size, num_micro,
                                              max_wait=cfg.reorder.max_wait,
                                              lookahead=cfg.reorder.lookahead)
                        if self.mode == "budget" else None)
        self.cost_budget = cfg.reorder.cost_budget
        self.step = 0
        self._problem: dict[str, str] = {}
        self.rows: dict[str, dict] = {}  # rows this rank read that are still in flight
        self.skipped: dict[str, int] = {n: 0 for n in self.sources}
        self.skip_log: list[dict] = []  # skipped samples not yet written (see take_skipped)
        self._bad_run: dict[str, int] = {n: 0 for n in self.sources}  # bad rows in a row

    def _make_cursors(self) -> dict[str, SourceCursor]:
        return {s.name: SourceCursor(s, i, self.dp_rank, self.dp_size, self.cfg.seed)
                for i, s in enumerate(self.sources.values())}

    # --------------------------------------------------------------------------- public API
    def set_weights(self, weights: dict[str, float]) -> None:
        """Change mixing weights from the next global batch on (call on every rank)."""
        self.schedule.set_weights(weights, from_step=self.step)

    def next_step(self) -> StepBatch:
        """This rank's micro-batches. A data problem does not raise here (the other ranks would
        wait in a collective): it is reported in `error` / `stop`, for the trainer to act on
        after its all-reduce, on every rank at once. Nor does any other exception of the data
        path (a bug, a failing HF processor): it becomes `error` the same way."""
        self._problem: dict[str, str] = {}
        self._step_start = self._position()
        try:
            mine, stats = self._plan_budget() if self.mode == "budget" else self._plan_fixed()
        except Exception as e:  # DataError: the plan is the same on every rank of the group
            if isinstance(e, torch.distributed.DistError):  # a collective failed: nothing to tell
                raise
            mine, stats = [[] for _ in range(self.num_micro)], {}
            self._problem.setdefault("error", self._failure(e, "planning the step"))
        batch = self._load(mine, stats)
        batch.error = batch.error or self._problem.get("error")
        batch.stop = self._problem.get("stop")
        self.step += 1
        return batch

    # ------------------------------------------------------------------------------- reading
    def _read(self, n: int) -> list[Measured]:
        """Measure up to `n` new samples from this rank's streams (skipping bad ones by policy).

        Fewer come back when every source has run dry, or after a problem, which is kept in
        `_problem` rather than raised: the group's all-gather still needs this rank.
        """
        sized: list[tuple[str, SampleSize]] = []
        try:
            self._read_into(sized, n)
        except _StopData as e:
            self._problem.setdefault("stop", str(e))
        except Exception as e:
            self._problem.setdefault("error", self._failure(e, "reading samples"))
        costs = self._costs([size for _, size in sized])
        return [Measured(key, size.tokens, c) for (key, size), c in zip(sized, costs)]

    def _read_into(self, out: list, n: int) -> None:
        if self._problem:
            return
        for name in self._pick(n):
            while name is not None:
                got = self._read_one(name)
                if got is not None:
                    out.append(got)
                    break
                if name in self.mixer.dropped:  # exhausted and left the mix: another source
                    name = next(iter(self._pick(1)), None)

    def _pick(self, n: int) -> list[str]:
        if self._dry():
            return []
        return self.mixer.pick(self.step, n)

    def _dry(self) -> bool:
        """Every source has left the mix (on_exhausted="drop")."""
        return len(self.mixer.dropped) == len(self.sources)

    def _read_one(self, name: str) -> tuple[str, SampleSize] | None:
        cursor, source = self.cursors[name], self.sources[name]
        got = cursor.next()
        if got is None:
            self._exhausted(name)
            return None
        loc, row = got
        try:
            text, media, sid = source.parts(row, loc)
            size = self.processors[name].measure(text=text, media=media, sample_id=sid, source=name)
        except DataError as e:
            self._bad(name, source.sample_id(row, loc), source.explain(e, row), str(loc))
            self._bad_run[name] += 1
            bound = min(self.cfg.max_bad_run, len(source))
            if self._bad_run[name] >= bound:
                raise DataError(f"data source '{name}' gave {self._bad_run[name]} bad samples in a "
                                f"row and no good one (data.max_bad_run={self.cfg.max_bad_run}, "
                                f"{len(source)} rows); the last: {e}. Run `ds-omni data check` "
                                "to see every problem of the source") from None
            return None
        self._bad_run[name] = 0
        key = f"{cursor.epoch}/{loc}"
        self.rows[key] = row
        return key, size

    def _bad(self, name: str, sample_id: str, error: DataError, locator: str) -> None:
        """A bad sample: raise under on_bad_sample="error", else count and log it."""
        if self.sources[name].cfg.on_bad_sample == "error":
            raise DataError(f"{error}. To skip such samples instead, set data.sources[{name}]."
                            "on_bad_sample to \"skip\" (their ids then go to "
                            "<output_dir>/skipped.jsonl)") from None
        self.skipped[name] += 1
        self.skip_log.append({"id": sample_id, "source": name, "locator": locator,
                              "step": self.step, "kind": kind_of(error), "reason": str(error)})

    def take_skipped(self) -> list[dict]:
        """The samples skipped since the last call (id, source, step, kind, reason)."""
        out, self.skip_log = self.skip_log, []
        return out

    def _costs(self, sizes: list[SampleSize]) -> list[float]:
        """Modelled cost of each sample, in one vectorised call."""
        if not sizes:
            return []
        passes = [(i, enc, n) for i, size in enumerate(sizes) for enc, n in size.encoder_seqs]
        return self.cost_model.sample_costs(
            np.array([size.tokens for size in sizes]), np.array([i for i, _, _ in passes], dtype=np.int64),
            np.array([e for _, e, _ in passes], dtype=str),
            np.array([n for _, _, n in passes], dtype=np.int64)).tolist()

    def _exhausted(self, name: str) -> None:
        policy = self.sources[name].cfg.on_exhausted
        if policy == "repeat":
            self.cursors[name].next_epoch()
        elif policy == "drop":
            self.mixer.drop(name)
        else:
            raise _StopData(f"data source '{name}' is exhausted (on_exhausted='stop')")

    # ------------------------------------------------------------------------------ planning
    def _plan_fixed(self) -> tuple[list[list[str]], dict]:
        local = self._read(self.global_batch_size // self.dp_size)
        group = [m for part in self.step_comm.group_all_gather(local) for m in part]
        cost = np.array([m.cost for m in group])
        tokens = np.array([m.tokens for m in group], dtype=np.int64)
        if self.mode == "loader_order":
            assignment = reorder.loader_order(len(group), self.group_size, self.num_micro)
        else:
            assignment = reorder.assign_fixed(cost, tokens, self.group_size, self.num_micro,
                                              self.pack_tokens, self.max_degree)
        keys = [m.key for m in group]
        mine = [[keys[i] for i in idx] for idx in assignment.members(self.group_rank)]
        rounds = self._rounds(assignment, keys)
        # rows read here but assigned elsewhere: their rank reads them itself
        self._forget({m.key for m in local} - {k for mb in mine for k in mb} -
                     {r[0] for r in rounds if r})
        return mine, {"costs": {m.key: m.cost for m in group}, "rounds": rounds}

    def _plan_budget(self) -> tuple[list[list[str]], dict]:
        samples_per_rank = self.global_batch_size // self.dp_size
        if self.cost_budget is None:
            self.cost_budget = self._first_budget(samples_per_rank)
        while self.planner.wants_more(self.cost_budget):
            new = [m for part in self.step_comm.group_all_gather(
                self._read(max(1, samples_per_rank // 2))) for m in part]
            if not new:  # the whole group ran dry (or hit a problem): plan what is buffered
                break
            self._buffer(new)
        plan = self.planner.plan(self.cost_budget, self.pack_tokens, self.max_degree)
        costs = dict(zip(plan.keys, plan.cost.tolist()))
        mine = plan.micro_keys(self.group_rank)
        rounds = self._rounds(plan.assignment, plan.keys)
        self._forget(set(plan.keys) - {k for mb in mine for k in mb} - {r[0] for r in rounds if r})
        return mine, {"costs": costs, "outliers": len(plan.outliers), "rounds": rounds,
                      "mean_delay": float(plan.delay.mean()) if plan.delay.size else 0.0,
                      "max_delay": int(plan.delay.max()) if plan.delay.size else 0}

    def _rounds(self, assignment: reorder.Assignment, keys: list) -> list:
        """Per-sequence SP: for each round of the step's long sequences, (key, rank in the
        block, block size, first data-parallel rank of the block) or None (an empty round)."""
        base = self.dp_rank - self.group_rank  # the group's first data-parallel rank
        out = []
        for i in assignment.rounds(self.group_rank):
            b = assignment.blocks.get(i)
            out.append(None if b is None else (keys[i], self.group_rank - b.start, b.size,
                                               base + b.start))
        return out

    def _first_budget(self, samples_per_rank: int) -> float:
        """Mean modelled cost of a first read on every rank x samples per rank: the same number on
        every rank of every group (the reads go into the buffer)."""
        first = self._read(samples_per_rank)
        self._buffer([m for part in self.step_comm.group_all_gather(first) for m in part])
        everyone = [c for part in self.step_comm.world_all_gather([m.cost for m in first])
                    for c in part]
        return reorder.rank_budget(np.array(everyone), samples_per_rank)

    def _buffer(self, measured: list[Measured]) -> None:
        self.planner.add([m.key for m in measured], np.array([m.cost for m in measured]),
                         np.array([m.tokens for m in measured], dtype=np.int64))

    def _forget(self, keys) -> None:
        for k in keys:
            self.rows.pop(k, None)

    # ------------------------------------------------------------------------------- loading
    def _load(self, mine: list[list[str]], stats: dict) -> StepBatch:
        keys, problems = [], []
        costs = stats.pop("costs", {})
        rounds = stats.pop("rounds", [])
        # per-sequence SP: the long sequences first, round by round; then the normal micro-batches
        shard = self.shard and (self.shard.rank, self.shard.size)
        todo = [self._long_job(entry) for entry in rounds] + [
            self._job([(k, True) for k in mb_keys], shard) for mb_keys in mine]
        micro = self._report(todo, self._pack([job for job, _, _ in todo], problems), keys,
                             problems)
        long_keys, long_cost = {e[0] for e in rounds if e}, 0.0
        for entry, mb in zip(rounds, micro):
            if mb.sp_block is not None:
                long_cost += costs.get(entry[0], 0.0) / entry[2]  # this rank's share
        stats["skipped"] = dict(self.skipped)
        # long-short SP: items this rank's groups encode together (rank 0's figure is logged)
        stats["long_items"] = sum(len(v) for mb in micro if mb.reshard
                                  for v in mb.reshard.split.values())
        self._check_long_items(stats["long_items"])
        # the model runs a dummy through each encoder a micro-batch has no inputs for
        dummies = sum(self.cost_model.dummy_cost(mb.encoder_inputs) for mb in micro)
        normal_cost = sum(costs.get(k, 0.0) for k in keys if k not in long_keys)
        return StepBatch(step=self.step, micro_batches=micro, keys=keys, stats=stats,
                         error=problems[0] if problems else None,
                         modelled_cost=float(normal_cost + long_cost) + dummies,
                         filler=(empty_micro_batch(self.family, self.item_processors)
                                 if self.max_degree > 1 else None))

    def _job(self, members: list[tuple[str, bool]], shard, shard_empty: bool = True,
             sp_block: tuple[int, int] | None = None):
        """(PackJob, its samples' (key, owner, row, problem reading it), the sp_block it gets
        if a sample is packed) of one micro-batch."""
        parts, samples = [], []
        for key, owner in members:
            loc, row = key_locator(key), None
            try:
                row = self.rows.pop(key, None)
                if row is None:
                    row = self.sources[loc.source].fetch(loc)
                text, media, sid = self.sources[loc.source].parts(row, loc)
            except Exception as e:
                samples.append((key, owner, row, e if isinstance(e, DataError) else SampleFailure(
                    f"{type(e).__name__}: {e}", traceback.format_exc())))
                continue
            parts.append((loc.source, text, media, sid))
            samples.append((key, owner, row, None))
        return PackJob(parts, shard, shard_empty), samples, sp_block

    def _long_job(self, entry):
        """This rank's shard of one long sequence (its block's Ulysses group splits it), or an
        empty micro-batch for a round this rank sits out. Every block member loads the sample
        (by locator) and packs the same row; only the first reports its key."""
        if entry is None:
            return PackJob([], None), [], None
        key, rank_in_block, size, first_rank = entry
        return self._job([(key, rank_in_block == 0)], (rank_in_block, size), shard_empty=False,
                         sp_block=(first_rank, size))

    def _pack(self, jobs: list[PackJob], problems: list) -> list[Packed]:
        """The jobs made here or by the workers; a failed worker is this step's error (every rank
        then stops with it), with empty micro-batches in place."""
        if self.pool is None:
            return [self.packer(job) for job in jobs]
        try:
            return self.pool.map(jobs)
        except DataError as e:
            problems.append(f"data-parallel rank {self.dp_rank}: {e}")
            return [Packed(empty_micro_batch(self.family, self.item_processors, self.shard),
                           [None] * len(job.parts)) for job in jobs]

    def _report(self, todo, packed: list[Packed], keys: list, problems: list) -> list[MicroBatch]:
        """The micro-batches, with each sample reported in order: the key of a packed one (by its
        owner), a bad one skipped by policy or its error put in `problems`. A long sequence's
        micro-batch is marked (sp_block) when its sample was packed."""
        micro = []
        for (_, samples, sp_block), made in zip(todo, packed):
            worker_problems = iter(made.problems)
            packed_any = False
            for key, owner, row, problem in samples:
                problem = problem or next(worker_problems)
                packed_any |= problem is None
                self._account(key, owner, row, problem, keys, problems)
            made.micro_batch.sp_block = sp_block if packed_any else None
            micro.append(made.micro_batch)
        return micro

    def _account(self, key: str, owner: bool, row, problem, keys: list, problems: list) -> None:
        if problem is None:
            if owner:
                keys.append(key)
        elif isinstance(problem, SampleFailure):  # not a bad sample: a bug or a failing library
            problems.append(self._failure(problem, f"loading sample {key}"))
        elif owner:
            loc = key_locator(key)
            source = self.sources[loc.source]
            error = source.explain(problem, row) if row is not None else problem
            sample_id = source.sample_id(row, loc) if row is not None else key
            try:
                self._bad(loc.source, sample_id, error, str(loc))
            except DataError as stop:
                problems.append(str(stop))

    def _check_long_items(self, count: int) -> None:
        """A numeric `parallel.encoder_sp` that no item has reached in QUIET_STEPS steps is said
        once: most likely it is set far above the items' costs (so nothing is ever split)."""
        if count:
            self._steps_without_long_items = -1  # it works: never say it
        elif self._steps_without_long_items >= 0 and (self.shard or self.max_degree > 1) and (
                self.long_items is not None and self.long_items.threshold is not None):
            self._steps_without_long_items += 1
            if self._steps_without_long_items == QUIET_STEPS:
                log.warning("parallel.encoder_sp=%g: no image or clip has cost more than that in %d "
                            "steps, so every item was encoded whole; lower it, or use \"auto\"",
                            self.long_items.threshold, QUIET_STEPS)

    def load_samples(self, keys: list[str]) -> list:
        """The processed samples of `keys` (e.g. to replay another run's batch in one process)."""
        return [self._sample(k) for k in keys]

    def _sample(self, key: str):
        loc = key_locator(key)
        source = self.sources[loc.source]
        row = self.rows.pop(key, None)
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

    def _failure(self, e: Exception | SampleFailure, doing: str) -> str:
        """The message of an exception raised while `doing`, for every rank; an unexpected one
        (not a DataError) also prints its traceback here, on the rank where it happened (a
        `SampleFailure` brings that of the process it happened in)."""
        if isinstance(e, DataError):
            return str(e)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        who = f"the data loader of rank {rank} (data-parallel rank {self.dp_rank})"
        failed = isinstance(e, SampleFailure)
        print(f"ds-omni: {who} failed while {doing}:\n"
              f"{e.traceback if failed else traceback.format_exc()}", file=sys.stderr, flush=True)
        what = e.message if failed else f"{type(e).__name__}: {e}"
        return f"{who} failed while {doing}: {what} (traceback in that rank's log)"

    def rewind(self) -> None:
        """Undo the last `next_step`, whose batch was not trained (the run stopped before it):
        the position goes back to where that step began, so a resumed run reads its samples."""
        self.restore(self._step_start)

    def restore(self, position: dict) -> None:
        """Go back (or forward) to a position `_position` returned."""
        self.step, self.cost_budget = position["step"], position["cost_budget"]
        self.cursors = self._make_cursors()
        for name, cursor in self.cursors.items():
            cursor.load_state_dict(position["local"]["cursors"][name])
        self.mixer.load_state_dict(copy.deepcopy(position["local"]["mixer"]))
        self.skipped = dict(position["local"]["skipped"])
        if self.planner is not None:
            self.planner.load_state_dict(copy.deepcopy(position["planner"]))
        self.rows, self.skip_log = {}, []

    def _position(self) -> dict:
        """A copy of this rank's data position (what `rewind` goes back to)."""
        return copy.deepcopy({"step": self.step, "cost_budget": self.cost_budget,
                              "local": self.local_state(),
                              "planner": self.planner.state_dict() if self.planner else None})

    def close(self) -> None:
        """Close the open streams and stop the data workers."""
        for cursor in self.cursors.values():
            cursor.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # --------------------------------------------------------------------------------- state
    def local_state(self) -> dict:
        return {"cursors": {n: c.state_dict() for n, c in self.cursors.items()},
                "chunk_rows": {n: s.chunk_rows for n, s in self.sources.items()},
                "mixer": self.mixer.state_dict(), "skipped": dict(self.skipped)}

    def state_dict(self, position: dict | None = None) -> dict:
        """The whole run's data state (call on every rank; every rank gets the same dict), now or
        at a `position` of this loader's (`_position()`: the prefetcher's steps taken)."""
        position = position or self._position()
        ranks = self.comm.world_all_gather(position["local"])
        planners = self.comm.world_all_gather(
            position["planner"] if self.planner is not None and self.group_rank == 0 else None)
        return {"version": LOADER_STATE_VERSION, "dp_size": self.dp_size,
                "group_size": self.group_size, "mode": self.mode, "step": position["step"],
                "seed": self.cfg.seed, "schedule": self.schedule.state_dict(),
                "cost_budget": position["cost_budget"], "ranks": ranks,
                "groups": [p for p in planners if p is not None]}

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state)
        self.step = state["step"]
        self.schedule.load_state_dict(state["schedule"])
        self.cost_budget = state["cost_budget"] if self.cfg.reorder.cost_budget is None else \
            self.cfg.reorder.cost_budget
        old = state["ranks"]
        for name, source in self.sources.items():  # the chunks the state counts in
            source.set_chunk_rows(old[0]["chunk_rows"][name])
        self.cursors = self._make_cursors()
        for name, cursor in self.cursors.items():
            olds = [r["cursors"][name] for r in old]
            if state["dp_size"] == self.dp_size:
                cursor.load_state_dict(olds[self.dp_rank])
            else:
                source = self.sources[name]
                cursor.load_state_dict(redistribute(olds, self.dp_size, source.chunks,
                                                    self.cfg.seed, cursor.index)[self.dp_rank])
        same = state["dp_size"] == self.dp_size
        if same:
            self.mixer.load_state_dict(old[self.dp_rank]["mixer"])
        else:  # credits are per rank and under one slot each: start them afresh; keep drops
            self.mixer.dropped = set().union(*(r["mixer"]["dropped"] for r in old))
        self.skipped = {n: sum(r["skipped"].get(n, 0) for r in old) if not same else
                        old[self.dp_rank]["skipped"].get(n, 0) for n in self.sources}
        if self.planner is not None:
            self.planner.load_state_dict(self._group_buffer(state))
        self.rows = {}

    def _check_state(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise DataError(f"loader state version {state.get('version')} is not supported "
                            f"(this ds_omni reads version {LOADER_STATE_VERSION})")
        missing = sorted(set(self.sources) - set(state["ranks"][0]["cursors"]))
        if missing:
            raise DataError(f"the loader state has no position for source(s) {missing}; it was "
                            "written for other data.sources")
        if state["seed"] != self.cfg.seed:
            raise DataError(f"the loader state was written with data.seed={state['seed']}, the "
                            f"config says {self.cfg.seed}; resume with the same seed")

    def _group_buffer(self, state: dict) -> dict:
        """This group's planner state; under a new dp or group size, the old buffers are pooled
        and dealt out to the new groups (waits kept), so every buffered sample is trained once."""
        groups = state["groups"]
        n_groups = self.dp_size // self.group_size
        mine = self.dp_rank // self.group_size
        if state["dp_size"] == self.dp_size and state["group_size"] == self.group_size:
            return groups[mine]
        if not groups:
            return reorder.BudgetPlanner(self.group_size, self.num_micro).state_dict()
        step = max(g["step"] for g in groups)
        pooled = [(a - g["step"] + step, k, c, t) for g in groups for k, c, t, a in zip(
            g["buffer"]["keys"], g["buffer"]["cost"], g["buffer"]["tokens"], g["buffer"]["arrived"])]
        pooled.sort()
        share = pooled[mine::n_groups]
        base = groups[0]
        return {**base, "num_ranks": self.group_size, "step": step,
                "buffer": {"keys": [k for _, k, _, _ in share], "cost": [c for _, _, c, _ in share],
                           "tokens": [t for _, _, _, t in share],
                           "arrived": [a for a, _, _, _ in share]}}


def check_per_sequence(mode: str, group_size: int, max_degree: int) -> None:
    """Per-sequence SP places long sequences on blocks inside a reorder group."""
    if mode == "loader_order":
        raise DataError("parallel.max_sequence_sp > 1 needs grouped reordering to place long "
                        "sequences; set data.reorder.mode to \"fixed\" or \"budget\"")
    try:
        check_degree(max_degree, group_size)
    except ValueError as e:
        raise DataError(f"{e} (the group has min(data.reorder.group_size, data-parallel ranks) "
                        "ranks)") from None


class _StopData(Exception):
    """A source is exhausted under on_exhausted="stop"."""
