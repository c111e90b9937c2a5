"""Deterministic assignment of one group's samples to its G ranks and their M micro-batches.

The ranks of a group gather only the samples' metadata (cost, tokens, key) and each runs the same
pure function, so all compute the same assignment; the collectives live with the loader.
- fixed count (`assign_fixed`): a fixed-size global batch's samples moved between the group's
  ranks and micro-batches; evens cost inside the group, not between groups;
- budget (`BudgetPlanner`): every rank filled to one cost budget (each micro-batch to a token
  budget) from a lookahead buffer; a sample waits at most `max_wait` steps; one costlier than a
  rank's budget is an outlier, planned alone and reported.
Both use LPT (`ds_omni.data.lpt`): decreasing cost onto the least-loaded rank with token room,
then its least-loaded micro-batch; ties to the lower index, so the answer depends only on the
input. More: docs/data.md, "Several sources".

Dims: N samples, G ranks of the group, M micro-batches per rank, B samples in the budget buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ds_omni.data.lpt import Packer, lpt_order
from ds_omni.errors import DataError
from ds_omni.parallel.hdp import Block, assign_rounds, place_blocks, rank_rounds

BUDGET_STATE_VERSION = 1


# ------------------------------------------------------------------------------ assignment
@dataclass
class Assignment:
    """Where each sample of a group goes: a rank of the group and a micro-batch on that rank."""

    rank: np.ndarray
    """[N] int64 rank within the group, in [0, num_ranks)."""
    micro: np.ndarray
    """[N] int64 micro-batch on that rank, in [0, num_micro)."""
    num_ranks: int
    """G: ranks in the group."""
    num_micro: int
    """M: micro-batches per rank."""
    blocks: dict[int, Block] = field(default_factory=dict)
    """Per-sequence SP (`parallel.hdp`): sample -> the block of ranks running it alone; its `rank`
    is the block's start, its `micro` 0, and it is in no rank's `members`."""

    def __post_init__(self):
        self.rank = np.asarray(self.rank, dtype=np.int64)
        self.micro = np.asarray(self.micro, dtype=np.int64)
        if self.rank.shape != self.micro.shape:
            raise ValueError(f"rank {self.rank.shape} and micro {self.micro.shape} differ in shape")
        if self.rank.size and not (0 <= self.rank.min() and self.rank.max() < self.num_ranks
                                   and 0 <= self.micro.min() and self.micro.max() < self.num_micro):
            raise ValueError(f"assignment out of range: ranks must be in [0, {self.num_ranks}), "
                             f"micro-batches in [0, {self.num_micro})")

    def _normal(self) -> np.ndarray:
        """[N] bool: the sample runs whole on one rank (not in a block)."""
        normal = np.ones(self.rank.size, dtype=bool)
        normal[list(self.blocks)] = False
        return normal

    def rank_sums(self, values: np.ndarray) -> np.ndarray:
        """[G] sum of per-sample `values` [N] on each rank; a block's sample splits evenly."""
        values = np.asarray(values, dtype=np.float64)
        normal = self._normal()
        sums = np.bincount(self.rank[normal], weights=values[normal],
                           minlength=self.num_ranks).astype(np.float64)  # (empty weights: ints)
        for i, b in self.blocks.items():
            sums[b.start:b.start + b.size] += values[i] / b.size
        return sums

    def micro_sums(self, values: np.ndarray) -> np.ndarray:
        """[G, M] sum of per-sample `values` [N] in each of the M packed micro-batches (samples
        in blocks run in micro-batches of their own and are left out)."""
        normal = self._normal()
        flat = self.rank[normal] * self.num_micro + self.micro[normal]  # [N normal]
        sums = np.bincount(flat, weights=np.asarray(values, dtype=np.float64)[normal],
                           minlength=self.num_ranks * self.num_micro)
        return sums.reshape(self.num_ranks, self.num_micro)  # [G*M] -> [G, M]

    def rounds(self, rank: int) -> list[int | None]:
        """The block sample `rank` runs in each long-sequence round (None: an empty one)."""
        return rank_rounds(self.blocks, rank)

    def members(self, rank: int) -> list[np.ndarray]:
        """Sample indices (ascending) in each of `rank`'s M packed micro-batches."""
        mine = np.flatnonzero((self.rank == rank) & self._normal())
        return [mine[self.micro[mine] == m] for m in range(self.num_micro)]


