"""Issue 37's bad plans, each refused by `plan_run` (before any process group or collective) with
one error that names the degree, the number it must divide and what to set: a degree that does not
divide the world, the layers of a stage, the heads or the experts; a family neither AutoTP nor HF's
tensor-parallel plan can shard; ZeRO-2/3 with pp (the table's)."""

from __future__ import annotations

import pytest
import torch

from ds_omni.errors import CompositionError, ConfigError, DsOmniError, LaunchError, ModelError
from tests.fixtures import ds_config, tiny_config
from tests.unit.parallelize.test_expert_parallel import MOE

GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256,
        "vocab_size": 512, "tie_word_embeddings": False}

CASES = {  # name: (parallel, ZeRO stage, world, LLM config (None: the tiny Llama), error, words)
    "world": ({"sp": 2}, 1, 3, None, LaunchError, ["world size 3", "parallel.sp"]),
    "pp_over_layers": ({"pp": 3}, 1, 3, None, LaunchError,
                       ["parallel.pp=3", "only 2 decoder layers", "parallel.pp <= 2"]),
    "pp_tp_over_layers": ({"pp": 3, "tp": 2}, 1, 6, None, LaunchError,
                          ["parallel.pp=3", "only 2 decoder layers"]),
    "tp_heads": ({"tp": 3}, 1, 3, None, ModelError,
                 ["parallel.tp=3 must divide", "4 query heads", "one of [1, 2, 4]"]),
    "sp_heads": ({"sp": 3}, 1, 3, None, ModelError,
                 ["parallel.sp=3 must divide", "4 query heads", "one of [1, 2, 4]"]),
    "tp_sp_heads": ({"tp": 2, "sp": 4}, 1, 8, None, ModelError,
                    ["parallel.tp=2 x parallel.sp=4", "4 query heads"]),
    "tp_max_sequence_sp_heads": ({"tp": 2, "max_sequence_sp": 4}, 1, 8, None, ModelError,
                                 ["parallel.tp=2 x parallel.max_sequence_sp=4", "4 query heads"]),
    "ep_experts": ({"ep": 3, "tp": 2}, 1, 6, MOE, ConfigError,
                   ["parallel.ep=3 does not divide the LLM's 4 experts"]),
    "ep_stage": ({"ep": 4, "pp": 2}, 1, 4, MOE, LaunchError,
                 ["parallel.ep=4", "ranks of a pipeline stage, 2 x 1 x 1 = 2"]),
    "tp_family_without_a_plan": ({"tp": 2}, 1, 2, GPT2, ModelError,
                                 ["parallel.tp=2", "(gpt2) has no HuggingFace tensor-parallel "
                                  "plan", "set parallel.tp to 1"]),
    "pp_zero2": ({"pp": 2}, 2, 2, None, CompositionError,
                 ["parallel.pp=2 cannot be combined with zero_optimization.stage=2",
                  "ds_configs/zero1.json"]),
    "pp_zero3": ({"pp": 2}, 3, 2, None, CompositionError,
                 ["parallel.pp=2 cannot be combined with zero_optimization.stage=3",
                  "ds_configs/zero1.json"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_degree_is_one_clear_error_before_any_collective(tmp_path, name):
    from ds_omni.train.setup import plan_run
    parallel, zero, world, llm, error, words = CASES[name]
    cfg = tiny_config(str(tmp_path), global_batch_size=48)  # divisible by every dp here
    if llm is not None:
        cfg.model.llm.config = dict(llm)
    for key, value in parallel.items():  # field by field, as `--set` overrides are
        setattr(cfg.parallel, key, value)
    with pytest.raises(DsOmniError) as refused:
        plan_run(cfg, ds_config(zero), world)
    message = str(refused.value)
    assert isinstance(refused.value, error), f"{type(refused.value).__name__}: {message}"
    assert all(word in message for word in words), message
    assert "\n" not in message and not torch.distributed.is_initialized()
