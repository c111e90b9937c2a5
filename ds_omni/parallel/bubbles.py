"""Encoder work in the pipeline's bubbles: where each stage encodes, and a timeline of it (pure).

DeepSpeed's 1F1B `TrainSchedule` leaves every stage idle for 2 (P - 1) slots a step: stage s
waits s forward slots for its first micro-batch, then (P - 1 - s) backward slots for its first
gradient, and the same mirrored in the cool-down. `timeline` replays the schedule's instruction
streams (ported here as `step_micro`; a unit test holds it to DeepSpeed's) with modelled durations
and blocking receives, and reports each stage's idle gaps. `plan_bubbles` places each encoder
item's forward in a gap of one stage that ends before stage 0 needs the item's micro-batch, and its
backward in a gap that starts after stage 0's backward of that micro-batch; what fits nowhere
runs where "uniform" runs it (forward at the start, backward before the reduction), balanced.
The plan is replayed with its own instructions, so a deadlock or a late item is found here.
"auto" replays a typical step of the data's mix with each placement's calls and messages priced.
More: docs/parallelism.md, "Encoder work in the pipeline's bubbles".

Dims: P stages, M micro-batches, 2 (M + P - 1) schedule steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def step_micro(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of `stage`'s step `step` in DeepSpeed's TrainSchedule (the
    micro-batch may be out of range: an idle slot). Forward of m at step 2m + s, backward of m
    at step 2m + 2P - 1 - s."""
    if (step - stage) % 2 == 0:
        return (step - stage) // 2, True
    return (step + stage + 1) // 2 - stages, False


def schedule_steps(stages: int, micro_batches: int) -> int:
    return 2 * (micro_batches + stages - 1)


def stage_ops(stage: int, stages: int, micro_batches: int, fwd: float, bwd: float,
              before: dict[int, list] | None = None, after_bwd: dict[int, list] | None = None,
              before_fwd: dict[int, list] | None = None) -> list[tuple]:
    """The stage's instruction stream as ops (kind, key or seconds, step): "send"/"recv" of a key
    (("act", m, s), ("grad", m, s), or an encoder message), "work" of seconds; `before[t]`: ops
    put in at the start of step t (t = the step count: before the reduction), `after_bwd[m]`
    after the backward of m, `before_fwd[m]` right before the forward of m."""
    before, after_bwd, before_fwd = before or {}, after_bwd or {}, before_fwd or {}
    ops, prev, total = [], -1, schedule_steps(stages, micro_batches)
    valid = range(micro_batches).__contains__
    for step in range(total):
        ops += [(kind, key, step) for kind, key in before.get(step, [])]
        m, forward = step_micro(step, stage, stages)
        if forward:
            if valid(prev) and stage > 0:
                ops.append(("send", ("grad", prev, stage - 1), step))
            if valid(m) and stage > 0:
                ops.append(("recv", ("act", m, stage), step))
            if valid(m):
                ops += [(kind, key, step) for kind, key in before_fwd.get(m, [])]
                ops.append(("work", fwd, step))
        else:
            if valid(m) and stage < stages - 1:
                ops.append(("recv", ("grad", m, stage), step))
            if valid(prev) and stage < stages - 1:
                ops.append(("send", ("act", prev, stage + 1), step))
            if valid(m):
                ops.append(("work", bwd, step))
                ops += [(kind, key, step) for kind, key in after_bwd.get(m, [])]
        prev = m
    return ops + [(kind, key, total) for kind, key in before.get(total, [])]


@dataclass
class Timeline:
    """Per stage: ops' (start, end) times, its idle gaps (step, start, end), its busy seconds and
    its end; `end` the step's (the slowest stage's); `forward_start[m]` when stage 0 starts the
    forward of m, `backward_end[m]` when it ends its backward."""

    spans: list[list[tuple[float, float]]]
    gaps: list[list[tuple[int, float, float]]]
    busy: list[float]
    ends: list[float]
    forward_start: dict[int, float] = field(default_factory=dict)
    backward_end: dict[int, float] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return max(self.ends)

    def bubble_fractions(self) -> list[float]:
        """Each stage's share of the step spent idle (the step ends when the slowest does)."""
        return [1.0 - b / self.end if self.end else 0.0 for b in self.busy]


