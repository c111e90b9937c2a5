"""Encoder work in the pipeline's bubbles on simulated ranks (`encoder_placement: "bubbles"`).

Each pipeline's items of the step (an SP shard's: its reshard plan's; under the encoder pool a pool
rank's; every TP rank alike) are placed as training places them (`plan_bubbles` on the cost model's
item costs and stage times). An item's forward runs on its owner stage at the start of its planned
schedule step (a warm-up idle slot, or the step's start where no gap holds it); its rows reach
stage 0 right before that stage's forward of the item's micro-batch (a receive: stage 0 waits for
the owner). Its backward runs at its planned step (a cool-down slot, or before the reduction), once
stage 0 has sent the rows' gradients after its backward of the micro-batch. The ops join each
stage's 1F1B order at the schedule step DeepSpeed's `TrainSchedule` gives it (forward of m at 2m +
s, backward at 2m + 2P - 1 - s), so work a gap cannot hold delays its stage as on the engine.
"auto" resolves as training resolves it.
More: docs/simulator.md.

Dims: P stages, M micro-batches, D ranks a stage (pipelines: dp x sp x tp).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ds_omni.parallel import reshard
from ds_omni.parallel.bubbles import (CallOverhead, auto_placement, plan_bubbles,
                                      rank_stage_time)
from ds_omni.sim import comm, pool_sim
from ds_omni.sim.encode_sim import Row
from ds_omni.sim.timeline import COMM


def resolve_auto(step, stage_plan) -> None:
    """`encoder_placement: "auto"` -> "bubbles" where the cost model's typical step predicts a
    gain, else "uniform" (`auto_placement` on the stages training splits, `stage_plan(step)`, the
    drawn samples' items a sample and the cluster's call and message costs, `typical_inputs`;
    one pipeline's share under sp, tp and the pool, as training models it), in `step.plan`."""
    p, plan = step.pplan, step.plan
    if plan.encoder_placement != "auto":
        return
    step.plan = _placed(plan, "uniform")  # "bubbles" splits the stages as "uniform" does
    times = rank_stage_time(stage_plan(step).layer_time, p.sp, p.tp)
    step.plan = _placed(plan, auto_placement(step.model.cost, times, *typical_inputs(step)))


def typical_inputs(step) -> tuple:
    """(micro-batches, samples a micro-batch, items a sample by encoder, call overhead) of the
    typical step "auto" models: the mix of the drawn samples (training reads its sources'; a
    pipeline's 1/sp of a row's items, as `ds_omni.parallelize.pipeline.typical_step`), the
    overhead from the cluster's fields (FLOPs at its rate: `micro_batch_s_per_param` a weight a
    call, `intra_latency` a message)."""
    p, plan, c = step.pplan, step.plan, step.cluster
    per_micro = max(1, round(len(step.samples) / (p.dp * plan.micro_batches)))
    n = max(len(step.samples), 1)
    encoders = step.samples.item_encoder.tolist()
    items = {name: encoders.count(name) / n / p.sp for name in step.model.cost.dims.encoders}
    overhead = CallOverhead(per_param=c.micro_batch_s_per_param * c.flops_per_s,
                            message=c.intra_latency * c.flops_per_s)
    return plan.micro_batches, per_micro, items, overhead


def _placed(plan, placement: str):
    return dataclasses.replace(plan, parallel=dataclasses.replace(
        plan.parallel, encoder_placement=placement))


def sched_step(kind: str, m: int, s: int, P: int) -> int:
    """The TrainSchedule step of stage s's forward ("F") or backward ("B") of micro-batch m."""
    return 2 * m + s if kind == "F" else 2 * m + 2 * P - 1 - s


class BubbleOps:
    """The plan's encoder ops of one step on every pipeline: ("EF", (t, m)) / ("EB", (t, m)) a
    stage's encoder forward / backward of micro-batch m's items at schedule step t, in item order
    (by micro-batch), ("R", m) stage 0's receive of m's rows; `orders` puts them into the 1F1B
    orders, `run` runs one."""

    def __init__(self, step, ranks: list[np.ndarray]):
        self.step, self.ranks = step, ranks
        p = step.pplan
        self.P, self.M, D = p.pp, step.plan.micro_batches, len(ranks[0])
        self.fwd: dict = {}  # (s, (t, m)) -> [D] seconds
        self.bwd: dict = {}
        self.rows: dict = {}  # (s, m) -> [D] bytes of rows stage s > 0 sends stage 0
        self.last_fwd: dict = {}  # (s, m) -> [D] step of the last forward of m's items (-1)
        self.ready: dict = {}  # (s, m) -> [D] event ids of those forwards
        self.done: set = set()
        self.hidden_share = []  # per pipeline, the plan's share of encoder work in gaps
        weights = step.cluster.micro_batch_s_per_param * float(sum(
            step.model.encoder_params(n) for n in step.model.dims.encoders))
        sp, tp = p.sp, p.tp
        if step.plan.encoder_mode == "pool":  # each pool rank's column: the items it was given
            for c, (ids, micro) in enumerate(pool_sim.pool_owned_rounds(step)):
                self._pipeline(np.arange(c * tp, (c + 1) * tp), ids, micro, D, weights)
            return
        for d, rounds in enumerate(step.assignment.rounds):
            for j, (ids, micro) in enumerate(self._shard_items(rounds)):
                first = (d * sp + j) * tp  # the columns of SP shard j's TP ranks
                self._pipeline(np.arange(first, first + tp), ids, micro, D, weights)

    def _shard_items(self, rounds) -> list[tuple[list[int], list[int]]]:
        """Per SP shard of a pipeline's rows: (its item ids, their micro-batches), each row's
        items on the shards training's reshard plan gives them (`reshard.place_items`, long
        items whole as under the joint pipeline); every TP rank of a shard encodes them all."""
        step, sp = self.step, self.step.pplan.sp
        out: list[tuple[list[int], list[int]]] = [([], []) for _ in range(sp)]
        for m in range(self.M):
            slots, ids, tokens = step.layout.slots(Row(np.arange(sp), rounds[m].samples))
            owner = ([0] * len(ids) if sp == 1 else reshard.place_items(
                slots, sp, max(1, math.ceil(tokens / sp)), step.model.cost.encoder_names)[0])
            for k, i in enumerate(ids):
                out[owner[k]][0].append(i)
                out[owner[k]][1].append(m)
        return out

    def _pipeline(self, d, ids: list[int], micro: list[int], D: int, weights: float) -> None:
        """Plan the items `ids` (micro-batches `micro`) of the pipeline whose ranks are columns
        `d` of each stage, and add their work to the ops' [D] arrays."""
        step, P, fe = self.step, self.P, self.step.encoder_fwd
        if not ids:
            return
        plan = plan_bubbles(micro, step.item_cost[ids].tolist(), P, self.M, rank_stage_time(
            step.stage_plan.layer_time, step.pplan.sp, step.pplan.tp))
        self.hidden_share.append(plan.hidden_share)
        first: dict[int, tuple] = {}
        last_b: dict[int, tuple] = {}
        for k, i in enumerate(ids):
            s, m, t_f, t_b = plan.stage_of[k], micro[k], plan.forward_at[k], plan.backward_at[k]
            seconds = step.item_cost[i] / step.rate
            _add(self.fwd, (s, (t_f, m)), D, d, seconds * fe)
            _add(self.bwd, (s, (t_b, m)), D, d, seconds * (1 - fe))
            first[s] = min(first.get(s, (t_f, m)), (t_f, m))
            last_b[s] = max(last_b.get(s, (t_b, m)), (t_b, m))
            if s > 0:
                _add(self.rows, (s, m), D, d, step.samples.item_rows[i] * step.model.dims.hidden * 2)
                last = self.last_fwd.setdefault((s, m), np.full(D, -1))
                last[d] = np.maximum(last[d], t_f)
        for s, t in first.items():  # the replica's weights read once a step (as "uniform")
            _add(self.fwd, (s, t), D, d, weights * fe)
            _add(self.bwd, (s, last_b[s]), D, d, weights * (1 - fe))

    def orders(self, base: list[list[tuple[str, int]]]) -> list[list[tuple[str, int]]]:
        """`base` (each stage's 1F1B order) with the encoder ops at their schedule steps."""
        out = []
        for s, ops in enumerate(base):
            due = sorted({(t, 0, m) for (s2, (t, m)) in self.fwd if s2 == s}
                         | {(t, 1, m) for (s2, (t, m)) in self.bwd if s2 == s})
            merged = []
            for kind, m in ops:
                at = sched_step(kind, m, s, self.P)
                while due and due[0][0] <= at:
                    t, b, mm = due.pop(0)
                    merged.append(("EB" if b else "EF", (t, mm)))
                if s == 0 and kind == "F":
                    merged.append(("R", m))
                merged.append((kind, m))
            out.append(merged + [("EB" if b else "EF", (t, mm)) for t, b, mm in due])
        # a run without a deadlock waits at most P times a pass, and each pass runs an op
        self.waits_left = self.P * sum(len(o) for o in out)
        return out

    def run(self, s: int, kind: str, key, events: dict) -> bool:
        """Run op (kind, key) of stage s; False where it waits on an op not run yet."""
        tl, ranks, cluster = self.step.timeline, self.ranks, self.step.cluster
        if kind == "R":
            owners = [o for o in range(1, self.P) if (o, key) in self.rows]
            if any(("EF", o, (int(t), key)) not in self.done for o in owners
                   for t in self.last_fwd[(o, key)] if t >= 0):
                return self._wait(s, kind, key)
            for o in owners:
                link = comm.link_of(cluster, [ranks[0][0], ranks[o][0]])
                tl.run(ranks[0], "p2p", comm.p2p_each(self.rows[(o, key)], link), COMM,
                       after=self.ready[(o, key)])
            return True
        if kind == "EF":
            ids = tl.run(ranks[s], "encode_fwd", self.fwd[(s, key)])
            last = self.last_fwd.get((s, key[1]))
            if last is not None:  # the rows of m this stage's last forward of them made
                ready = self.ready.setdefault((s, key[1]), np.full(len(last), -1))
                ready[last == key[0]] = ids[last == key[0]]
        else:
            m = key[1]
            if s > 0 and ("B", 0, m) not in events:
                return self._wait(s, kind, key)
            if s > 0:  # the rows' gradients from stage 0 (none where the pipeline has no rows)
                link = comm.link_of(cluster, [ranks[0][0], ranks[s][0]])
                nbytes = self.rows.get((s, m), np.zeros(len(ranks[s])))
                tl.run(ranks[s], "p2p", comm.p2p_each(nbytes, link), COMM,
                       after=np.where(nbytes > 0, events[("B", 0, m)], -1))
            tl.run(ranks[s], "encode_bwd", self.bwd[(s, key)])
        self.done.add((kind, s, key))
        return True

    def _wait(self, s: int, kind: str, key: int) -> bool:
        self.waits_left -= 1
        if self.waits_left < 0:
            raise RuntimeError(f"the simulated bubbles schedule cannot go on: stage {s} waits at "
                               f"{(kind, key)}; report this plan (parallel.bubbles replays it "
                               "deadlock-free)")
        return False


def _add(table: dict, key, size: int, col: int, value: float) -> None:
    table.setdefault(key, np.zeros(size))[col] += value
