"""The encoder pool's own costs on simulated ranks (`parallel.encoder_pool`): its planning once a
step (`plan_pool`) and the calls of a round that moves items (`pool_calls`); and the pool under a
pipeline, as training runs it (`train.step`, `parallelize.joint.EncodeShare`): each round
planned over one stage's dp x sp ranks of a TP rank (`encode_sim.round_work`, "pool") on every
stage that encodes (stage 0 under "stage0", all under "uniform" and "bubbles"), every round's
moved inputs and its rows (forward and back) exchanged before the schedule, where training places
every round.
Under "stage0" a rank's encoder FLOPs of a round are the pool's load there; under "uniform" each
pool rank's items of the step are split over its column of stages (`pipeline_sim`); under
"bubbles" placed into its idle slots (`bubble_sim`).

Dims: M micro-batches, D pool ranks (dp x sp), P stages.
"""

from __future__ import annotations

import numpy as np

from ds_omni.sim import comm, encode_sim
from ds_omni.sim.calibrate_comm import POOL_META_BYTES
from ds_omni.sim.encode_sim import Row, round_work
from ds_omni.sim.timeline import COMM

POOL_CALLS = 3
"""All-to-all calls of a round whose pool plan moves an item (`EncoderPool.place`): the moved
items' inputs (`exchange_inputs`), the embedding rows (`ReshardEmbeddings`) and their gradients
back. A round that moves nothing makes none (it runs as without the pool)."""


def pool_groups(step, stages=None) -> np.ndarray:
    """[tp x stages, P] the pool groups: the ranks of one TP coordinate of one pipeline stage
    (the pool runs per TP rank and stage), of `stages` (default all)."""
    p = step.pplan
    by_stage = step.llm_ranks().reshape(p.pp, -1, p.tp).transpose(0, 2, 1)  # [pp, tp, P]
    return by_stage[list(range(p.pp)) if stages is None else list(stages)].reshape(
        -1, p.seq_data_size)


def plan_pool(step, stages=None) -> None:
    """The pool's planning once a step (`EncoderPool.plan_step`), before the rounds: every rank
    all-gathers every rank's item metadata (`all_gather_object`: the sizes, then the pickled
    lists, `calibrate_comm.POOL_META_BYTES` an item) and plans every round over all of them
    (`Cluster.pool_item_s` an item of the step, CPU), on `stages` (default all)."""
    groups = pool_groups(step, stages)
    p = groups.shape[1]
    items = _planned_items(step)
    link = comm.link_of(step.cluster, groups[0])
    wire = comm.all_gather(8 * p, p, link) + comm.all_gather(
        POOL_META_BYTES * items, p, link)
    ranks = groups.reshape(-1)
    step.timeline.sync(ranks, np.repeat(np.arange(len(groups)), p), "pool_plan", wire)
    if step.cluster.pool_item_s:
        step.timeline.run(ranks, "pool_plan", step.cluster.pool_item_s * items)


def kept(step, key: tuple, make):
    """`make()`, kept in the step's cache under `key` (which names the step's assignment by id:
    the assignment lives in the same cache, so its id stays its own) for the plans sharing it."""
    if step.cache is None:
        return make()
    if key not in step.cache:
        step.cache[key] = make()
    return step.cache[key]


def _planned_items(step) -> int:
    """The items of the step's planned samples, kept per assignment."""
    return kept(step, ("pool_items", id(step.assignment)), lambda: int(
        np.isin(step.samples.item_sample, step.assignment.planned).sum()))


def pool_calls(step, work) -> None:
    """A round whose pool plan moves an item: each pool rank's own seconds of its `POOL_CALLS`
    all-to-all calls beyond the wire (`Cluster.a2a_call_s`, the calibrated cost of a call;
    the wire is in the resharding's)."""
    if step.plan.encoder_mode == "pool" and work.inputs and step.cluster.a2a_call_s:
        ranks = pool_groups(step).reshape(-1)
        step.timeline.run(ranks, "pool_exchange", POOL_CALLS * step.cluster.a2a_call_s)


# ------------------------------------------------------------------ under a pipeline
def pool_long(step) -> bool:
    """Long-short SP inside the pool's rounds: off under "uniform", whose stages encode whole
    items (`data.build.long_items_of`)."""
    return step.plan.long_items and step.plan.encoder_placement == "stage0"


