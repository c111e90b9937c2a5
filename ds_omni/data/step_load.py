"""The loader's third phase: load and pack this rank's micro-batches of a step.

Each rank reads and preprocesses only the samples assigned to it (rows it read itself come from
memory, others by locator from storage: no payload crosses ranks) and packs each micro-batch into
one row, here or in `data.workers` processes. Every sample is accounted for: packed (its key
reported by its owner), skipped by its source's policy, or this step's error.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback

from ds_omni.batch import MicroBatch
from ds_omni.data.cost import CostModel
from ds_omni.data.packing import SeqShard, empty_micro_batch, tp_share
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.rank_place import LongSplits, RankPlace
from ds_omni.data.sample_reader import SampleReader, key_locator
from ds_omni.data.workers import ItemCost, Packed, PackJob, Packer, SampleFailure, WorkerPool
from ds_omni.errors import DataError

QUIET_STEPS = 50  # steps without a long item before a numeric parallel.encoder_sp is questioned
log = logging.getLogger(__name__)


class MicroBatchLoader:
    """Loads, processes and packs the samples a step assigned to this rank. `workers` > 0:
    decoding, HF processing and packing run in that many `data.workers` processes."""

    def __init__(self, reader: SampleReader, processors: dict[str, SampleProcessor],
                 cost_model: CostModel, place: RankPlace, splits: LongSplits, workers: int,
                 every_shard: bool = False, worker_cores: tuple[tuple[int, ...], ...] = ()):
        self.reader, self.cost_model = reader, cost_model
        # the SP group's reader (`ds_omni.data.shared_read`): it packs every rank's shard, and
        # `peers` holds the other ranks' micro-batches of the last `load`
        self.every_shard = every_shard and place.sp_size > 1
        self.peers: list[list[MicroBatch]] = []
        self.dp_rank = place.dp_rank
        self.item_processors = next(iter(processors.values())).item_processors
        self.family = next(iter(processors.values())).family
        # the ranks of one SP group read the same rows; each packs its own shard of them
        self._item_cost = ItemCost(cost_model)
        self.long_items = splits.long_items  # items a whole SP group encodes (long-short SP)
        self.max_degree = place.max_sequence_sp  # per-sequence SP: blocks of up to this many ranks
        self._steps_without_long_items = 0
        self.shard = (SeqShard(place.sp_rank, place.sp_size, self._item_cost, self.long_items,
                               cut=place.row_cut) if place.sp_size > 1 else None)
        # decoding, HF processing and packing: here, or in `data.workers` processes
        self.packer = Packer(processors, self._item_cost, self.long_items)
        self.pool = WorkerPool(self.packer, workers, cores=worker_cores) if workers else None

    def load(self, mine: list[list[str]], stats: dict, step: int
             ) -> tuple[list[MicroBatch], list[str], list[str], float]:
        """The micro-batches of `mine` (keys per micro-batch) after the step's per-sequence SP
        rounds, the keys packed, the problems met and this rank's modelled cost."""
        keys, problems = [], []
        costs = stats.pop("costs", {})
        rounds = stats.pop("rounds", [])
        # per-sequence SP: the long sequences first, round by round; then the normal micro-batches
        shard = self.shard and (self.shard.rank, self.shard.size, self.shard.cut)
        todo = [self._long_job(entry) for entry in rounds] + [
            self._job([(k, True) for k in mb_keys], shard) for mb_keys in mine]
        packed = self._pack([job for job, _ in todo], problems)
        self.reader.counts.items += sum(made.items_made for made in packed)
        micro = self._report(todo, packed, keys, problems, step)
        self.peers = [[made.peers[r] for made in packed] for r in range(self.shard.size - 1)] \
            if self.every_shard else []
        long_keys, long_cost = {e[0] for e in rounds if e}, 0.0
        for entry, mb in zip(rounds, micro):
            if mb.route.sp_block is not None:
                long_cost += costs.get(entry[0], 0.0) / entry[2]  # this rank's share
        stats["skipped"] = dict(self.reader.skipped)
        # long-short SP: items this rank's groups encode together (rank 0's figure is logged)
        stats["long_items"] = sum(len(v) for mb in micro if mb.route.reshard
                                  for v in mb.route.reshard.split.values())
        self._check_long_items(stats["long_items"])
        normal_cost = sum(costs.get(k, 0.0) for k in keys if k not in long_keys)
        return micro, keys, problems, float(normal_cost + long_cost) + self.dummy_cost(micro)

    def dummy_cost(self, micro: list[MicroBatch]) -> float:
        """The model runs a dummy through each encoder a micro-batch has no inputs for."""
        return float(sum(self.cost_model.dummy_cost(mb.encoder_inputs) for mb in micro))

    def filler(self) -> MicroBatch | None:
        """Per-sequence SP: the zero-weight micro-batch a step's ranks are evened out with."""
        return empty_micro_batch(self.family, self.item_processors) if self.max_degree > 1 else None

    def _job(self, members: list[tuple[str, bool]], shard, shard_empty: bool = True,
             sp_block: tuple[int, int] | None = None):
        """(PackJob, its samples' (key, owner, row, problem reading it)) of one micro-batch;
        `sp_block`: per-sequence SP, the block that splits its row (`Route.sp_block`)."""
        parts, samples = [], []
        sources = self.reader.sources
        for key, owner in members:
            loc, row = key_locator(key), None
            try:
                row = self.reader.rows.pop(key, None)
                if row is None:
                    row = sources[loc.source].fetch(loc)
                    self.reader.counts.read(row)
                text, media, sid = sources[loc.source].parts(row, loc)
            except Exception as e:
                samples.append((key, owner, row, e if isinstance(e, DataError) else SampleFailure(
                    f"{type(e).__name__}: {e}", traceback.format_exc())))
                continue
            parts.append((loc.source, text, media, sid))
            samples.append((key, owner, row, None))
        return PackJob(parts, shard, shard_empty, self.every_shard and shard is not None,
                       sp_block), samples

    def _long_job(self, entry):
        """This rank's shard of one long sequence (its block's Ulysses group splits it), or an
        empty micro-batch for a round this rank sits out. Every block member loads the sample
        (by locator) and packs the same row; only the first reports its key."""
        if entry is None:
            return PackJob([], None), []
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
            return [Packed(self.empty(), [None] * len(job.parts),
                           [self.empty(r) for r in range(1, self.shard.size)]
                           if self.every_shard else None) for job in jobs]

    def tp_share(self, mb: MicroBatch, tp_rank: int, tp: int) -> MicroBatch:
        """TP rank `tp_rank`'s copy of the row `mb` (`packing.tp_share`: its items' inputs)."""
        return tp_share(mb, self.item_processors, tp_rank, tp, self._item_cost)

    def empty(self, sp_rank: int | None = None) -> MicroBatch:
        """An empty micro-batch of this rank (or of SP rank `sp_rank` of its group)."""
        shard = self.shard if sp_rank is None else dataclasses.replace(self.shard, rank=sp_rank)
        return empty_micro_batch(self.family, self.item_processors, shard)

    def _report(self, todo, packed: list[Packed], keys: list, problems: list,
                step: int) -> list[MicroBatch]:
        """The micro-batches, with each sample reported in order: the key of a packed one (by its
        owner), a bad one skipped by policy or its error put in `problems`."""
        micro = []
        for (_, samples), made in zip(todo, packed):
            worker_problems = iter(made.problems)
            for key, owner, row, problem in samples:
                problem = problem or next(worker_problems)
                self._account(key, owner, row, problem, keys, problems, step)
            micro.append(made.micro_batch)
        return micro

    def _account(self, key: str, owner: bool, row, problem, keys: list, problems: list,
                 step: int) -> None:
        if problem is None:
            if owner:
                keys.append(key)
        elif isinstance(problem, SampleFailure):  # not a bad sample: a bug or a failing library
            loc = key_locator(key)
            where = f"{key} (row {loc.row} of {self.reader.sources[loc.source].files[loc.file]})"
            problems.append(self.reader.failure(problem, f"loading sample {where}"))
        elif owner:
            loc = key_locator(key)
            source = self.reader.sources[loc.source]
            error = source.explain(problem, row) if row is not None else problem
            sample_id = source.sample_id(row, loc) if row is not None else key
            try:
                self.reader.bad(loc.source, sample_id, error, str(loc), step)
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

    def close(self) -> None:
        """Stop the data workers."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
