"""The correctness oracle of every parallel plan: one process, no DeepSpeed, the same global batch.

- The global batch of each step comes from `dp` loaders in plain loader order, built here
  (`reference_step_keys`), not from what the ranks report: reordering, sequence sharding,
  resharding and packing under test cannot shape the batch they are judged against.
- The reference trains plain PyTorch on it: the same init, loss = sum of token losses / global
  target tokens, torch AdamW (with the config's weight decay), the same clipping, and the LR
  schedule the test writes itself (`warmup_cosine_lr`, from DeepSpeed's documented formula, never
  by calling DeepSpeed's or ds_omni's scheduler code).
- It checks its own targets against the raw rows (`check_targets`): packing and the sample
  processor are shared with the code under test, so an error there would be on both sides.
- It compares the losses, the full reduced gradients of every step (before clipping and Adam,
  which would hide a uniform error in gradient size: Adam's first steps are close to
  lr x sign(g)); a later step's at the parameters the ranks made it at (`Reference.grads_at`:
  float noise, which Adam amplifies in near-zero gradients, leaves the two sides' parameters
  apart by more than a gradient's rtol can absorb), the clipping coefficient where the ranks
  can see it (ZeRO-0), and the parameters after the last step, each tensor relative to the size
  of its own update.

The one import surface of three modules, by what they hold: `tests/oracle/reference.py` (the
one-process reference), `tests/oracle/compare.py` (the comparisons and their tolerances) and
`tests/oracle/ranks.py` (training on the ranks and what it records).
"""

from tests.oracle.compare import (GRAD_ATOL_FRAC, GRAD_RTOL, PARAM_NOISE_FRAC,  # noqa: F401
                                  PARAM_RTOL, PARAM_UPDATE_FRAC, assert_grads_match,
                                  assert_matches, assert_moved, assert_params_match,
                                  assert_split_work, merge_stages)
from tests.oracle.ranks import full_grads, full_params, omni_names, train_on_rank  # noqa: F401
from tests.oracle.reference import (END_OF_TURN, Reference, check_targets,  # noqa: F401
                                    reference_eval_losses, reference_step_keys, run_reference,
                                    stream_reference, warmup_cosine_lr, with_loader_order)
