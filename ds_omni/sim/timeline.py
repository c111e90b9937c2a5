"""Per-rank timelines of one step and their critical path.

Every rank has a clock. An event runs a phase on a set of ranks for given seconds; it starts when
its rank is free and, if it depends on another event (a collective waits for its group's last
arrival, a pipeline stage for the activations of the stage before), not before that event ends.
Each event remembers what it waited for (its rank's previous event, or the dependency when that
ended later), so walking back from the step's last event gives the critical path: which rank,
in which phase, the step waited on. Time a rank spends waiting is its idle time.

Vectorised over ranks: one call records the same phase on many ranks at once.
Dims: W ranks, E events.
"""

from __future__ import annotations

import bisect

import numpy as np

COMPUTE, COMM = 0, 1


class Timeline:
    def __init__(self, world: int, phases: tuple[str, ...]):
        self.world, self.phases = world, list(phases)
        self.clock = np.zeros(world)
        self.last = np.full(world, -1, dtype=np.int64)  # [W] each rank's latest event
        self.compute = np.zeros(world)
        self.comm = np.zeros(world)
        self.idle = np.zeros(world)
        # the events, a block per call: ids [first, first + n) with their ranks, phase, start,
        # end and predecessor ([n] arrays kept as made: appending them to growing columns
        # copied most of a pipeline's step, ~10^6 events, again and again)
        self._blocks: list[tuple] = []  # (ranks, phase, start, end, prev, the ids returned)
        self._firsts: list[int] = []  # [B] each block's first id
        self._by_ids: dict[int, int] = {}  # id() of the ids a call returned -> its block
        self._slices: dict[int, tuple] = {}  # id() of a ranks array -> (it, slice or itself)
        self._phase_ids: dict[str, int] = {}
        for k, p in enumerate(self.phases):
            self._phase_ids.setdefault(p, k)
        self._count = 0

    def run(self, ranks, phase: str, seconds, kind: int = COMPUTE, after=None) -> np.ndarray:
        """Run `phase` on `ranks` [n] for `seconds` ([n] or a scalar), each no earlier than the
        end of its event `after` [n] (-1: none). Returns the new events' ids [n]."""
        ranks = np.asarray(ranks, dtype=np.int64)
        seconds = np.asarray(seconds, dtype=np.float64)
        at = self._at(ranks)  # a slice where the ranks are a range (a view: no gather)
        start, prev = self.clock[at], self.last[at]  # views of a slice: new arrays below
        if after is None and at is not ranks:
            start, prev = start.copy(), prev.copy()
        if after is not None:  # without, each starts at its clock: no idle time to add
            after = np.asarray(after, dtype=np.int64)
            dep_end = self._ends(after)
            waits = dep_end > start
            prev = np.where(waits, after, prev)  # new arrays (not views of the clocks)
            start = np.maximum(start, dep_end)
            self.idle[at] += start - self.clock[at]
        (self.compute if kind == COMPUTE else self.comm)[at] += seconds
        end = start + seconds
        if end.shape != ranks.shape:  # a scalar's seconds on one rank
            end = np.broadcast_to(end, ranks.shape).copy()
        ids = np.arange(self._count, self._count + ranks.size)
        self._by_ids[id(ids)] = len(self._blocks)
        self._firsts.append(self._count)
        block = (ranks, self._phase(phase), start, end, prev, ids)
        self._blocks.append(block if ranks.ndim == 1 else tuple(
            x if k == 1 else np.reshape(x, -1) for k, x in enumerate(block)))
        self._count += ranks.size
        self.clock[at], self.last[at] = end, ids
        return ids

    def _at(self, ranks: np.ndarray):
        """`ranks`, or the slice they are where they are a range of 16+ ranks (kept per array:
        a pipeline's stages run hundreds of passes each on the same ranks)."""
        hit = self._slices.get(id(ranks))
        if hit is not None and hit[0] is ranks:
            return hit[1]
        at = ranks
        if ranks.ndim == 1 and ranks.size >= 16 and ranks[0] >= 0 and \
                ranks[-1] - ranks[0] == ranks.size - 1 and bool((np.diff(ranks) == 1).all()):
            at = slice(int(ranks[0]), int(ranks[-1]) + 1)
        self._slices[id(ranks)] = (ranks, at)  # the array kept: its id stays its own
        return at

    def _ends(self, ids: np.ndarray) -> np.ndarray:
        """[n] the end of each event `ids` [n] (-inf where -1: none)."""
        b = self._by_ids.get(id(ids))
        if b is not None and self._blocks[b][5] is ids:  # the ids a call returned (kept)
            return self._blocks[b][3]
        valid = ids >= 0
        if not valid.any():
            return np.full(ids.shape, -np.inf)
        lo, hi = int(ids[valid].min()), int(ids[valid].max())
        b = bisect.bisect_right(self._firsts, lo) - 1
        first, end = self._firsts[b], self._blocks[b][3]
        if hi < first + end.size:  # one block's (a pass's events, as the pipeline asks)
            return np.where(valid, end[np.where(valid, ids - first, 0)], -np.inf)
        ends = np.concatenate([blk[3] for blk in self._blocks])
        return np.where(valid, ends[np.maximum(ids, 0)], -np.inf)

    def sync(self, ranks, groups, phase: str, seconds) -> np.ndarray:
        """A collective: ranks [n] in groups [n] (group ids) each wait for their group's last
        arrival, then all spend `seconds` ([n] or a scalar; a collective's time, the same for a
        group's members)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        groups = np.asarray(groups, dtype=np.int64)
        order = np.lexsort((-self.clock[ranks], groups))  # per group, the latest first
        first = np.ones(order.size, dtype=bool)
        first[1:] = groups[order][1:] != groups[order][:-1]
        lo = int(groups.min()) if groups.size else 0  # group ids index a table from here
        straggler = np.zeros(int(groups.max()) - lo + 1 if groups.size else 0, dtype=np.int64)
        straggler[groups[order][first] - lo] = ranks[order][first]  # [groups] each one's last
        after = self.last[straggler[groups - lo]]
        return self.run(ranks, phase, seconds, COMM, after)

    def _phase(self, phase: str) -> int:
        k = self._phase_ids.get(phase)
        if k is None:
            k = self._phase_ids[phase] = len(self.phases)
            self.phases.append(phase)
        return k

    @property
    def step_time(self) -> float:
        return float(self.clock.max())

    def _event(self, e: int) -> tuple[int, int, float, int]:
        """(rank, phase, seconds, predecessor) of event e."""
        b = bisect.bisect_right(self._firsts, e) - 1
        ranks, phase, start, end, prev, _ = self._blocks[b]
        k = e - self._firsts[b]
        return int(ranks[k]), phase, float(end[k] - start[k]), int(prev[k])

    def critical_path(self) -> list[dict]:
        """The chain of events the step's end waited on, merged into runs of one (rank, phase),
        first to last: [{rank, phase, seconds}]."""
        if not self._count:
            return []
        event = int(np.argmax(np.concatenate([blk[3] for blk in self._blocks])))
        chain = []
        while event >= 0:
            rank, phase, seconds, prev = self._event(event)
            chain.append((rank, phase, seconds))
            event = prev
        out: list[dict] = []
        for rank, phase, seconds in reversed(chain):
            phase = self.phases[phase]
            if out and out[-1]["rank"] == rank and out[-1]["phase"] == phase:
                out[-1]["seconds"] += seconds
            else:
                out.append({"rank": rank, "phase": phase, "seconds": seconds})
        return out
