"""Planted errors of the bf16 launch (tests/dist/test_bf16.py)."""

import contextlib
from contextlib import contextmanager

from tests.plants.registry import patched, plant


# ------------------------------------------------------------------- bf16 (tests/dist/test_bf16.py)
@plant("bf16_encoder_grads_dropped", "under bf16 and \"uniform\" placement the encoders' "
       "gradients, made after the pipeline's last backward, do not reach DeepSpeed's fp32 "
       "gradients (the doubt of issue 26: what BF16_Optimizer does unless ds_omni adds them)",
       "bf16")
def _bf16_encoder_grads_dropped(rank: int):
    from ds_omni.train import step
    yield from patched(step, "late_grads_to_master",
                       lambda f: lambda optimizer: contextlib.nullcontext())


@plant("bf16_lm_head_in_loss_fn", "the pipeline's LM head and loss made in the engine's "
       "`loss_fn`, after the last stage's output, as before the fix: DeepSpeed's backward "
       "prologue, which fires when the first gradient reaches the module's output, then zeroes "
       "the head's bf16 gradient already made (BF16_Optimizer.clear_lp_grads)", "bf16")
def _bf16_lm_head_in_loss_fn(rank: int):
    from ds_omni.parallelize import pipeline
    from ds_omni.train import step as train_step

    def head_output(self, inputs):  # the last stage's output: the normed hidden and the index
        hidden, _, _, index = inputs
        return self.norm(hidden), index

    def loss_fn(head, normed, index):  # what HeadStage.forward does after the norm
        step = head.step_inputs
        loss_sum = head.loss_sum(normed, step.batches[int(index[0])].targets)
        step.sums.append(loss_sum.detach())
        return loss_sum * step.scale

    def pipeline_step(original):  # the engine is built before a plant goes in: set its loss_fn
        def planted(engine, *args):
            for head in (m for m in engine.module.modules() if isinstance(m, pipeline.HeadStage)):
                engine.module.loss_fn = lambda out, _labels, head=head: loss_fn(head, *out)
            return original(engine, *args)
        return planted

    with contextlib.ExitStack() as stack:
        stack.enter_context(contextmanager(patched)(pipeline.HeadStage, "forward",
                                                     lambda f: head_output))
        stack.enter_context(contextmanager(patched)(train_step, "_pipeline_step", pipeline_step))
        yield
