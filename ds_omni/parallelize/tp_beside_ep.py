"""Tensor parallelism beside expert parallelism (issue 37): the attention (and dense MLP layers)
of an MoE LLM split over tp, its experts left to AutoEP over the ranks of dp x tp. DeepSpeed
0.19.8's AutoTP refuses these families' HF tp plans as a whole (their 'packed_colwise' and
'moe_tp_experts' styles), so the check here is the arithmetic the split needs, not AutoTP's
converter. The plan checks (`ds_omni.train.setup.plan_run`, the simulator's `SimPlan`) call
`check_tp` for every LLM.
"""

from __future__ import annotations

from ds_omni.errors import ModelError
from ds_omni.parallelize.tensor_parallel import check_tensor_parallel


def check_tp(text_config, tp: int, ep: int, where: str) -> None:
    """parallel.tp can shard this LLM: with ep > 1 an MoE LLM's attention heads (query and
    key/value) and dense MLP width divide by tp; otherwise AutoTP's own check."""
    if ep == 1 or not getattr(text_config, "num_experts", None):
        check_tensor_parallel(text_config, tp, where)
        return
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    width = getattr(text_config, "intermediate_size", None)
    if heads % tp or kv_heads % tp or (width and width % tp):
        ok = [d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0
              and (not width or width % d == 0)]
        raise ModelError(f"parallel.tp={tp} beside parallel.ep={ep} splits the attention of "
                         f"{where} ({getattr(text_config, 'model_type', '?')}): tp must divide "
                         f"its {heads} query heads, {kv_heads} key/value heads and dense MLP "
                         f"width {width}; tp can be one of {ok}")
