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
        # [E] each event's rank, phase, start, end and predecessor, in buffers that double
        # when full (appending by concatenation copied every event on every call: quadratic
        # in the events of a 1,024-rank step)
        self._cols = {k: np.zeros(1024, dtype=np.int64 if k in ("rank", "phase", "prev")
                                  else np.float64)
                      for k in ("rank", "phase", "start", "end", "prev")}
        self._count = 0

    def run(self, ranks, phase: str, seconds, kind: int = COMPUTE, after=None) -> np.ndarray:
        """Run `phase` on `ranks` [n] for `seconds` ([n] or a scalar), each no earlier than the
        end of its event `after` [n] (-1: none). Returns the new events' ids [n]."""
        ranks = np.asarray(ranks, dtype=np.int64)
        seconds = np.broadcast_to(np.asarray(seconds, dtype=np.float64), ranks.shape)
        start, prev = self.clock[ranks].copy(), self.last[ranks].copy()
        if after is not None:
            after = np.asarray(after, dtype=np.int64)
            dep_end = np.where(after >= 0, self._cols["end"][np.maximum(after, 0)], -np.inf)
            waits = dep_end > start
            prev = np.where(waits, after, prev)
            start = np.maximum(start, dep_end)
        self.idle[ranks] += start - self.clock[ranks]
        (self.compute if kind == COMPUTE else self.comm)[ranks] += seconds
        end = start + seconds
        ids = np.arange(self._count, self._count + ranks.size)
        self._append(rank=ranks, phase=self._phase(phase), start=start, end=end, prev=prev)
        self.clock[ranks], self.last[ranks] = end, ids
        return ids

    def _append(self, **cols) -> None:
        n = cols["rank"].size
        need = self._count + n
        if need > self._cols["end"].size:
            for k, old in self._cols.items():
                self._cols[k] = np.zeros(max(need, 2 * old.size), dtype=old.dtype)
                self._cols[k][:self._count] = old[:self._count]
        for k, v in cols.items():
            self._cols[k][self._count:need] = v
        self._count = need

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
        if phase not in self.phases:
            self.phases.append(phase)
        return self.phases.index(phase)

    @property
    def step_time(self) -> float:
        return float(self.clock.max())

    def critical_path(self) -> list[dict]:
        """The chain of events the step's end waited on, merged into runs of one (rank, phase),
        first to last: [{rank, phase, seconds}]."""
        if not self._count:
            return []
        col = {k: v[:self._count] for k, v in self._cols.items()}
        event = int(np.argmax(col["end"]))
        chain = []
        while event >= 0:
            chain.append(event)
            event = int(col["prev"][event])
        out: list[dict] = []
        for e in reversed(chain):
            rank, phase = int(col["rank"][e]), self.phases[col["phase"][e]]
            seconds = float(col["end"][e] - col["start"][e])
            if out and out[-1]["rank"] == rank and out[-1]["phase"] == phase:
                out[-1]["seconds"] += seconds
            else:
                out.append({"rank": rank, "phase": phase, "seconds": seconds})
        return out