class Deadlock(RuntimeError):
    pass


def timeline(streams: list[list[tuple]], total_steps: int) -> Timeline:
    """Replay the stages' op streams: a send takes no time and never blocks, a receive waits for
    its send, work takes its seconds. Raises `Deadlock` when no stage can go on. A stage idles
    from its end to the slowest's (a gap at step `total_steps`)."""
    n = len(streams)
    at, clock = [0] * n, [0.0] * n
    sent: dict = {}
    spans = [[] for _ in range(n)]
    gaps = [[] for _ in range(n)]
    busy = [0.0] * n
    moved = True
    while moved:
        moved = False
        for s in range(n):
            while at[s] < len(streams[s]):
                kind, key, step = streams[s][at[s]]
                start = clock[s]
                if kind == "recv":
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                    if clock[s] > start:
                        gaps[s].append((step, start, clock[s]))
                elif kind == "send":
                    sent[key] = clock[s]
                else:
                    clock[s] += key
                    busy[s] += key
                spans[s].append((start, clock[s]))
                at[s] += 1
                moved = True
    if any(at[s] < len(streams[s]) for s in range(n)):
        stuck = [streams[s][at[s]] for s in range(n) if at[s] < len(streams[s])]
        raise Deadlock(f"the pipeline schedule cannot go on: stages wait on {stuck}")
    end = max(clock)
    for s in range(n):  # idle until the slowest stage ends (the step's reduction)
        if clock[s] < end:
            gaps[s].append((total_steps, clock[s], end))
    return Timeline(spans, gaps, busy, list(clock))


def base_timeline(stages: int, micro_batches: int, fwd: list[float],
                  bwd: list[float]) -> Timeline:
    """The bare 1F1B schedule's timeline, with stage 0's forward starts and backward ends."""
    streams = [stage_ops(s, stages, micro_batches, fwd[s], bwd[s]) for s in range(stages)]
    line = timeline(streams, schedule_steps(stages, micro_batches))
    for (kind, key, step), (start, end) in zip(streams[0], line.spans[0]):
        if kind == "work":
            m, forward = step_micro(step, 0, stages)
            if forward:
                line.forward_start[m] = start
            else:
                line.backward_end[m] = end
    return line


@dataclass(frozen=True)
class BubblePlan:
    """Per item (in the caller's order): its stage, the step its forward runs at the start of
    and the step its backward does (the step count: before the reduction), and whether each was
    placed in a gap; the modelled step time of "uniform" and of this plan, and the stages'
    modelled idle shares under this plan."""

    stage_of: list[int]
    forward_at: list[int]
    backward_at: list[int]
    hidden_forward: list[bool]
    hidden_backward: list[bool]
    stages: int
    micro_batches: int
    uniform_time: float = 0.0
    planned_time: float = 0.0
    bubble_fractions: tuple[float, ...] = ()
    hidden_share: float = 0.0  # of the modelled encoder work, the share put in gaps

    @property
    def steps(self) -> int:
        return schedule_steps(self.stages, self.micro_batches)


