"""parallel.tp without a process group: the rank layout (tp innermost), the groups that cross
nodes, and every bad input refused with a ds_omni error before anything is launched."""

import pytest

from ds_omni.config import ParallelConfig, ReorderConfig
from ds_omni.errors import ConfigError, ModelError
from ds_omni.parallel.plan import ParallelPlan, RankCoords


def test_tp_is_innermost_then_sp_then_dp():
    plan = ParallelPlan(world_size=8, dp=2, sp=2, tp=2)
    assert plan.coords(1) == RankCoords(pp_stage=0, dp_rank=0, sp_rank=0, tp_rank=1)
    assert plan.coords(2) == RankCoords(pp_stage=0, dp_rank=0, sp_rank=1, tp_rank=0)
    assert plan.coords(4) == RankCoords(pp_stage=0, dp_rank=1, sp_rank=0, tp_rank=0)
    assert all(plan.rank_of(plan.coords(r)) == r for r in range(8))
    assert plan.tp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.sp_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.dp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_says_which_groups_cross_nodes():
    plan = ParallelPlan.from_config(ParallelConfig(tp=2), 4, ReorderConfig())
    assert (plan.dp, plan.tp) == (2, 2)
    layout = plan.layout(gpus_per_node=2)
    assert layout["tp_groups"] == [[0, 1], [2, 3]]
    assert layout["dp_groups"] == [[0, 2], [1, 3]]
    # TP's per-layer all-reduces stay inside a node; only the data-parallel reduction crosses
    assert layout["cross_node"] == {"tp_groups": [], "sp_groups": [],
                                    "dp_groups": [[0, 2], [1, 3]],
                                    "reorder_groups": [[0, 2], [1, 3]]}
    assert "cross_node" not in plan.layout()
    plain = ParallelPlan.from_config(ParallelConfig(), 4, ReorderConfig()).layout(4)
    assert "tp_groups" not in plain and plain["cross_node"] == {
        "sp_groups": [], "dp_groups": [], "reorder_groups": []}


def test_the_loaders_unit_is_the_tp_group():
    """Both TP ranks of a group have the group's data-parallel rank: they read the same rows."""
    plan = ParallelPlan.from_config(ParallelConfig(tp=2), 4, ReorderConfig())
    assert [plan.coords(r).dp_rank for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("kwargs, match", [
    ({"tp": 0}, r"parallel.tp must be >= 1"),
])
def test_bad_tp_config_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kwargs)


def test_tp_composes_with_sp_and_with_the_pool():
    ParallelConfig(tp=2, sp=2)
    ParallelConfig(tp=2, encoder_pool="dp")
    ParallelConfig(tp=2, sp=2, encoder_pool="dp")  # each TP rank pools over its dp x sp ranks
    ParallelConfig(tp=2, max_sequence_sp=2)  # blocks over the dp ranks of one TP rank
    ParallelConfig(tp=2, cp=2)  # each ring inside the sequence ranks of one TP rank


def test_world_size_must_fit_tp():
    from ds_omni.errors import LaunchError
    with pytest.raises(LaunchError,
                       match=r"parallel.sp x parallel.tp x parallel.pp = 1 x 2 x 1 = 2"):
        ParallelPlan.from_config(ParallelConfig(tp=2), 3, ReorderConfig())
    with pytest.raises(LaunchError, match=r"parallel.dp x sp x tp x pp = 3 x 1 x 2 x 1 = 6 "):
        ParallelPlan.from_config(ParallelConfig(dp=3, tp=2), 4, ReorderConfig())


def _llama(**over):
    from transformers import LlamaConfig
    fields = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2)
    return LlamaConfig(**{**fields, **over})


def test_tp_that_does_not_divide_the_heads_names_part_heads_and_degrees():
    from ds_omni.parallelize.tensor_parallel import check_tensor_parallel
    with pytest.raises(ModelError, match=r"model.llm \(llama\) has 4 query heads, 2 key/value "
                                         r"heads and an MLP of 128; tp can be one of \[1, 2, 4\]"):
        check_tensor_parallel(_llama(), 3, "model.llm")


