"""The loader's planning on simulated ranks: each reorder group's samples go through the same
assignment the loaders compute (`ds_omni.data.reorder`: loader order, the fixed-count LPT, the
budget planner; per-sequence SP blocks from `ds_omni.parallel.hdp` inside them), without a
process group: every group is one call.

The global batch is read in loader order first (data-parallel rank r reads the r-th contiguous
share), as the loaders' readers do; a group of G consecutive data-parallel ranks then plans the
samples its members read.

Dims: N samples of the global batch, DP data-parallel ranks, G ranks of a reorder group, M
micro-batches per rank, R long-sequence rounds of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_omni.data import reorder
from ds_omni.errors import DataError


@dataclass(frozen=True)
class Round:
    """What one data-parallel rank runs in one round: a packed micro-batch of whole samples, or
    its block's long sequence (`block`: first data-parallel rank and size), or nothing."""

    samples: np.ndarray
    """Global sample indices of the row (a block's one sequence; empty: a zero-weight filler)."""
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class StepAssignment:
    rounds: list[list[Round]]
    """[DP][M + R] each data-parallel rank's rounds: its M micro-batches, then R long rounds."""
    planned: np.ndarray
    """Sample indices the step trains (budget mode may leave some for the next step)."""


def read_shares(n: int, dp: int) -> list[np.ndarray]:
    """[DP] the sample indices each data-parallel rank reads (contiguous, loader order)."""
    return np.array_split(np.arange(n), dp)


def plan_step(cost: np.ndarray, tokens: np.ndarray, dp: int, group: int, num_micro: int,
              mode: str, pack_tokens: int, max_degree: int = 1) -> StepAssignment:
    """Every data-parallel rank's rounds for one step of N samples (cost [N], tokens [N])."""
    if mode not in ("loader_order", "fixed", "budget"):
        raise DataError(f"unknown reorder mode {mode!r}; choose loader_order, fixed or budget")
    if mode == "loader_order" and len(cost) % dp:
        raise DataError(f"loader order gives each of the {dp} data-parallel ranks an equal share: "
                        f"the global batch of {len(cost)} samples must divide by {dp}")
    shares = read_shares(len(cost), dp)
    rounds: list[list[Round]] = []
    planned = []
    for start in range(0, dp, group):
        idx = np.concatenate(shares[start:start + group])  # [N_g] the group's samples
        assignment = _assign(cost[idx], tokens[idx], group, num_micro, mode, pack_tokens,
                             max_degree)
        planned.append(idx[assignment.planned])
        members, longs = _members(assignment.a, idx[assignment.take]), _rounds(assignment.a)
        for g in range(group):
            micro = [Round(m) for m in members[g]]
            long = [Round(np.zeros(0, np.int64)) if i is None else
                    Round(idx[assignment.take[[i]]], _block(assignment.a.blocks[i], start))
                    for i in longs[g]]
            rounds.append(micro + long)
    width = max(len(r) for r in rounds)  # every rank runs as many rounds (ZeRO's collectives)
    for r in rounds:
        r += [Round(np.zeros(0, np.int64))] * (width - len(r))
    return StepAssignment(rounds, np.sort(np.concatenate(planned)))


def _members(a: reorder.Assignment, values: np.ndarray) -> list[list[np.ndarray]]:
    """[G][M] `values[a.members(g)]` of every rank g at once (one stable sort and one
    gather, not a scan a rank; views of one array)."""
    normal = np.ones(a.rank.size, dtype=bool)
    normal[list(a.blocks)] = False
    mine = np.flatnonzero(normal)  # ascending: a cell's samples stay in index order
    cell = a.rank[mine] * a.num_micro + a.micro[mine]
    order = np.argsort(cell, kind="stable")
    bounds = np.searchsorted(cell[order], np.arange(a.num_ranks * a.num_micro + 1))
    picked = values[mine[order]]
    return [[picked[bounds[c]:bounds[c + 1]] for c in range(g * a.num_micro, (g + 1) * a.num_micro)]
            for g in range(a.num_ranks)]


def _rounds(a: reorder.Assignment) -> list[list[int | None]]:
    """[G][R] `a.rounds(g)` of every rank g at once (each block once, not once a rank)."""
    n_rounds = 1 + max((b.round for b in a.blocks.values()), default=-1)
    out: list[list[int | None]] = [[None] * n_rounds for _ in range(a.num_ranks)]
    for i, b in a.blocks.items():
        for r in range(max(0, b.start), min(a.num_ranks, b.start + b.size)):
            out[r][b.round] = i
    return out


def _block(b, group_start: int) -> tuple[int, int]:
    return (group_start + b.start, b.size)


@dataclass(frozen=True)
class _GroupAssignment:
    a: reorder.Assignment
    take: np.ndarray  # [n] group sample index of each of the assignment's samples
    planned: np.ndarray  # group sample indices the step trains


def _assign(cost, tokens, group, num_micro, mode, pack_tokens, max_degree) -> _GroupAssignment:
    everything = np.arange(len(cost))
    if mode == "loader_order":
        return _GroupAssignment(reorder.loader_order(len(cost), group, num_micro), everything,
                                everything)
    if mode == "fixed":
        return _GroupAssignment(reorder.assign_fixed(cost, tokens, group, num_micro, pack_tokens,
                                                     max_degree), everything, everything)
    planner = reorder.BudgetPlanner(group, num_micro, lookahead=1.0)
    planner.add(list(range(len(cost))), cost, tokens)
    budget = reorder.rank_budget(cost, len(cost) / group)
    plan = planner.plan(budget, pack_tokens, max_degree)
    take = np.asarray(plan.keys, dtype=np.int64)
    return _GroupAssignment(plan.assignment, take, take)