def plan_bubbles(micro: list[int], costs: list[float], stages: int, micro_batches: int,
                 stage_cost: list[float], forward_share: float = 1 / 3,
                 calls: "CallCosts | None" = None) -> BubblePlan:
    """Place items of micro-batch `micro[i]` and training cost `costs[i]` (the cost model's,
    forward + backward) into the gaps of the 1F1B schedule whose stages cost `stage_cost` [P] a
    micro-batch (forward + backward); a forward costs `forward_share` of either. `calls`: what
    the placement's encoder calls and messages cost beyond the items (priced in the modelled
    times, both placements'; None: nothing)."""
    fwd = [c * forward_share for c in stage_cost]
    bwd = [c - f for c, f in zip(stage_cost, fwd)]
    base = base_timeline(stages, micro_batches, fwd, bwd)
    room = [[[step, start, end, start] for step, start, end in gaps] for gaps in base.gaps]
    n = len(costs)
    stage_of, f_at, b_at = [0] * n, [0] * n, [schedule_steps(stages, micro_batches)] * n
    hid_f, hid_b = [False] * n, [False] * n
    late_f, late_b = [0.0] * stages, [0.0] * stages  # unhidden work: at the start, at the end
    for i in sorted(range(n), key=lambda i: (micro[i], -costs[i], i)):
        ef, eb, m = costs[i] * forward_share, costs[i] * (1 - forward_share), micro[i]
        best = None
        for s in range(stages):
            fg = _fit_forward(room[s], ef, base.forward_start[m], 2 * m if s == 0 else None)
            bg = _fit_backward(room[s], eb, base.backward_end[m],
                               2 * m + 2 * stages if s == 0 else None)
            # what stays on the critical path: the largest unhidden share before the schedule
            # and after it (the stages run theirs side by side, as under "uniform")
            exposed = (max(late_f[t] + ef * (t == s and fg is None) for t in range(stages))
                       + max(late_b[t] + eb * (t == s and bg is None) for t in range(stages)))
            hidden = ef * (fg is not None) + eb * (bg is not None)
            key = (exposed, -hidden, s)
            if best is None or key < best[0]:
                best = (key, s, fg, bg)
        _, s, fg, bg = best
        stage_of[i] = s
        if fg is not None:
            fg[3] += ef
            f_at[i], hid_f[i] = fg[0], True
        else:
            late_f[s] += ef
            if s > 0 and room[s]:  # run at the start: it fills the stage's leading gap first
                room[s][0][3] += ef
        if bg is not None:
            bg[3] = max(bg[3], base.backward_end[m]) + eb
            b_at[i], hid_b[i] = bg[0], True
        else:
            late_b[s] += eb
    plan = BubblePlan(stage_of, f_at, b_at, hid_f, hid_b, stages, micro_batches)
    return _priced(plan, micro, costs, fwd, bwd, forward_share, calls)


def _fit_forward(gaps: list[list], work: float, deadline: float, last_step: int | None):
    """The first gap that holds `work` and ends it by `deadline` (at or before `last_step`)."""
    for gap in gaps:
        step, _, end, used = gap
        if last_step is not None and step > last_step:
            break
        if used + work <= min(end, deadline) + 1e-12:
            return gap
    return None


def _fit_backward(gaps: list[list], work: float, ready: float, first_step: int | None):
    """The first gap (at or after `first_step`) that holds `work` started no earlier than
    `ready`."""
    for gap in gaps:
        step, _, end, used = gap
        if first_step is not None and step < first_step:
            continue
        if max(used, ready) + work <= end + 1e-12 and end > ready:
            return gap
    return None


@dataclass(frozen=True)
class CallCosts:
    """What encoding costs beyond its items, in the cost model's units: `encoder[i]` item i's
    encoder (an index into `per_call`), `per_call[e]` one call of encoder e (forward + backward:
    its pass over the encoder's weights), `message` one point-to-point message."""

    encoder: list[int]
    per_call: list[float]
    message: float = 0.0