def test_gqa_with_fewer_kv_heads_than_tp_is_allowed_and_says_what_deepspeed_does(caplog):
    """tp=4 over 2 KV heads: allowed (DeepSpeed's AutoTP splits attention by KV head groups, so
    ranks 2 and 3 hold zero-width attention shards; exact, shown by the one_kv_head case of
    tests/dist/test_tensor_parallel.py), and the warning says so; tp <= KV heads has none. The
    check itself is silent (the plan search runs it per candidate): who plans a run says it
    once (tests/unit/cli/test_plan_cli.py)."""
    import logging
    from ds_omni.parallelize.tensor_parallel import check_tensor_parallel, tp_beyond_kv_heads
    with caplog.at_level(logging.WARNING):
        check_tensor_parallel(_llama(), 2, "model.llm")
        check_tensor_parallel(_llama(), 4, "model.llm")
    assert not caplog.records
    assert tp_beyond_kv_heads(_llama(), 2) is None
    note = tp_beyond_kv_heads(_llama(), 4)
    assert ("parallel.tp=4 exceeds the LLM's 2 key/value heads" in note
            and "first 2 tensor-parallel ranks only" in note), note


def test_a_family_autotp_cannot_shard_is_refused():
    from transformers import AutoConfig
    from ds_omni.parallelize.tensor_parallel import check_tensor_parallel
    with pytest.raises(ModelError, match=r"\(gpt2\) has no HuggingFace tensor-parallel plan"):
        check_tensor_parallel(AutoConfig.for_model("gpt2"), 2, "model.llm")
    odd = _llama()
    odd.base_model_tp_plan = {"layers.*.self_attn.q_proj": "local_colwise"}
    with pytest.raises(ModelError, match=r"AutoTP cannot shard model.llm \(llama\)"):
        check_tensor_parallel(odd, 2, "model.llm")
    lfm2 = AutoConfig.for_model("lfm2", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ModelError, match=r"\(lfm2\) splits no column- and row-parallel .*"
                                         r"\['embed_tokens'\]"):
        check_tensor_parallel(lfm2, 2, "model.llm")  # its plan names the embedding alone


