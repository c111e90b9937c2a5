"""Where DeepSpeed needs zero-weight dummy encoder passes (pure); the zero gradient that stands in
for them elsewhere is checked on the tiny LLaVA (test_family_llava.py)."""

from ds_omni.parallelize.embedding import encoder_dummies_needed


def test_dummy_passes_only_where_deepspeed_reduces_in_hook_order():
    table = [
        ({"zero_optimization": {"stage": 3}}, False, True),  # gathers at every encoder run
        ({"zero_optimization": {"stage": 2}}, False, True),  # reduces every backward, hook order
        ({"zero_optimization": {"stage": 1, "overlap_comm": True}}, False, True),
        ({"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}, False,
         True),
        ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}, False, True),
        ({"zero_optimization": {"stage": 1}}, False, False),  # one reduction, parameter order
        ({"zero_optimization": {"stage": 0}}, False, False),
        ({}, False, False),
        ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}, True, False),  # pipeline
    ]
    for ds_config, pipeline, needed in table:
        assert encoder_dummies_needed(ds_config, pipeline) is needed, ds_config
