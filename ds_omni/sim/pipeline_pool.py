"""The encoder pool under a pipeline on simulated ranks (`parallel.encoder_pool` with pp > 1), as
training runs it (`train.step`, `parallelize.pipeline.EncodeShare`): each round planned over one
stage's dp x sp ranks of a TP rank (`encode_sim.round_work`, "pool"), on every stage that
encodes (stage 0 under "stage0", all under "uniform"). Every round's moved inputs, and its rows
(forward and back), are exchanged over the pool: priced before the schedule, where training
places every round. Under "stage0" a rank's encoder FLOPs of a round are the pool's load there;
under "uniform" each pool rank's items of the step are split over its column of stages.

Dims: M micro-batches, D pool ranks (dp x sp), P stages.
"""

from __future__ import annotations

import numpy as np

from ds_omni.sim import encode_sim
from ds_omni.sim.encode_sim import Row, round_work
from ds_omni.sim.timeline import COMM


def pool_long(step) -> bool:
    """Long-short SP inside the pool's rounds: off under "uniform", whose stages encode whole
    items (`data.build.long_items_of`)."""
    return step.plan.long_items and step.plan.encoder_placement == "stage0"


def _rows(step, m: int, folded: bool) -> list[Row]:
    """Round m's rows: each data-parallel rank's over its SP (x TP) ranks of stage 0, global
    ranks (or `folded`: pool ranks, TP left out)."""
    p, rows = step.pplan, []
    for d, rounds in enumerate(step.assignment.rounds):
        samples = rounds[m].samples
        if samples.size:
            ranks = np.arange(d * p.sp, (d + 1) * p.sp) if folded else step.ranks_of(d, 1)
            rows.append(Row(ranks, samples))
    return rows


def pool_work(step, m: int):
    """Round m's placement over stage 0's ranks (every stage's pool plans the same), kept in
    the step's cache for the plans of one assignment and shape."""
    p = step.pplan
    args = (_rows(step, m, folded=False), step.layout, p.seq_data_size * p.tp, "pool",
            pool_long(step), step.heads, step.model.cost.encoder_names, p.tp)
    if step.cache is None:
        return round_work(*args)
    key = ("pipe_pool", id(step.assignment), p.dp, p.sp, p.tp, m, pool_long(step))
    if key not in step.cache:  # the assignment lives in the same cache: its id stays its own
        step.cache[key] = round_work(*args)
    return step.cache[key]


def pool_loads(step) -> np.ndarray:
    """[M, D] each pool rank's encoder FLOPs of each round ("stage0": stage 0's)."""
    tp = step.pplan.tp
    return np.stack([pool_work(step, m).flops[::tp] for m in range(step.plan.micro_batches)])


def pool_owned(step) -> list[np.ndarray]:
    """[D] the ids of the items each pool rank encodes over the step's rounds, which under
    "uniform" its column of stages splits (`plan_joint`)."""
    p = step.pplan
    owned: list[list[int]] = [[] for _ in range(p.seq_data_size)]
    for m in range(step.plan.micro_batches):
        plan, ids, _ = encode_sim.pool_round(_rows(step, m, folded=True), step.layout,
                                             p.seq_data_size, False, step.heads,
                                             step.model.cost.encoder_names)
        for i, owner in zip(ids, plan.owner):
            owned[owner].append(i)
    return [np.asarray(o, dtype=np.int64) for o in owned]


def pool_exchanges(step, ranks: list[np.ndarray], encoding: list[int]) -> None:
    """The pool's planning once a step (`plan_pool`) and every round's exchanges on the stages
    in `encoding` (`ranks` [P][D tp]): the moved items' inputs on each, with its calls beyond
    the wire, and on stage 0 the rows' all-to-all forward and back."""
    from ds_omni.sim import step as sim_step  # it runs the pipeline: imported when called
    sim_step.plan_pool(step, encoding)
    n, c = len(ranks[0]), step.cluster
    rows_s, inputs_s = np.zeros(n), np.zeros(n)
    for m in range(step.plan.micro_batches):
        work = pool_work(step, m)
        rows, inputs = sim_step.reshard_seconds(step, work)
        rows_s += 2 * rows[:n]
        inputs_s += inputs[:n] + (sim_step.POOL_CALLS * c.a2a_call_s if work.inputs else 0.0)
    for s in encoding:
        step.timeline.run(ranks[s], "reshard", inputs_s + (rows_s if s == 0 else 0.0), COMM)
