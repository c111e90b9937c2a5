"""The loader's second phase: plan the step over the reorder group.

The G ranks of the group all-gather only the measurements of the samples they read
(`sample_reader.Measured`) and each computes the same assignment of the group's samples to ranks
and micro-batches (`reorder.py`): in "fixed" mode the group's share of a fixed-size global batch
is balanced, in "budget" mode every rank is filled to one cost budget from a lookahead buffer the
group shares. Per-sequence SP places the step's long sequences on blocks of the group's ranks, in
rounds.
"""

from __future__ import annotations

import numpy as np

from ds_omni.config import ReorderConfig
from ds_omni.data import reorder
from ds_omni.data.rank_place import DataComm, RankPlace
from ds_omni.data.sample_reader import Measured, SampleReader


class StepPlanner:
    """Which of the group's samples this rank trains in a step, per micro-batch. `comm`: the
    all-gathers of the step (the reorder group's and the world's)."""

    def __init__(self, reader: SampleReader, comm: DataComm, cfg: ReorderConfig, place: RankPlace,
                 *, group_size: int, samples_per_rank: int, pack_tokens: int, max_degree: int):
        self.reader, self.comm, self.mode = reader, comm, cfg.mode
        self.dp_rank, self.num_micro = place.dp_rank, place.num_micro
        self.group_size, self.group_rank = group_size, place.dp_rank % group_size
        self.samples_per_rank, self.pack_tokens = samples_per_rank, pack_tokens
        self.max_degree = max_degree  # per-sequence SP: blocks of up to this many ranks
        self.budget_planner = (reorder.BudgetPlanner(group_size, place.num_micro,
                                                     max_wait=cfg.max_wait,
                                                     lookahead=cfg.lookahead)
                               if self.mode == "budget" else None)
        self.cost_budget = cfg.cost_budget

    def plan(self, step: int) -> tuple[list[list[str]], dict]:
        """This rank's keys per micro-batch, and the step's stats ("costs" of the group's samples
        and per-sequence SP "rounds" among them)."""
        return self._plan_budget(step) if self.mode == "budget" else self._plan_fixed(step)

    def _plan_fixed(self, step: int) -> tuple[list[list[str]], dict]:
        local = self.reader.read(self.samples_per_rank, step)
        group = [m for part in self.comm.group_all_gather(local) for m in part]
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
        self.reader.forget({m.key for m in local} - {k for mb in mine for k in mb} -
                           {r[0] for r in rounds if r})
        return mine, {"costs": {m.key: m.cost for m in group}, "rounds": rounds}

    def _plan_budget(self, step: int) -> tuple[list[list[str]], dict]:
        if self.cost_budget is None:
            self.cost_budget = self._first_budget(step)
        while self.budget_planner.wants_more(self.cost_budget):
            new = [m for part in self.comm.group_all_gather(
                self.reader.read(max(1, self.samples_per_rank // 2), step)) for m in part]
            if not new:  # the whole group ran dry (or hit a problem): plan what is buffered
                break
            self._buffer(new)
        plan = self.budget_planner.plan(self.cost_budget, self.pack_tokens, self.max_degree)
        costs = dict(zip(plan.keys, plan.cost.tolist()))
        mine = plan.micro_keys(self.group_rank)
        rounds = self._rounds(plan.assignment, plan.keys)
        self.reader.forget(set(plan.keys) - {k for mb in mine for k in mb} -
                           {r[0] for r in rounds if r})
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

    def _first_budget(self, step: int) -> float:
        """Mean modelled cost of a first read on every rank x samples per rank: the same number on
        every rank of every group (the reads go into the buffer)."""
        first = self.reader.read(self.samples_per_rank, step)
        self._buffer([m for part in self.comm.group_all_gather(first) for m in part])
        everyone = [c for part in self.comm.world_all_gather([m.cost for m in first])
                    for c in part]
        return reorder.rank_budget(np.array(everyone), self.samples_per_rank)

    def _buffer(self, measured: list[Measured]) -> None:
        self.budget_planner.add([m.key for m in measured], np.array([m.cost for m in measured]),
                                np.array([m.tokens for m in measured], dtype=np.int64))

    def state(self) -> dict | None:
        """The group's buffer (budget mode; None otherwise)."""
        return self.budget_planner.state_dict() if self.budget_planner else None
