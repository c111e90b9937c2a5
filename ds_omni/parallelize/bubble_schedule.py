"""Encoder work inside the pipeline's bubbles (`encoder_placement: "bubbles"`), on DeepSpeed.

`BubbleSchedule` is DeepSpeed's `TrainSchedule` with four instructions of ds_omni's own put into
its stream where `ds_omni.parallel.bubbles.plan_bubbles` says (registered in the engine's
instruction map): `EncodeForward` (an owner stage encodes items and sends their rows to stage 0),
`RecvRows` (stage 0, before the forward of a micro-batch: that micro-batch's rows),
`SendRowGrads` (stage 0, after the backward of a micro-batch: its rows' gradients to their
owners) and `EncodeBackward` (an owner: the encoder backward of items). Stage 0 holds the step's
rows as one leaf (in item order), as "uniform" does; each encoder parameter still has one owner
stage (`EncoderShards`), and the reduction over the stages runs at `ReduceTiedGrads`, after
every encoder backward. `StageClock` times the schedule's work for `bubble_fraction`.
More: docs/parallelism.md, "Encoder work in the pipeline's bubbles".

Dims: N rows of the step's items, D LLM hidden size.
"""

from __future__ import annotations

import contextlib

import time

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule

from ds_omni.parallel.bubbles import BubblePlan, plan_bubbles
from ds_omni.parallelize.joint import EncodeShare, JointPlan, plan_joint


class EncodeForward(schedule.PipeInstruction):
    """Encode items (indices into the step's items) and send their rows to stage 0."""


class RecvRows(schedule.PipeInstruction):
    """Stage 0: receive the rows of micro-batch `micro`'s items other stages encode."""


class SendRowGrads(schedule.PipeInstruction):
    """Stage 0: send the gradients of micro-batch `micro`'s rows to the stages that encoded them."""


class EncodeBackward(schedule.PipeInstruction):
    """Receive the rows' gradients of items and run the encoders' backward through them."""


class BubbleSchedule(schedule.TrainSchedule):
    """DeepSpeed's 1F1B TrainSchedule with the plan's encoder instructions (module docstring)."""

    def __init__(self, micro_batches, stages, stage_id, plan: BubblePlan, micro: list[int]):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.plan, self.micro = plan, micro
        mine = [i for i, s in enumerate(plan.stage_of) if s == stage_id]
        self.forward_at = _by_step(mine, plan.forward_at)
        self.backward_at = _by_step(sorted(mine, key=lambda i: (micro[i], i)), plan.backward_at)
        remote = {m for m, s in zip(micro, plan.stage_of) if s != 0}
        self.remote_micro = remote if stage_id == 0 else set()

    def steps(self):
        for step, cmds in enumerate(super().steps()):
            pre = []
            if step in self.forward_at:
                pre.append(EncodeForward(items=self.forward_at[step]))
            if step in self.backward_at:
                pre.append(EncodeBackward(items=self.backward_at[step]))
            out = pre
            for cmd in cmds:
                at_end = self.plan.steps in self.backward_at
                if isinstance(cmd, schedule.ReduceTiedGrads) and at_end:
                    out.append(EncodeBackward(items=self.backward_at[self.plan.steps]))
                if isinstance(cmd, schedule.LoadMicroBatch) and self.stage_id == 0:
                    m, _ = self._step_to_micro_batch(step)
                    if m in self.remote_micro:
                        out.append(RecvRows(micro=m))
                out.append(cmd)
                if isinstance(cmd, schedule.BackwardPass) and self.stage_id == 0:
                    m, _ = self._step_to_micro_batch(step)
                    if m in self.remote_micro:
                        out.append(SendRowGrads(micro=m))
            yield out


