"""`BubbleSchedule`'s instruction streams (no process group): DeepSpeed's 1F1B stream with each
item's encoder forward and backward once on its stage, stage 0's receive of a micro-batch's rows
before its forward and the send of their gradients after its backward, every encoder backward
before the reduction."""

import random

import pytest
from deepspeed.runtime.pipe import schedule

from ds_omni.parallel.bubbles import plan_bubbles
from ds_omni.parallelize.bubble_schedule import (BubbleSchedule, EncodeBackward, EncodeForward,
                                                 RecvRows, SendRowGrads)


@pytest.mark.parametrize("stages,micro,scale", [(2, 4, 1.0), (4, 4, 1.0), (4, 6, 20.0)])
def test_streams_run_every_item_once_in_the_order_the_step_needs(stages, micro, scale):
    rng = random.Random(stages * micro)
    mbs = [m for m in range(micro) for _ in range(rng.randint(1, 3))]
    costs = [rng.uniform(0.2, 1.0) * scale for _ in mbs]
    plan = plan_bubbles(mbs, costs, stages, micro, [3.0] * stages)
    forwards, backwards = [], []
    for stage in range(stages):
        cmds = [c for step in BubbleSchedule(micro, stages, stage, plan, mbs).steps() for c in step]
        plain = [c for step in schedule.TrainSchedule(micro, stages, stage).steps() for c in step]
        ours = (EncodeForward, EncodeBackward, RecvRows, SendRowGrads)
        assert [repr(c) for c in cmds if not isinstance(c, ours)] == list(map(repr, plain))
        fwd = [i for c in cmds if isinstance(c, EncodeForward) for i in c.items]
        bwd = [i for c in cmds if isinstance(c, EncodeBackward) for i in c.items]
        assert all(plan.stage_of[i] == stage for i in fwd + bwd)
        forwards += fwd
        backwards += bwd
        reduce_at = next(k for k, c in enumerate(cmds) if isinstance(c, schedule.ReduceTiedGrads))
        assert all(k < reduce_at for k, c in enumerate(cmds) if isinstance(c, EncodeBackward))
        if stage == 0:
            _check_stage0(cmds, plan, mbs)
    assert sorted(forwards) == sorted(backwards) == list(range(len(mbs)))


def _check_stage0(cmds, plan, mbs) -> None:
    remote = {m for m, s in zip(mbs, plan.stage_of) if s != 0}
    forwards = [k for k, c in enumerate(cmds) if isinstance(c, schedule.ForwardPass)]
    backwards = [k for k, c in enumerate(cmds) if isinstance(c, schedule.BackwardPass)]
    for m in sorted(remote):
        recv = next(k for k, c in enumerate(cmds) if isinstance(c, RecvRows) and c.micro == m)
        send = next(k for k, c in enumerate(cmds) if isinstance(c, SendRowGrads) and c.micro == m)
        assert recv < forwards[m] and send > backwards[m], m
    own = {i for i, s in enumerate(plan.stage_of) if s == 0}
    for k, c in enumerate(cmds):  # its own items: encoded before, backward after, their forward
        if isinstance(c, EncodeForward):
            assert all(k < forwards[mbs[i]] for i in c.items if i in own)
        if isinstance(c, EncodeBackward):
            assert all(k > backwards[mbs[i]] for i in c.items if i in own)


def test_items_of_one_call_backward_in_different_slots():
    """Items encoded in one step but backwarded in different cool-down slots: each encoder call
    holds only items of one slot, so every slot's backward runs (one call's graph backwarded in
    two passes would fail the second)."""
    from types import SimpleNamespace

    import torch

    from ds_omni.parallel.bubbles import BubblePlan
    from ds_omni.parallelize.bubble_schedule import BubbleEncoding, StageClock
    from ds_omni.parallelize.joint import Item, JointPlan

    class Collate:
        def collate(self, items):
            return {"x": torch.stack(items)}

    encoder = torch.nn.Linear(3, 4)
    encoders = {"vision": lambda inputs: encoder(inputs["x"])}
    batches = [SimpleNamespace(items={"vision": [torch.randn(3), torch.randn(3)]})]
    joint = JointPlan([Item(0, "vision", 0, 1, 1.0), Item(0, "vision", 1, 1, 1.0)], [0, 0], 1)
    plan = BubblePlan([0, 0], [0, 0], [3, 5], [True, True], [True, True], 1, 1)
    enc = BubbleEncoding(joint, plan, 0, None, 4, "cpu", torch.float32, batches, encoders,
                         {"vision": Collate()})
    enc.encode([0, 1])
    enc.rows.grad = torch.ones_like(enc.rows)
    enc.backward([0], StageClock())
    enc.backward([1], StageClock())
    x = torch.stack(batches[0].items["vision"])
    assert torch.allclose(encoder.weight.grad, torch.ones(2, 4).T @ x)


def test_the_clock_keeps_each_timed_piece_for_the_timeline_picture():
    """`StageClock.spans`: (what, start, end) from the step's start, in order, what
    `benchmarks/pipeline_bubbles.py` draws; busy is their sum; a new step starts them anew."""
    import time
    from ds_omni.parallelize.bubble_schedule import StageClock
    clock = StageClock()
    clock.begin()
    clock.timed(lambda: time.sleep(0.01), "forward")
    time.sleep(0.01)
    clock.timed(lambda: time.sleep(0.01), "encode_bwd")
    clock.finish()
    (w1, a1, b1), (w2, a2, b2) = clock.spans
    assert (w1, w2) == ("forward", "encode_bwd")
    assert 0 <= a1 < b1 < a2 < b2 and a2 - b1 >= 0.009  # the idle gap between them shows
    assert clock.busy == pytest.approx((b1 - a1) + (b2 - a2))
    assert 0 < clock.last_fraction < 1
    clock.begin()
    assert clock.spans == []