def streams_of(plan: BubblePlan, micro: list[int], costs: list[float], fwd: list[float],
               bwd: list[float], forward_share: float = 1 / 3,
               calls: CallCosts | None = None) -> list[list[tuple]]:
    """The stages' op streams with the plan's encoder instructions (what `BubbleSchedule` runs);
    with `calls`, each call's and message's cost as work where the runtime makes it."""
    out = []
    for s in range(plan.stages):
        before: dict[int, list] = {}
        before_fwd: dict[int, list] = {}
        after_bwd: dict[int, list] = {}
        for i, (m, c) in enumerate(zip(micro, costs)):
            if plan.stage_of[i] == s:
                before.setdefault(plan.forward_at[i], []).append(("work", c * forward_share))
                if s > 0:
                    before[plan.forward_at[i]].append(("send", ("rows", i)))
                    before.setdefault(plan.backward_at[i], []).append(("recv", ("rgrad", i)))
                before.setdefault(plan.backward_at[i], []).append(("work", c * (1 - forward_share)))
            if s == 0 and plan.stage_of[i] > 0:
                before_fwd.setdefault(m, []).append(("recv", ("rows", i)))
                after_bwd.setdefault(m, []).append(("send", ("rgrad", i)))
        if calls is not None:
            _call_work(plan, micro, s, calls, forward_share, before, before_fwd, after_bwd)
        out.append(stage_ops(s, plan.stages, plan.micro_batches, fwd[s], bwd[s], before,
                             after_bwd, before_fwd))
    return out


def _call_work(plan: BubblePlan, micro: list[int], s: int, calls: CallCosts,
               forward_share: float, before: dict, before_fwd: dict, after_bwd: dict) -> None:
    """Stage s's call and message costs added to its ops: one encoder call per (forward step,
    encoder, backward step) of its items (`BubbleEncoding.encode`), its forward share before
    the items' forwards and the rest with their backward; a message per item sent to stage 0
    and per gradient sent back, on each end (stage 0's at the micro-batch's forward and
    backward)."""
    groups = {(plan.forward_at[i], calls.encoder[i], plan.backward_at[i])
              for i, st in enumerate(plan.stage_of) if st == s}
    for t_f, e, t_b in sorted(groups):
        before.setdefault(t_f, []).insert(0, ("work", calls.per_call[e] * forward_share))
        before.setdefault(t_b, []).insert(0, ("work", calls.per_call[e] * (1 - forward_share)))
    if not calls.message:
        return
    for i, st in enumerate(plan.stage_of):
        if st == s and s > 0:
            before[plan.forward_at[i]].append(("work", calls.message))
            before[plan.backward_at[i]].insert(0, ("work", calls.message))
        elif s == 0 and st > 0:
            m = micro[i]
            before_fwd.setdefault(m, []).append(("work", calls.message))
            after_bwd.setdefault(m, []).insert(0, ("work", calls.message))


def _priced(plan: BubblePlan, micro, costs, fwd, bwd, forward_share,
            calls: CallCosts | None = None) -> BubblePlan:
    """The plan with its modelled times. Where its replay is slower than "uniform" (the model's
    gaps shift once unhidden work runs, or its calls and messages cost more than it hides), or
    deadlocks (it should not), the items go where "uniform" puts them instead (longest first to
    the least loaded stage, forward at the start, backward before the reduction), streamed
    micro-batch by micro-batch."""
    from dataclasses import replace
    total = sum(costs)
    base = base_timeline(plan.stages, plan.micro_batches, fwd, bwd)
    uniform = base.end + _uniform_encoding(costs, plan.stages, calls)
    try:
        line = timeline(streams_of(plan, micro, costs, fwd, bwd, forward_share, calls),
                        plan.steps)
    except Deadlock:
        line = None
    if line is None or line.end > uniform:
        n = len(costs)
        plan = replace(plan, stage_of=_longest_first(costs, plan.stages), forward_at=[0] * n,
                       backward_at=[plan.steps] * n, hidden_forward=[False] * n,
                       hidden_backward=[False] * n)
        line = timeline(streams_of(plan, micro, costs, fwd, bwd, forward_share, calls),
                        plan.steps)
    hidden = sum(c * (forward_share * hf + (1 - forward_share) * hb) for c, hf, hb in
                 zip(costs, plan.hidden_forward, plan.hidden_backward))
    return replace(plan, uniform_time=uniform, planned_time=line.end,
                   bubble_fractions=tuple(line.bubble_fractions()),
                   hidden_share=hidden / total if total else 1.0)