def _by_step(items: list[int], at: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i in items:
        out.setdefault(at[i], []).append(i)
    return out


class StageClock:
    """This stage's busy seconds in the step just run (forward, backward, encoder work) and the
    step's span, from the schedule's own timestamps: `bubble_fraction` = 1 - busy / span;
    `spans`: each timed piece (what, start, end) in seconds from the step's start (the timeline
    `benchmarks/pipeline_bubbles.py` draws)."""

    def __init__(self):
        self.start = self.end = 0.0
        self.busy = 0.0
        self.last_fraction: float | None = None
        self.spans: list[tuple[str, float, float]] = []

    def begin(self) -> None:
        self.start, self.busy, self.spans = time.perf_counter(), 0.0, []

    def finish(self) -> None:
        span = time.perf_counter() - self.start
        self.last_fraction = max(0.0, 1.0 - self.busy / span) if span > 0 else 0.0

    def timed(self, run, what: str = "work"):
        t0 = time.perf_counter()
        try:
            return run()
        finally:
            t1 = time.perf_counter()
            self.busy += t1 - t0
            self.spans.append((what, t0 - self.start, t1 - self.start))


class BubbleEncoding:
    """One step of "bubbles" placement on one rank: what the instructions read and write."""

    def __init__(self, joint: JointPlan, plan: BubblePlan, stage: int, group, hidden: int,
                 device, dtype, batches, encoders, processors):
        self.joint, self.plan, self.stage, self.group = joint, plan, stage, group
        self.device, self.dtype, self.hidden = device, dtype, hidden
        # batches: each micro-batch's items this pipeline encodes (`EncodeShare`)
        self.batches, self.encoders, self.processors = batches, encoders, processors
        starts = [0]
        for item in joint.items:
            starts.append(starts[-1] + item.rows)
        self.starts = starts  # item i's rows: [starts[i], starts[i + 1]) of `rows`
        self.outputs: dict[int, torch.Tensor] = {}  # item -> its rows [n, D], with their graph
        self.pending: list = []  # isend works to wait on before the reduction
        self.backwarded: set[int] = set()
        self.kept: dict = {}  # bf16: encoder parameter -> its gradients of the step so far
        self.rows = None
        self.received = 0  # stage 0: rows received from later stages this step
        if stage == 0:  # every row, a leaf: its gradient is what goes back
            self.rows = torch.zeros((starts[-1], hidden), device=device, dtype=dtype,
                                    requires_grad=True)
        self.index = ({k: torch.tensor(v, dtype=torch.long, device=device)
                       for k, v in _row_index(joint, starts).items()} if stage == 0 else {})

    def rows_for(self, micro: int, encoder: str) -> torch.Tensor | None:
        """Stage 0: [n, D] the rows of `micro`'s placeholders of `encoder`, or None."""
        index = self.index.get((micro, encoder))
        return None if index is None else self.rows.index_select(0, index)

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def encode(self, items: list[int]) -> None:
        """Encode `items`, one batch per encoder and backward slot (the items of one encoder call
        share its graph, so their backward must run in one pass); stage 0 keeps their rows,
        others send them."""
        for name in self.encoders:
            for at in sorted({self.plan.backward_at[i] for i in items}):
                mine = [i for i in items if self.joint.items[i].encoder == name
                        and self.plan.backward_at[i] == at]
                if mine:
                    self._encode_batch(name, mine)
        for i in items:
            if self.stage == 0:
                self.rows.data[self.starts[i]:self.starts[i + 1]] = self.outputs[i].detach()
            else:
                self.pending.append(dist.isend(self.outputs[i].detach().contiguous(),
                                               self._peer(0), group=self.group))

    def _encode_batch(self, name: str, mine: list[int]) -> None:
        """One call of encoder `name` on `mine`; each item's rows [n, D] kept with the graph."""
        encoder = self.encoders[name]
        its = [self.batches[self.joint.items[i].micro].items[name][self.joint.items[i].index]
               for i in mine]
        inputs = self.processors[name].collate(its)
        out = encoder({k: v.to(self.device) for k, v in inputs.items()}).to(self.dtype)
        taken = 0
        for i in mine:
            n = self.joint.items[i].rows
            self.outputs[i] = out[taken:taken + n]
            taken += n
        if taken != out.shape[0]:
            raise RuntimeError(f"encoder '{name}' produced {out.shape[0]} embeddings for "
                               f"items whose placeholders number {taken}")

    def recv_rows(self, micro: int) -> None:
        """Stage 0: the rows of `micro`'s items the other stages encode, into `rows`."""
        works = []
        for i, item in enumerate(self.joint.items):
            owner = self.plan.stage_of[i]
            if item.micro == micro and owner != 0:
                works.append(dist.irecv(self.rows.data[self.starts[i]:self.starts[i + 1]],
                                        self._peer(owner), group=self.group))
                self.received += item.rows
        for work in works:
            work.wait()

    def send_row_grads(self, micro: int) -> None:
        """Stage 0, after the backward of `micro`: its rows' gradients to their owners."""
        grad = self.rows.grad
        for i, item in enumerate(self.joint.items):
            owner = self.plan.stage_of[i]
            if item.micro == micro and owner != 0:
                piece = (grad[self.starts[i]:self.starts[i + 1]] if grad is not None else
                         torch.zeros((item.rows, self.hidden), device=self.device,
                                     dtype=self.dtype))
                self.pending.append(dist.isend(piece.contiguous(), self._peer(owner),
                                               group=self.group))

    def backward(self, items: list[int], clock: StageClock) -> None:
        """The encoders' backward through `items` (their gradients received from stage 0)."""
        grads = []
        for i in items:
            if self.stage == 0:
                grad = self.rows.grad
                grads.append(grad[self.starts[i]:self.starts[i + 1]] if grad is not None
                             else torch.zeros_like(self.outputs[i]))
            else:
                buf = torch.empty_like(self.outputs[i])
                dist.irecv(buf, self._peer(0), group=self.group).wait()
                grads.append(buf)
        keep = [(self.outputs[i], g) for i, g in zip(items, grads) if self.outputs[i].requires_grad]
        if keep:
            clock.timed(lambda: torch.autograd.backward([t for t, _ in keep],
                                                        [g for _, g in keep]), "encode_bwd")
        self.backwarded.update(items)

    def finish(self) -> None:
        """Before the reduction: every send delivered, every item's backward run."""
        for work in self.pending:
            work.wait()
        self.pending = []
        mine = {i for i, s in enumerate(self.plan.stage_of) if s == self.stage}
        if mine - self.backwarded:
            raise RuntimeError(f"stage {self.stage}: the encoder backward of items "
                               f"{sorted(mine - self.backwarded)[:5]} never ran this step")


def _row_index(joint: JointPlan, starts: list[int]) -> dict[tuple[int, str], list[int]]:
    out: dict[tuple[int, str], list[int]] = {}
    for i, item in enumerate(joint.items):
        out.setdefault((item.micro, item.encoder), []).extend(range(starts[i], starts[i + 1]))
    return out


def plan_step(micro_batches: list, item_cost, stages: int, stage_cost: list[float]):
    """(the step's items as `plan_joint` lists them, the bubble plan of them)."""
    joint = plan_joint([mb.items for mb in micro_batches], item_cost, stages)
    micro = [it.micro for it in joint.items]
    plan = plan_bubbles(micro, [it.cost for it in joint.items], stages, len(micro_batches),
                        stage_cost)
    return joint, plan


def install(engine, clock: StageClock) -> None:
    """Run `engine`'s training steps on `BubbleSchedule` (the step's plan read from
    `engine.module.step_inputs.joint`), the four instructions registered in its instruction map,
    and every instruction of the schedule timed on `clock` (idempotent)."""
    if getattr(engine, "_bubble_installed", False):
        return
    engine._bubble_installed = True

    def train_schedule():
        enc = engine.module.step_inputs.joint
        return BubbleSchedule(engine.micro_batches, engine.num_stages, engine.stage_id, enc.plan,
                              [it.micro for it in enc.joint.items])
    engine._train_schedule = train_schedule
    engine._ds_omni_instructions = {**type(engine)._INSTRUCTION_MAP, **INSTRUCTIONS}


def _exec_encode_forward(engine, items):
    enc = engine.module.step_inputs.joint
    engine.module.clock.timed(lambda: enc.encode(items), "encode_fwd")


def _exec_recv_rows(engine, micro):
    engine.module.step_inputs.joint.recv_rows(micro)


def _exec_send_row_grads(engine, micro):
    engine.module.step_inputs.joint.send_row_grads(micro)


def _exec_encode_backward(engine, items):
    enc = engine.module.step_inputs.joint
    with kept_apart_under_bf16(engine.optimizer, engine.module.joint.params, enc.kept):
        enc.backward(items, engine.module.clock)


@contextlib.contextmanager
def kept_apart_under_bf16(optimizer, params, kept: dict):
    """Under DeepSpeed's `BF16_Optimizer` the engine zeroes every bf16 gradient when a backward
    pass starts (and adds them into fp32 when it ends): an encoder backward in a cool-down slot,
    between two passes, would lose its gradients. They are made apart here (`params`' gradients
    None before, added into `kept` after) and put back before the reduction
    (`BubbleSetup.finish`), where "uniform" has them. Other optimizers: nothing to do."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    if not isinstance(optimizer, BF16_Optimizer):
        yield
        return
    for p in params:  # zero (cleared by a pass) or already kept
        p.grad = None
    yield
    for p in params:
        if p.grad is not None:
            kept[p] = p.grad if p not in kept else kept[p] + p.grad
            p.grad = None


INSTRUCTIONS = {EncodeForward: _exec_encode_forward, RecvRows: _exec_recv_rows,
                SendRowGrads: _exec_send_row_grads, EncodeBackward: _exec_encode_backward}


class BubbleSetup:
    """What a step needs to run "bubbles" placement on this rank: the step's plan (from the
    stages' modelled cost a micro-batch, `stage_cost`), the schedule installed on the engine,
    and the reduction after every encoder backward. Everything else (the owners, the replicas'
    marks and sync) is the "uniform" `JointSetup` it wraps (`joint`), read through it."""

    def __init__(self, joint, stage_cost: list[float], clock: StageClock):
        self.joint, self.stage_cost, self.clock = joint, list(stage_cost), clock
        self.hidden_share: float | None = None  # the last step's planned share in gaps
        self.items_in_gaps = 0  # items whose forward ran in a gap, since start (tests)
        self.rows_received = 0  # stage 0: rows received from later stages, since start (tests)

    def __getattr__(self, name):
        if name == "joint":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.joint, name)

    def start(self, micro_batches: list, device) -> BubbleEncoding:
        """The step's plan over this pipeline's items: under SP its shard's, under the encoder
        pool those the pool gave this rank (`EncodeShare`, as "uniform"), whose rows stage 0's
        resharding (or pool) all-to-all takes to their placeholders; under TP each TP rank's
        pipeline encodes every item, so each stage 0 rank holds every row."""
        j = self.joint
        shares = [EncodeShare(mb) for mb in micro_batches]
        joint, plan = plan_step(shares, j.item_cost, j.stages, self.stage_cost)
        if self.hidden_share is None and j.stage == 0 and dist.get_rank() == 0:
            print(f"ds-omni: encoder_placement \"bubbles\": {plan.hidden_share:.0%} of the "
                  f"first step's modelled encoder work fits the pipeline's idle slots; the "
                  "rest runs where \"uniform\" runs it (modelled step "
                  f"{plan.planned_time / max(plan.uniform_time, 1e-30):.2f}x of uniform's)")
        self.hidden_share = plan.hidden_share
        self.items_in_gaps += sum(1 for i, s in enumerate(plan.stage_of)
                                  if s == j.stage and plan.hidden_forward[i])
        return BubbleEncoding(joint, plan, j.stage, j.group, j.hidden, device,
                              j.encoders_dtype(), shares, j.encoders, j.processors)

    def bind(self, engine) -> None:
        install(engine, self.clock)

    def finish(self, enc: BubbleEncoding) -> None:
        enc.finish()
        self.rows_received += enc.received
        for p, grad in enc.kept.items():  # bf16: the cool-down's gradients, kept apart
            p.grad = grad
        for p in self.joint.params:  # an encoder with no item here: a zero gradient, as "uniform"
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.joint.shards.reduce_grads()

def bubble_metrics(module) -> dict:
    """On a pipeline stage: every stage's `bubble_fraction` of the step just run (its share of
    the step idle, `StageClock`; a list by stage, gathered over this rank's pipeline: every rank
    of it calls this) and, under "bubbles", the step's planned `bubble_hidden_share`."""
    clock = getattr(module, "clock", None)
    if clock is None or clock.last_fraction is None:
        return {}
    group = module._grid.get_pipe_parallel_group()
    mine = torch.tensor([clock.last_fraction], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    out = {"bubble_fraction": [round(float(t), 4) for t in every]}
    share = getattr(module.joint, "hidden_share", None)
    return out if share is None else {**out, "bubble_hidden_share": round(share, 4)}