def rows_of(step, m: int) -> list[Row]:
    """Round m's rows: each data-parallel rank's over its SP ranks of one TP rank (pool ranks)."""
    p, rows = step.pplan, []
    for d, rounds in enumerate(step.assignment.rounds):
        samples = rounds[m].samples
        if samples.size:
            rows.append(Row(np.arange(d * p.sp, (d + 1) * p.sp), samples))
    return rows


def pool_folded(step, m: int):
    """Round m's pool plan over one TP rank's pool ranks of stage 0 (tp folded away: rank g of
    the dp x sp), kept in the step's cache. It reads the rows and the pool's size alone, so the
    plans of one assignment and dp x sp share it whatever their tp and pp."""
    p = step.pplan
    return kept(step, ("pipe_pool_folded", id(step.assignment), p.dp, p.sp, m, pool_long(step)),
                 lambda: round_work(rows_of(step, m), step.layout, p.seq_data_size, "pool",
                                    pool_long(step), step.heads, step.model.cost.encoder_names))


def pool_loads(step) -> np.ndarray:
    """[M, D] each pool rank's encoder FLOPs of each round ("stage0": stage 0's): TP rank 0's,
    which every TP rank's equal (the folded plan's loads, whatever the tp)."""
    return np.stack([pool_folded(step, m).flops for m in range(step.plan.micro_batches)])


def pool_owned(step) -> list[np.ndarray]:
    """[D] the ids of the items each pool rank encodes over the step's rounds, which under
    "uniform" its column of stages splits (`plan_joint`): the folded plans' owners (under the
    joint placements `pool_long` is off, so they are `pool_round`'s without long items)."""
    return [np.asarray(ids, dtype=np.int64) for ids, _ in pool_owned_rounds(step)]


def pool_exchanges(step, ranks: list[np.ndarray], encoding: list[int]) -> None:
    """The pool's planning once a step (`plan_pool`) and every round's exchanges on the stages
    in `encoding` (`ranks` [P][D tp]): the moved items' inputs on each, with its calls beyond
    the wire, and on stage 0 the rows' all-to-all forward and back."""
    plan_pool(step, encoding)
    p, n = step.pplan, len(ranks[0])  # kept for the plans of one assignment and shape (read-only)
    rows_s, inputs_s, moved = kept(step, ("pipe_pool_exchanges", id(step.assignment), p.dp, p.sp,
                                           p.tp, pool_long(step), n),
                                    lambda: _exchange_seconds(step, n))
    for name, nbytes in moved:  # in the order the rounds add them: the same sums
        step.a2a_bytes[name] += nbytes
    for s in encoding:
        step.timeline.run(ranks[s], "reshard", inputs_s + (rows_s if s == 0 else 0.0), COMM)


def _exchange_seconds(step, n: int) -> tuple:
    """([n] seconds of stage 0's ranks in all rounds' row all-to-alls, forward and back; [n] in
    their input all-to-alls and calls; [(exchange, bytes)] in round order)."""
    p, c = step.pplan, step.cluster
    rows_s, inputs_s, moved = np.zeros(n), np.zeros(n), []
    for m in range(step.plan.micro_batches):
        work = pool_folded(step, m)  # priced as copied to each TP rank (`over_tp`)
        (rows, rows_moved), (inputs, inputs_moved) = encode_sim.exchanges(c, work, p.tp)
        moved += [(name, b) for name, b in (("reshard", rows_moved),
                                            ("pool_inputs", inputs_moved)) if b is not None]
        rows_s += 2 * rows[:n]
        inputs_s += inputs[:n] + (POOL_CALLS * c.a2a_call_s if work.inputs else 0.0)
    return rows_s, inputs_s, moved


def pool_owned_rounds(step) -> list[tuple[list[int], list[int]]]:
    """Per pool rank: (the ids of the items it encodes over the step's rounds, each one's round),
    which under "bubbles" its column of stages places into the schedule (`bubble_sim`)."""
    p = step.pplan
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in range(p.seq_data_size)]
    for m in range(step.plan.micro_batches):
        ids, owners = pool_folded(step, m).pooled
        for i, owner in zip(ids, owners):
            out[owner][0].append(int(i))
            out[owner][1].append(m)
    return out