def _uniform_encoding(costs: list[float], stages: int, calls: CallCosts | None) -> float:
    """What "uniform" adds to the bare schedule: the largest stage's share (before the schedule
    and after it), with a call of each encoder it has items of (no dummy calls in a pipeline),
    and stage 0's two all-to-alls, a message from and to each other stage (`JointEncoding`)."""
    load = [0.0] * stages
    used: set = set()
    for i, s in enumerate(_longest_first(costs, stages)):
        load[s] += costs[i]
        if calls is not None and (s, calls.encoder[i]) not in used:
            used.add((s, calls.encoder[i]))
            load[s] += calls.per_call[calls.encoder[i]]
    return max(load) + (2 * (stages - 1) * calls.message if calls is not None else 0.0)


def _longest_first(costs: list[float], stages: int) -> list[int]:
    """Stage of each item: longest first to the least loaded (ties: the lower stage)."""
    load, out = [0.0] * stages, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        out[i] = min(range(stages), key=lambda s: (load[s], s))
        load[out[i]] += costs[i]
    return out


def describe_slots(plan: BubblePlan) -> list[dict]:
    """Per stage: the schedule steps it encodes in (forward: "step:items", backward likewise;
    the step count means before the reduction), what `ds-omni plan` prints."""
    out = []
    for s in range(plan.stages):
        fwd: dict[int, int] = {}
        bwd: dict[int, int] = {}
        for i, st in enumerate(plan.stage_of):
            if st == s:
                fwd[plan.forward_at[i]] = fwd.get(plan.forward_at[i], 0) + 1
                bwd[plan.backward_at[i]] = bwd.get(plan.backward_at[i], 0) + 1
        out.append({"stage": s, "forward_steps": {k: fwd[k] for k in sorted(fwd)},
                    "backward_steps": {k: bwd[k] for k in sorted(bwd)},
                    "modelled_idle": round(plan.bubble_fractions[s], 4)
                    if plan.bubble_fractions else None})
    return out


@dataclass(frozen=True)
class CallOverhead:
    """What an encoder call and a message cost beyond their FLOPs, as FLOPs at the machine's
    rate: `per_param`, a call's pass over each encoder weight (forward + backward); `message`,
    one point-to-point message."""

    per_param: float = 0.0
    message: float = 0.0


CPU_OVERHEAD = CallOverhead(per_param=255.0, message=9.35e7)
"""This project's CPU ranks, as calibrated (benchmarks/results/sim_validation.json,
"calibration"): `micro_batch_s_per_param` x `flops_per_s` of compute "2" (the pipeline model's
profile) and comm's `intra_latency` x that rate."""


def call_costs(cost, encoder: list[int], overhead: CallOverhead) -> CallCosts:
    """`CallCosts` in the cost model's units (its encoders' linear scales turn FLOPs into them,
    seconds where calibrated): a call reads every weight of its encoder, a frozen one forward
    only."""
    per_call, scales = [], []
    for name, e in cost.dims.encoders.items():
        params = e.layers * (4 * e.hidden ** 2 + e.mlp_matrices * e.hidden * e.intermediate)
        scale = cost.scales.get(f"{name}_lin", 1.0)
        share = 1.0 / cost.train_factor if e.frozen else 1.0
        per_call.append(overhead.per_param * params * share * scale)
        scales.append(scale)
    message = overhead.message * (sum(scales) / len(scales) if scales else 1.0)
    return CallCosts(encoder, per_call, message)


