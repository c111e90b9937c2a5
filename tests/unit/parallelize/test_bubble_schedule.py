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
