"""Greedy least-loaded placement (LPT) of samples onto G ranks x M micro-batches.

The primitive both reordering modes of `ds_omni.data.reorder` build on: samples taken in
`lpt_order` (decreasing cost) go to the least-loaded open rank with token room, then to that
rank's least-loaded micro-batch with room (longest-processing-time first: within 4/3 of the
optimal makespan); ties go to the lower index, so the answer depends only on the input.

Dims: N samples, G ranks, M micro-batches per rank.
"""

from __future__ import annotations

import heapq
import math

import numpy as np


class Packer:
    """Running loads of G ranks x M micro-batches for greedy placement (least-loaded first)."""

    def __init__(self, num_ranks: int, num_micro: int, token_cap: float):
        self.cap = token_cap
        self.rank_cost = [0.0] * num_ranks
        self.micro_cost = [[0.0] * num_micro for _ in range(num_ranks)]
        self.micro_tok = [[0] * num_micro for _ in range(num_ranks)]
        self.heap = [(0.0, r) for r in range(num_ranks)]  # open ranks, (cost, rank): ties -> low rank

    def preload(self, loads: np.ndarray) -> None:
        """Ranks start with `loads` [G] already on them (their shares of long sequences)."""
        self.rank_cost = [float(x) for x in loads]
        self.heap = [(self.rank_cost[r], r) for _, r in self.heap]
        heapq.heapify(self.heap)

    def close(self, rank: int) -> None:
        """Take `rank` out of greedy placement (it holds an outlier)."""
        self.heap = [e for e in self.heap if e[1] != rank]
        heapq.heapify(self.heap)

    def micro_with_room(self, r: int, tokens: int) -> int | None:
        """Least-loaded micro-batch of rank r with room for `tokens` (ties: lowest index)."""
        costs, toks, cap = self.micro_cost[r], self.micro_tok[r], self.cap
        m = costs.index(min(costs))  # the first least-loaded one: usually it has room
        if toks[m] + tokens <= cap:
            return m
        best, best_cost = None, math.inf
        for m, (c, t) in enumerate(zip(costs, toks)):
            if t + tokens <= cap and c < best_cost:
                best, best_cost = m, c
        return best

    def put(self, r: int, m: int, cost: float, tokens: int) -> tuple[int, int]:
        self.rank_cost[r] += cost
        self.micro_cost[r][m] += cost
        self.micro_tok[r][m] += tokens
        return r, m

    def place(self, cost: float, tokens: int, limit: float = math.inf) -> tuple[int, int] | None:
        """Least-loaded open rank with token room, if its load stays <= limit; else None."""
        if not self.heap or self.heap[0][0] + cost > limit:  # the common miss, without a pop
            return None
        skipped, found = [], None
        while self.heap:
            load, r = heapq.heappop(self.heap)
            if load + cost > limit:  # the least-loaded rank with room is too full: all others are
                skipped.append((load, r))
                break
            m = self.micro_with_room(r, tokens)
            if m is None:
                skipped.append((load, r))
                continue
            found = self.put(r, m, cost, tokens)
            heapq.heappush(self.heap, (self.rank_cost[r], r))
            break
        for entry in skipped:
            heapq.heappush(self.heap, entry)
        return found

    def place_anywhere(self, cost: float, tokens: int) -> tuple[int, int] | None:
        """Least-loaded rank of all (open or closed) with token room, ignoring any cost limit."""
        for r in sorted(range(len(self.rank_cost)), key=lambda r: (self.rank_cost[r], r)):
            m = self.micro_with_room(r, tokens)
            if m is not None:
                return self.put(r, m, cost, tokens)
        return None


def lpt_order(cost: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Indices by cost descending, then tokens descending, then index: fully deterministic."""
    return np.lexsort((np.arange(cost.size), -tokens, -cost))
