"""The loader's state: JSON, versioned, one file for the whole run.

It holds every rank's cursors and mixer, and each group's buffer; it is gathered to a single file,
records the data-parallel size, and resumes under another one (elastic): unread chunk pieces and
buffered samples are spread over the new ranks, so no sample is lost or read twice. A step that
was interrupted was never recorded, so its samples are read again. A *position* is one rank's
part of it, kept in memory to go back to (`rewind`, the prefetcher's steps taken).
"""

from __future__ import annotations

import copy

from ds_omni.config import DataConfig
from ds_omni.data import reorder
from ds_omni.data.mixer import MixSchedule
from ds_omni.data.rank_place import DataComm, RankPlace
from ds_omni.data.sample_reader import SampleReader
from ds_omni.data.step_plan import StepPlanner
from ds_omni.data.stream import redistribute
from ds_omni.errors import DataError

LOADER_STATE_VERSION = 2


class LoaderState:
    """Saves and restores what the reader and the planner of one rank hold (`comm`: the
    all-gathers of the whole-run state)."""

    def __init__(self, reader: SampleReader, planner: StepPlanner, schedule: MixSchedule,
                 cfg: DataConfig, place: RankPlace, comm: DataComm):
        self.reader, self.planner, self.schedule = reader, planner, schedule
        self.cfg, self.comm = cfg, comm
        self.dp_rank, self.dp_size, self.num_micro = place.dp_rank, place.dp_size, place.num_micro

    def position(self, step: int) -> dict:
        """A copy of this rank's data position at loader step `step` (what `restore` goes back
        to)."""
        return copy.deepcopy({"step": step, "cost_budget": self.planner.cost_budget,
                              "local": self.reader.local_state(),
                              "planner": self.planner.state()})

    def restore(self, position: dict) -> int:
        """Go back (or forward) to a position `position` returned; its step."""
        reader, budget_planner = self.reader, self.planner.budget_planner
        self.planner.cost_budget = position["cost_budget"]
        reader.cursors = reader.make_cursors()
        for name, cursor in reader.cursors.items():
            cursor.load_state_dict(position["local"]["cursors"][name])
        reader.mixer.load_state_dict(copy.deepcopy(position["local"]["mixer"]))
        reader.skipped = dict(position["local"]["skipped"])
        if budget_planner is not None:
            budget_planner.load_state_dict(copy.deepcopy(position["planner"]))
        reader.rows, reader.skip_log = {}, []
        return position["step"]

    def state_dict(self, position: dict) -> dict:
        """The whole run's data state at every rank's `position` (call on every rank; every rank
        gets the same dict)."""
        planner = self.planner
        ranks = self.comm.world_all_gather(position["local"])
        planners = self.comm.world_all_gather(
            position["planner"] if planner.budget_planner is not None and planner.group_rank == 0
            else None)
        return {"version": LOADER_STATE_VERSION, "dp_size": self.dp_size,
                "group_size": planner.group_size, "mode": planner.mode, "step": position["step"],
                "seed": self.cfg.seed, "schedule": self.schedule.state_dict(),
                "cost_budget": position["cost_budget"], "ranks": ranks,
                "groups": [p for p in planners if p is not None]}

    def load_state_dict(self, state: dict) -> int:
        """Resume from a whole-run `state`, under this or another data-parallel size; its step."""
        self._check_state(state)
        reader = self.reader
        self.schedule.load_state_dict(state["schedule"])
        self.planner.cost_budget = state["cost_budget"] if self.cfg.reorder.cost_budget is None \
            else self.cfg.reorder.cost_budget
        old = state["ranks"]
        for name, source in reader.sources.items():  # the chunks the state counts in
            source.set_chunk_rows(old[0]["chunk_rows"][name])
        reader.cursors = reader.make_cursors()
        for name, cursor in reader.cursors.items():
            olds = [r["cursors"][name] for r in old]
            if state["dp_size"] == self.dp_size:
                cursor.load_state_dict(olds[self.dp_rank])
            else:
                source = reader.sources[name]
                cursor.load_state_dict(redistribute(olds, self.dp_size, source.chunks,
                                                    self.cfg.seed, cursor.index)[self.dp_rank])
        same = state["dp_size"] == self.dp_size
        if same:
            reader.mixer.load_state_dict(old[self.dp_rank]["mixer"])
        else:  # credits are per rank and under one slot each: start them afresh; keep drops
            reader.mixer.dropped = set().union(*(r["mixer"]["dropped"] for r in old))
        reader.skipped = {n: sum(r["skipped"].get(n, 0) for r in old) if not same else
                          old[self.dp_rank]["skipped"].get(n, 0) for n in reader.sources}
        if self.planner.budget_planner is not None:
            self.planner.budget_planner.load_state_dict(self._group_buffer(state))
        reader.rows = {}
        return state["step"]

    def _check_state(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise DataError(f"loader state version {state.get('version')} is not supported "
                            f"(this ds_omni reads version {LOADER_STATE_VERSION})")
        missing = sorted(set(self.reader.sources) - set(state["ranks"][0]["cursors"]))
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
        group_size = self.planner.group_size
        n_groups = self.dp_size // group_size
        mine = self.dp_rank // group_size
        if state["dp_size"] == self.dp_size and state["group_size"] == group_size:
            return groups[mine]
        if not groups:
            return reorder.BudgetPlanner(group_size, self.num_micro).state_dict()
        step = max(g["step"] for g in groups)
        pooled = [(a - g["step"] + step, k, c, t) for g in groups for k, c, t, a in zip(
            g["buffer"]["keys"], g["buffer"]["cost"], g["buffer"]["tokens"], g["buffer"]["arrived"])]
        pooled.sort()
        share = pooled[mine::n_groups]
        base = groups[0]
        return {**base, "num_ranks": group_size, "step": step,
                "buffer": {"keys": [k for _, k, _, _ in share], "cost": [c for _, _, c, _ in share],
                           "tokens": [t for _, _, _, t in share],
                           "arrived": [a for a, _, _, _ in share]}}
