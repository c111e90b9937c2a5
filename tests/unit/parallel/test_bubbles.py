"""The bubble planner (`ds_omni.parallel.bubbles`) in one process: its port of DeepSpeed's 1F1B
schedule, the idle share of the bare schedule, and plans whose replay keeps every item's forward
before its micro-batch's forward on stage 0 and every backward after stage 0's."""

import random

import pytest

from ds_omni.parallel import bubbles


def test_step_micro_is_deepspeeds_train_schedule():
    from deepspeed.runtime.pipe import schedule
    for stages in (1, 2, 3, 4):
        for micro in (1, 2, 4, 7):
            for stage in range(stages):
                steps = list(schedule.TrainSchedule(micro, stages, stage).steps())
                assert len(steps) == bubbles.schedule_steps(stages, micro)
                for step, cmds in enumerate(steps):
                    work = [c for c in cmds
                            if isinstance(c, (schedule.ForwardPass, schedule.BackwardPass))]
                    m, forward = bubbles.step_micro(step, stage, stages)
                    if 0 <= m < micro:
                        kind = schedule.ForwardPass if forward else schedule.BackwardPass
                        assert len(work) == 1 and isinstance(work[0], kind), (stages, micro, step)
                    else:
                        assert not work, (stages, micro, stage, step)


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8)])
def test_bare_schedule_idles_p_minus_one_slots_of_each_kind(stages, micro):
    line = bubbles.base_timeline(stages, micro, [1.0] * stages, [2.0] * stages)
    assert line.end == pytest.approx((micro + stages - 1) * 3.0)
    assert line.bubble_fractions() == pytest.approx([(stages - 1) * 3.0 / line.end] * stages)


def _items(seed: int, micro: int, per_micro: int, scale: float):
    rng = random.Random(seed)
    mbs = [m for m in range(micro) for _ in range(per_micro)]
    return mbs, [rng.uniform(0.2, 1.0) * scale for _ in mbs]


@pytest.mark.parametrize("stages,scale", [(2, 0.5), (4, 0.5), (4, 3.0), (4, 40.0)])
def test_plans_keep_the_order_the_step_needs(stages, scale):
    """Replayed with its own instructions: an item's rows reach stage 0 before the forward of
    its micro-batch there, its backward follows stage 0's backward of it; the plan never models
    a step slower than "uniform"'s, and work too big for the bubbles is still placed (some of
    it not hidden), not refused."""
    micro = 6
    mbs, costs = _items(stages, micro, 3, scale)
    stage_cost = [3.0] * stages
    plan = bubbles.plan_bubbles(mbs, costs, stages, micro, stage_cost)
    fwd, bwd = [1.0] * stages, [2.0] * stages
    streams = bubbles.streams_of(plan, mbs, costs, fwd, bwd)
    line = bubbles.timeline(streams, plan.steps)
    sent, forward_at = {}, {}
    for s, stream in enumerate(streams):
        for (kind, key, step), (start, _) in zip(stream, line.spans[s]):
            if kind == "send" and key[0] in ("rows", "rgrad"):
                sent[key] = start
    for (kind, key, step), (start, end) in zip(streams[0], line.spans[0]):
        m, forward = bubbles.step_micro(step, 0, stages)
        if kind == "work" and forward and 0 <= m < micro and key == fwd[0]:
            forward_at.setdefault(m, start)
    for i, m in enumerate(mbs):
        if plan.stage_of[i] != 0:
            assert sent[("rows", i)] <= forward_at[m] + 1e-9, (i, m)
    assert plan.planned_time <= plan.uniform_time * (1 + 1e-9)
    assert 0.0 <= plan.hidden_share <= 1.0
    if scale >= 40:
        assert plan.hidden_share < 0.5  # the bubbles hold only part of it
    else:
        assert plan.hidden_share > 0.5
    assert not any(plan.hidden_forward[i] for i, m in enumerate(mbs) if m == 0)  # needed first


def test_describe_slots_lists_every_item_once():
    mbs, costs = _items(0, 4, 2, 1.0)
    plan = bubbles.plan_bubbles(mbs, costs, 4, 4, [3.0] * 4)
    rows = bubbles.describe_slots(plan)
    assert sum(sum(r["forward_steps"].values()) for r in rows) == len(mbs)
    assert sum(sum(r["backward_steps"].values()) for r in rows) == len(mbs)


class _Cost:
    """A cost model of one encoder whose typical item costs `item` (the FLOPs unit)."""

    def __init__(self, item: float):
        from types import SimpleNamespace
        self.item = item
        self.dims = SimpleNamespace(encoders={"vision": SimpleNamespace(dummy_len=16)})

    def encoder_cost(self, name, lengths):
        return [self.item for _ in lengths]


def test_auto_picks_bubbles_where_the_model_predicts_a_gain():
    stages = [3.0] * 4
    assert bubbles.auto_placement(_Cost(1.0), stages, 4, 2) == "bubbles"
    # no encoder work to hide: nothing to gain
    assert bubbles.auto_placement(_Cost(0.0), stages, 4, 2) == "uniform"