def typical_items(cost, micro_batches: int, samples: int,
                  items_per_sample: dict[str, float] | None = None) -> tuple[list, list, list]:
    """(micro-batch, cost, encoder index) of each item of a typical step of `micro_batches`
    micro-batches of `samples` samples: of encoder `name`, round(M x samples x
    items_per_sample[name]) items (None: one a sample), each of the size the cost model runs as
    a dummy, spread evenly from the first micro-batch (item k of K in floor(k M / K)): a sparse
    mix is not credited with a later micro-batch to hide in that a drawn step often lacks."""
    micro, costs, encoder = [], [], []
    for e, (name, dims) in enumerate(cost.dims.encoders.items()):
        rate = 1.0 if items_per_sample is None else items_per_sample.get(name, 0.0)
        count = round(micro_batches * samples * rate)
        one = float(cost.encoder_cost(name, [max(dims.dummy_len, 1)])[0])
        for k in range(count):
            micro.append(k * micro_batches // count)
            costs.append(one)
            encoder.append(e)
    order = sorted(range(len(micro)), key=lambda i: (micro[i], encoder[i]))
    return ([micro[i] for i in order], [costs[i] for i in order], [encoder[i] for i in order])


def typical_schedule(cost, stage_time: list[float], micro_batches: int, samples: int,
                     items_per_sample: dict[str, float] | None = None,
                     overhead: CallOverhead = CPU_OVERHEAD) -> dict:
    """What `ds-omni plan` prints under "bubbles" and "auto" decides by: the plan of a typical
    step (`typical_items`: the data's items a sample, `items_per_sample`) on stages costing
    `stage_time` a micro-batch, with each placement's encoder calls and messages priced
    (`overhead`): where each stage encodes (`describe_slots`), the share of encoder work in idle
    slots and the modelled step against "uniform"'s."""
    micro, costs, encoder = typical_items(cost, micro_batches, samples, items_per_sample)
    plan = plan_bubbles(micro, costs, len(stage_time), micro_batches, stage_time,
                        calls=call_costs(cost, encoder, overhead))
    return {"items_per_step": {name: encoder.count(e)
                               for e, name in enumerate(cost.dims.encoders)},
            "hidden_share": round(plan.hidden_share, 4),
            "modelled_step_vs_uniform": round(plan.planned_time / plan.uniform_time, 4)
            if plan.uniform_time else 1.0,
            "steps": plan.steps, "slots": describe_slots(plan)}


AUTO_MARGIN = 0.01
"""The modelled gain "auto" asks of "bubbles" over "uniform" (a step at most 0.99x)."""


def picks_bubbles(typical: dict) -> bool:
    """Whether "auto" takes "bubbles" on a `typical_schedule`: its plan hides some encoder work
    and its step is modelled faster than "uniform"'s by `AUTO_MARGIN` or more. A plan that hides
    nothing runs "uniform"'s places streamed: what the model gives it then is message
    accounting, not the bubbles."""
    return (typical["hidden_share"] > 0
            and typical["modelled_step_vs_uniform"] <= 1 - AUTO_MARGIN)


def rank_stage_time(stage_time: list[float], sp: int = 1, tp: int = 1) -> list[float]:
    """A rank's share of each stage's modelled micro-batch (`stage_time`: the whole row on one
    rank): Ulysses splits it over sp ranks, AutoTP over tp. Their all-to-alls and all-reduces
    are left out: they only widen the gaps, so the model credits "bubbles" no idle time it lacks."""
    return [t / (sp * tp) for t in stage_time]


def auto_placement(cost, stage_time: list[float], micro_batches: int, samples: int,
                   items_per_sample: dict[str, float] | None = None,
                   overhead: CallOverhead = CPU_OVERHEAD) -> str:
    """`encoder_placement: "auto"` under pp > 1: "bubbles" where the model of a typical step
    of the data's mix (`typical_schedule`, its calls and messages priced) predicts a gain
    (`picks_bubbles`), else "uniform"."""
    typical = typical_schedule(cost, stage_time, micro_batches, samples, items_per_sample,
                               overhead)
    return "bubbles" if picks_bubbles(typical) else "uniform"