def loader_order(n: int, num_ranks: int, num_micro: int) -> Assignment:
    """Baseline: rank r takes the r-th contiguous block of n/G samples, split in order into M parts."""
    if n % num_ranks:
        raise ValueError(f"loader order needs the {n} samples to divide evenly over {num_ranks} ranks")
    per_rank = n // num_ranks
    idx = np.arange(n)
    return Assignment(idx // per_rank, (idx % per_rank) * num_micro // per_rank, num_ranks, num_micro)


def _check_arrays(cost: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cost = np.asarray(cost, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if cost.ndim != 1 or cost.shape != tokens.shape:
        raise ValueError(f"cost and tokens must be 1-D of equal length, got {cost.shape} and "
                         f"{tokens.shape}")
    if cost.size and (not np.isfinite(cost).all() or cost.min() < 0 or tokens.min() < 0):
        raise DataError("sample costs must be finite and >= 0 and token counts >= 0; check the "
                        "metadata the cost model was given")
    return cost, tokens


# ------------------------------------------------------------------------------ fixed count
def assign_fixed(cost: np.ndarray, tokens: np.ndarray, num_ranks: int, num_micro: int,
                 max_tokens_per_micro: int | None = None, max_degree: int = 1) -> Assignment:
    """Balanced assignment of all N samples (cost [N], tokens [N]) of a group to G ranks x M micros.

    LPT on ranks, then on micro-batches within the rank; each micro-batch holds at most
    `max_tokens_per_micro` tokens. With `max_degree` > 1 (per-sequence SP), a sample costlier
    than the group's mean rank load, or longer than a micro-batch, runs on a block of up to
    `max_degree` ranks first (`ds_omni.parallel.hdp`). The answer follows the samples, not their order: permuting the
    input permutes the output alike (ties in cost and tokens go to the lower index).
    """
    cost, tokens = _check_arrays(cost, tokens)
    cap = math.inf if max_tokens_per_micro is None else max_tokens_per_micro
    packer = Packer(num_ranks, num_micro, cap)
    rank = np.zeros(cost.size, dtype=np.int64)
    micro = np.zeros(cost.size, dtype=np.int64)
    blocks = _fixed_blocks(cost, tokens, num_ranks, cap, max_degree, packer)
    for i in lpt_order(cost, tokens).tolist():
        if i in blocks:
            rank[i] = blocks[i].start
            continue
        slot = packer.place(float(cost[i]), int(tokens[i]))
        if slot is None:
            raise _no_room(i, tokens, num_ranks, num_micro, cap)
        rank[i], micro[i] = slot
    return Assignment(rank, micro, num_ranks, num_micro, blocks)


def _fixed_blocks(cost: np.ndarray, tokens: np.ndarray, num_ranks: int, cap: float,
                  max_degree: int, packer: Packer) -> dict[int, Block]:
    """Per-sequence SP in fixed-count mode: samples above one rank's mean share of the group's
    cost (or over the token cap) get blocks; the packer starts from the blocks' loads."""
    if max_degree <= 1 or not cost.size:
        return {}
    share = float(cost.sum()) / num_ranks
    long = np.flatnonzero((cost > share) | (tokens > cap))
    loads = np.zeros(num_ranks)
    placed = place_blocks(cost[long], tokens[long], loads, share, cap, max_degree,
                          forced=np.ones(long.size, dtype=bool), limit=share)
    packer.preload(loads)
    return assign_rounds({int(long[j]): b for j, b in placed.items()})


def _no_room(i: int, tokens: np.ndarray, g: int, m: int, cap: float) -> DataError:
    if tokens[i] > cap:
        return DataError(f"sample {i} has {tokens[i]} tokens, more than max_tokens_per_micro={cap}; "
                         "raise the micro-batch token capacity (data.max_seq_len) or truncate it")
    return DataError(f"no micro-batch has room for sample {i} ({tokens[i]} tokens): the group's "
                     f"{tokens.size} samples hold {int(tokens.sum())} tokens for {g} ranks x {m} "
                     f"micro-batches x {cap} tokens; raise max_tokens_per_micro or the number of "
                     "micro-batches, or lower the global batch size")


# ---------------------------------------------------------------------------------- budget
def rank_budget(cost: np.ndarray, samples_per_rank: float) -> float:
    """Per-rank cost budget whose expected samples per step match a fixed-count run.

    `cost` [N] is a sample of the workload (e.g. the last few global batches); the budget is its mean
    cost times the samples a rank would get in fixed-count mode. Budget mode fills ranks a little
    below the budget, so it takes slightly fewer samples per step.
    """
    cost = np.asarray(cost, dtype=np.float64)
    if cost.size == 0 or samples_per_rank <= 0:
        raise ValueError(f"rank_budget needs sample costs and samples_per_rank > 0, got {cost.size} "
                         f"costs and samples_per_rank={samples_per_rank}")
    return float(cost.mean() * samples_per_rank)


@dataclass
class BudgetPlan:
    """One step's plan for a group in budget mode (the same on every rank of the group)."""

    step: int
    """Planner step this plan was made at (0-based)."""
    keys: list
    """[n] keys of the planned samples, by (rank, micro-batch, arrival)."""
    assignment: Assignment
    """[n] rank and micro-batch of each planned sample."""
    cost: np.ndarray
    """[n] modelled cost of each planned sample."""
    tokens: np.ndarray
    """[n] tokens of each planned sample."""
    delay: np.ndarray
    """[n] steps each planned sample waited in the buffer (0: planned the step it arrived)."""
    outliers: list
    """Keys costlier than one rank's budget, each planned alone on a rank."""
    forced: list
    """Keys planned because they had waited max_wait steps."""

    def micro_keys(self, rank: int) -> list[list]:
        """Keys of each of `rank`'s M micro-batches."""
        return [[self.keys[i] for i in idx] for idx in self.assignment.members(rank)]

    def round_keys(self, rank: int) -> list:
        """Key of the long sequence `rank` runs in each round, None for an empty round."""
        return [None if i is None else self.keys[i] for i in self.assignment.rounds(rank)]


class BudgetPlanner:
    """A group's lookahead buffer and its budget-mode plans; plain-data state.

    Per step: the loader adds samples while `wants_more` (the buffer holds `lookahead` steps of
    budget), then `plan` fills each of the G ranks up to `cost_budget` and each of their M
    micro-batches up to `token_budget` tokens. Order of preference: samples that waited `max_wait`
    steps (forced, even past the budget), outliers (one per rank), then the oldest samples placed by
    LPT, then younger small samples that fill the remaining gaps. Nothing is dropped or duplicated.
    Delay grows with `lookahead` (about lookahead - 1 steps on average); fill improves with it.
    """

    def __init__(self, num_ranks: int, num_micro: int, *, max_wait: int = 2,
                 lookahead: float = 1.5):
        if num_ranks < 1 or num_micro < 1 or max_wait < 0 or lookahead < 1:
            raise ValueError(f"BudgetPlanner needs num_ranks >= 1, num_micro >= 1, max_wait >= 0, "
                             f"lookahead >= 1; got {num_ranks}, {num_micro}, {max_wait}, {lookahead}")
        self.num_ranks, self.num_micro = num_ranks, num_micro
        self.max_wait, self.lookahead = max_wait, lookahead
        self.step = 0
        self._keys: list = []  # in arrival order: position in the buffer is the age order
        self._key_set: set = set()
        self._cost = np.zeros(0)  # [B]
        self._tokens = np.zeros(0, dtype=np.int64)  # [B]
        self._arrived = np.zeros(0, dtype=np.int64)  # [B] step it was added at
        self._delay_hist = [0] * (max_wait + 1)  # planned samples per delay in steps
        self._outliers = 0

    # ------------------------------------------------------------------------------ buffer
    def __len__(self) -> int:
        return len(self._keys)

    @property
    def buffered_cost(self) -> float:
        return float(self._cost.sum())

    def wants_more(self, cost_budget: float) -> bool:
        """True while the buffer holds less than `lookahead` steps of the group's budget."""
        return self.buffered_cost < self.lookahead * self.num_ranks * cost_budget

    def add(self, keys: list, cost: np.ndarray, tokens: np.ndarray) -> None:
        """Buffer new samples; within one call their order does not matter (sorted by key)."""
        cost, tokens = _check_arrays(cost, tokens)
        if len(keys) != cost.size:
            raise ValueError(f"add() got {len(keys)} keys for {cost.size} costs")
        _check_keys(keys, self._key_set)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self._keys += [keys[i] for i in order]
        self._key_set.update(keys)
        n = len(keys)
        self._cost = np.concatenate([self._cost, cost[order]])
        self._tokens = np.concatenate([self._tokens, tokens[order]])
        self._arrived = np.concatenate([self._arrived, np.full(n, self.step, dtype=np.int64)])

    # -------------------------------------------------------------------------------- plan
    def plan(self, cost_budget: float, token_budget: int, max_degree: int = 1) -> BudgetPlan:
        """Fill each rank to `cost_budget` and each micro-batch to `token_budget` tokens.

        With `max_degree` > 1 (per-sequence SP), outliers (costlier than `cost_budget` or longer
        than `token_budget`) run on blocks of ranks (`ds_omni.parallel.hdp`) instead of alone on
        one rank; the block ranks' remaining room is filled with normal samples like any other.
        """
        if not cost_budget > 0 or token_budget < 1:
            raise ValueError(f"plan() needs cost_budget > 0 and token_budget >= 1, got {cost_budget} "
                             f"and {token_budget}")
        forced = (self.step - self._arrived) >= self.max_wait  # [B]
        packer = Packer(self.num_ranks, self.num_micro, token_budget)
        slots: dict[int, tuple[int, int]] = {}
        if max_degree > 1:
            outlier = (self._cost > cost_budget) | (self._tokens > token_budget)  # [B]
            # what must go this step first (forced blocks, then forced normal samples), so the
            # blocks that may wait take only the room left
            blocks = self._place_blocks(packer, outlier & forced, cost_budget, token_budget,
                                        max_degree)
            self._place_forced(packer, slots, ~outlier & forced)
            blocks |= self._place_blocks(packer, outlier & ~forced, cost_budget, token_budget,
                                         max_degree)
            blocks = assign_rounds(blocks)
        else:
            self._check_tokens(token_budget)
            outlier, blocks = self._cost > cost_budget, {}  # [B]
            self._place_outliers(packer, slots, outlier, forced, bool((forced & ~outlier).any()))
        self._place_normal(packer, slots, ~outlier, forced, cost_budget)
        return self._commit(slots, outlier, forced, blocks)

    def _place_blocks(self, packer: Packer, which: np.ndarray, cost_budget: float,
                      token_budget: int, max_degree: int) -> dict[int, tuple[int, int]]:
        """{buffer index: (start, size)} for the outliers `which` [B] that fit this step; forced
        ones always go. Their shares join the packer's rank loads."""
        idx = np.flatnonzero(which)
        loads = np.array(packer.rank_cost)
        placed = place_blocks(self._cost[idx], self._tokens[idx], loads, cost_budget, token_budget,
                              max_degree, forced=self.step - self._arrived[idx] >= self.max_wait,
                              limit=cost_budget)
        packer.preload(loads)
        return {int(idx[j]): b for j, b in placed.items()}

    def _check_tokens(self, token_budget: int) -> None:
        too_long = np.flatnonzero(self._tokens > token_budget)
        if too_long.size:
            bad = [(self._keys[i], int(self._tokens[i])) for i in too_long[:5]]
            raise DataError(f"sample(s) (key, tokens) {bad} exceed the token budget {token_budget} of "
                            "a micro-batch; raise it (data.max_seq_len) or truncate them")

    def _place_outliers(self, packer: Packer, slots: dict, outlier: np.ndarray,
                        forced: np.ndarray, has_forced_normal: bool) -> None:
        """Each outlier alone on a rank; keep one rank for forced normal samples if possible."""
        idx = np.flatnonzero(outlier)
        idx = idx[np.lexsort((idx, ~forced[idx]))]  # forced first, then oldest
        room = self.num_ranks - (1 if has_forced_normal else 0)
        take = max(room, int(forced[idx].sum()))  # forced outliers go even if they must share
        for j, i in enumerate(idx[:take].tolist()):
            r, tokens = j % self.num_ranks, int(self._tokens[i])
            m = packer.micro_with_room(r, tokens)
            if m is None:  # only when more than G forced outliers share ranks
                raise DataError(f"outlier {self._keys[i]!r} waited {self.max_wait} steps and finds "
                                "no token room: more outliers than ranks; raise max_wait or the "
                                "group size")
            slots[i] = packer.put(r, m, float(self._cost[i]), tokens)
            if j < self.num_ranks:
                packer.close(r)

    def _place_normal(self, packer: Packer, slots: dict, normal: np.ndarray, forced: np.ndarray,
                      cost_budget: float) -> None:
        cost, tokens = self._cost.tolist(), self._tokens.tolist()
        self._place_forced(packer, slots, normal & forced)
        rest = np.flatnonzero(normal & ~forced)  # oldest first
        open_budget = cost_budget * len(packer.heap) - sum(packer.rank_cost[r] for _, r in packer.heap)
        head = rest[np.cumsum(self._cost[rest]) <= open_budget]  # the oldest that fit in total
        for i in head[lpt_order(self._cost[head], self._tokens[head])].tolist():
            if slot := packer.place(cost[i], tokens[i], limit=cost_budget):
                slots[i] = slot
        self._top_up(packer, slots, rest, cost, tokens, cost_budget)

    def _place_forced(self, packer: Packer, slots: dict, which: np.ndarray) -> None:
        """Samples `which` [B] that waited max_wait steps: LPT, past the budget if need be."""
        cost, tokens = self._cost.tolist(), self._tokens.tolist()
        must = np.array([i for i in np.flatnonzero(which).tolist() if i not in slots], dtype=np.int64)
        for i in must[lpt_order(self._cost[must], self._tokens[must])].tolist():
            slot = packer.place(cost[i], tokens[i]) or packer.place_anywhere(cost[i], tokens[i])
            if slot is None:
                raise DataError(f"sample {self._keys[i]!r} has waited {self.max_wait} steps but no "
                                "micro-batch has token room for it; raise the token budget or the "
                                "number of micro-batches, or lower the lookahead")
            slots[i] = slot

    def _top_up(self, packer: Packer, slots: dict, rest: np.ndarray, cost: list, tokens: list,
                cost_budget: float) -> None:
        """Oldest-first, fill the ranks' remaining room with samples that still fit."""
        if not packer.heap:
            return
        slack = cost_budget - packer.heap[0][0]  # room on the least-loaded open rank
        for i in rest[self._cost[rest] <= slack].tolist():
            if i not in slots and (slot := packer.place(cost[i], tokens[i], limit=cost_budget)):
                slots[i] = slot

    def _commit(self, slots: dict, outlier: np.ndarray, forced: np.ndarray,
                blocks: dict[int, Block]) -> BudgetPlan:
        slots = slots | {i: (b.start, 0) for i, b in blocks.items()}
        chosen = np.fromiter(slots, dtype=np.int64, count=len(slots))  # [n] buffer indices
        where = np.array(list(slots.values()), dtype=np.int64).reshape(-1, 2)  # [n, (rank, micro)]
        order = np.lexsort((chosen, where[:, 1], where[:, 0]))
        chosen, rank, micro = chosen[order], where[order, 0], where[order, 1]
        delay = self.step - self._arrived[chosen]
        position = dict(zip(chosen.tolist(), range(chosen.size)))  # buffer index -> plan index
        keys = self._keys
        plan = BudgetPlan(
            step=self.step, keys=[keys[i] for i in chosen.tolist()],
            assignment=Assignment(rank, micro, self.num_ranks, self.num_micro,
                                  {position[i]: b for i, b in blocks.items()}),
            cost=self._cost[chosen], tokens=self._tokens[chosen], delay=delay,
            outliers=[keys[i] for i in chosen[outlier[chosen]].tolist()],
            forced=[keys[i] for i in chosen[forced[chosen]].tolist()])
        self._record(delay, len(plan.outliers))
        self._remove(chosen)
        self.step += 1
        return plan

    def _record(self, delay: np.ndarray, outliers: int) -> None:
        counts = np.bincount(delay, minlength=len(self._delay_hist)) if delay.size else []
        self._delay_hist += [0] * (len(counts) - len(self._delay_hist))
        for d, c in enumerate(counts):
            self._delay_hist[d] += int(c)
        self._outliers += outliers

    def _remove(self, chosen: np.ndarray) -> None:
        keep = np.ones(len(self._keys), dtype=bool)
        keep[chosen] = False
        self._key_set.difference_update([self._keys[i] for i in chosen.tolist()])
        self._keys = [k for k, kept in zip(self._keys, keep.tolist()) if kept]
        self._cost, self._tokens = self._cost[keep], self._tokens[keep]
        self._arrived = self._arrived[keep]

    # ------------------------------------------------------------------------------- stats
    def delay_stats(self) -> dict:
        """Planned samples so far: mean and max delay in steps, histogram by delay, outliers."""
        hist = np.asarray(self._delay_hist)
        planned = int(hist.sum())
        return {"planned": planned, "outliers": self._outliers, "histogram": hist.tolist(),
                "mean_delay": float(hist @ np.arange(hist.size) / planned) if planned else 0.0,
                "max_delay": int(np.flatnonzero(hist)[-1]) if planned else 0,
                "buffered": len(self)}

    # ------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Plain JSON: buffer, step and statistics; same state -> same future plans."""
        return {"version": BUDGET_STATE_VERSION, "num_ranks": self.num_ranks,
                "num_micro": self.num_micro, "max_wait": self.max_wait,
                "lookahead": self.lookahead, "step": self.step,
                "buffer": {"keys": list(self._keys), "cost": self._cost.tolist(),
                           "tokens": self._tokens.tolist(), "arrived": self._arrived.tolist()},
                "delay_hist": list(self._delay_hist), "outliers": self._outliers}

    def load_state_dict(self, state: dict) -> None:
        """Resume the buffer, step and statistics written by `state_dict` (same group size)."""
        if state.get("version") != BUDGET_STATE_VERSION:
            raise DataError(f"budget planner state version {state.get('version')} is not supported "
                            f"(expected {BUDGET_STATE_VERSION})")
        if state["num_ranks"] != self.num_ranks:
            raise DataError(f"budget planner state was written for groups of {state['num_ranks']} "
                            f"ranks, this planner has {self.num_ranks}; keep the group size on "
                            "resume or start the new groups with empty buffers")
        self.step = state["step"]  # num_micro, max_wait and lookahead stay as configured now
        buf = state["buffer"]
        self._keys = list(buf["keys"])
        self._key_set = set(self._keys)
        self._cost = np.asarray(buf["cost"], dtype=np.float64)
        self._tokens = np.asarray(buf["tokens"], dtype=np.int64)
        self._arrived = np.asarray(buf["arrived"], dtype=np.int64)
        self._delay_hist, self._outliers = list(state["delay_hist"]), state["outliers"]


def _check_keys(keys: list, buffered: set) -> None:
    kinds = {type(k) for k in keys}
    if not kinds <= {str, int} or len(kinds) > 1:
        raise DataError(f"sample keys must all be str or all be int (JSON-able, sortable); got types "
                        f"{sorted(t.__name__ for t in kinds)}")
    if len(set(keys)) != len(keys):
        raise DataError("add() got the same key twice in one call; keys must identify samples")
    again = buffered.intersection(keys)
    if again:
        raise DataError(f"key(s) {sorted(again)[:5]} are already in the buffer; a sample may be "
                        "added only once until it is planned")