def test_qwen3_vl_borrows_qwen3s_plan():
    """Qwen3-VL's text model (HF's plan: its embedding alone) gets Qwen3's plan, q/k norms
    whole with their gradients summed; Qwen3-VL-MoE's (without the norms) Qwen3-MoE's."""
    from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig
    from ds_omni.parallelize.tensor_parallel import check_tensor_parallel, tp_plan_of
    text = AutoConfig.for_model("qwen3_vl_text", num_attention_heads=4, num_key_value_heads=2)
    assert text.base_model_tp_plan == {"embed_tokens": "embedding_rowwise"}
    assert tp_plan_of(text) == Qwen3Config.base_model_tp_plan
    assert tp_plan_of(text)["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    check_tensor_parallel(text, 2, "model.llm")
    moe = AutoConfig.for_model("qwen3_vl_moe_text")
    assert "layers.*.self_attn.q_norm" not in moe.base_model_tp_plan
    assert tp_plan_of(moe) == {**moe.base_model_tp_plan, **{
        f"layers.*.self_attn.{n}_norm": "replicated_with_grad_allreduce" for n in "qk"}}
    assert tp_plan_of(moe) == Qwen3MoeConfig.base_model_tp_plan


def test_zero3_beside_sp_and_engine_autotp_are_refused(tmp_path):
    from tests.fixtures import ds_config, tiny_config
    from ds_omni.train.setup import plan_run
    cfg = tiny_config(str(tmp_path))
    cfg.parallel = ParallelConfig(tp=2)
    plan_run(cfg, ds_config(3), 2)  # AutoTP under ZeRO-3 (refused beside sp alone)
    cfg.parallel = ParallelConfig(tp=2, sp=2)
    with pytest.raises(ConfigError, match=r"parallel.tp=2 cannot be combined with "
                       r"zero_optimization.stage=3 when parallel.sp=2"):
        plan_run(cfg, ds_config(3), 4)
    cfg.parallel = ParallelConfig(tp=2)
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size"):
        plan_run(cfg, {**ds_config(2), "tensor_parallel": {"autotp_size": 2}}, 2)
    plan, ds = plan_run(cfg, ds_config(2), 4)
    assert (plan.dp, plan.tp) == (2, 2) and ds["gradient_accumulation_steps"] == 2
    # TP on an encoder: the engine's switch would shard every module, so it is refused at tp 1
    cfg.parallel = ParallelConfig()
    with pytest.raises(ConfigError, match=r"autotp_size=2, which would shard the encoders"):
        plan_run(cfg, {**ds_config(2), "tensor_parallel": {"autotp_size": 2}}, 2)
    plan_run(cfg, ds_config(3), 2)  # ZeRO-3 without tp is fine


def test_plan_run_checks_the_heads_before_any_launch(tmp_path):
    from tests.fixtures import ds_config, tiny_config
    from ds_omni.train.setup import plan_run
    cfg = tiny_config(str(tmp_path))
    cfg.parallel = ParallelConfig(tp=8)  # the tiny Llama has 4 heads
    with pytest.raises(ModelError, match=r"parallel.tp=8 must divide .* model.llm \(llama\)"):
        plan_run(cfg, ds_config(2), 8)


def test_tp_x_sp_layout_and_zero_groups():
    """tp innermost, then sp, then dp; ZeRO's sequence x data groups are the dp x sp ranks of
    one TP rank, printed (with which of them cross nodes) by `ds-omni plan`."""
    plan = ParallelPlan.from_config(ParallelConfig(tp=2, sp=2), 8, ReorderConfig())
    assert (plan.dp, plan.sp, plan.tp) == (2, 2, 2)
    assert plan.seq_data_group_ranks() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    layout = plan.layout(gpus_per_node=4)
    assert layout["tp_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["sp_groups"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["seq_data_groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # TP and SP stay inside a 4-GPU node; data parallelism (and ZeRO's group) crosses
    assert layout["cross_node"] == {"tp_groups": [], "sp_groups": [],
                                    "dp_groups": [[0, 4], [1, 5], [2, 6], [3, 7]],
                                    "seq_data_groups": [[0, 2, 4, 6], [1, 3, 5, 7]],
                                    "reorder_groups": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    # without tp the group is every rank of the stage, as before, and not printed
    sp_only = ParallelPlan.from_config(ParallelConfig(sp=2), 4, ReorderConfig())
    assert sp_only.seq_data_group_ranks() == [[0, 1, 2, 3]]
    assert "seq_data_groups" not in sp_only.layout()


def test_tp_x_sp_must_split_the_heads_twice():
    from ds_omni.parallelize.tensor_parallel import check_tp_with_sp
    check_tp_with_sp(_llama(), 2, 2, "model.llm")  # 4 heads / 2 / 2; KV 2 / 2, repeated for sp
    with pytest.raises(ModelError, match=r"parallel.tp=2 x parallel.sp=4: model.llm \(llama\) "
                                         r"has 4 query heads and 2 key/value heads.*\(tp, sp\) "
                                         r"can be one of \[\(2, 2\)\]"):
        check_tp_with_sp(_llama(), 2, 4, "model.llm")
    with pytest.raises(ModelError, match=r"tp the key/value heads"):  # 1 KV head over tp=2
        check_tp_with_sp(_llama(num_key_value_heads=1), 2, 2, "model.llm")


def test_plan_run_checks_tp_x_sp_before_any_launch(tmp_path):
    from tests.fixtures import ds_config, tiny_config
    from ds_omni.train.setup import plan_run
    cfg = tiny_config(str(tmp_path))
    cfg.parallel = ParallelConfig(tp=2, sp=2)
    plan, ds = plan_run(cfg, ds_config(2), 4)  # the tiny Llama: 4 heads, 2 KV heads
    assert (plan.dp, plan.sp, plan.tp) == (1, 2, 2) and ds["sequence_parallel_size"] == 2
    cfg.parallel = ParallelConfig(tp=2, sp=4)
    with pytest.raises(ModelError, match=r"parallel.tp=2 x parallel.sp=4"):
        plan_run(cfg, ds_config(2), 8)
    # per-sequence SP: its largest block splits each TP rank's heads again, as sp would
    cfg.parallel, cfg.data.max_seq_len = ParallelConfig(tp=2, max_sequence_sp=4), 64
    with pytest.raises(ModelError, match=r"parallel.tp=2 x parallel.max_sequence_sp=4"):
        plan_run(cfg, ds_config(2), 8)
    cfg.parallel = ParallelConfig(tp=2, max_sequence_sp=2)
    assert plan_run(cfg, ds_config(2), 8)[0].sequence_block_ranks(2, 2) == [[4, 6], [5, 7]]
