"""parallel.ep without processes: the MoE auxiliary loss against HF's, the AutoEP section of the
DeepSpeed config, the bad inputs (before any collective), and AutoEP's expert layout -> HF's."""

import json

import pytest
import torch

from ds_omni.cli import main
from ds_omni.config import ParallelConfig
from ds_omni.errors import ConfigError, LaunchError
from tests import oracle, plants
from tests.fixtures import ds_config, tiny_config, tiny_config_dict

MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
       "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
       "max_position_embeddings": 256, "tie_word_embeddings": False,
       "output_router_logits": True, "router_aux_loss_coef": 0.5}


def _moe_model(tmp_path, **llm):
    from ds_omni.model.build import build_model
    cfg = tiny_config(str(tmp_path))
    cfg.model.llm.config = {**MOE, **llm}
    return cfg, build_model(cfg.model)


def _samples(cfg, built, n=3):
    from ds_omni.data.build import build_loader
    loader = build_loader(cfg, built, num_micro=1)
    samples = loader.load_samples(loader.next_step().keys[:n])
    loader.close()
    return samples


def _hf_loss_sum(built, sample):
    """HF's loss on one sample alone (mean token loss + coef x HF's load_balancing_loss_func),
    times its target count: Qwen3-MoE's decoder run by HF's own forward (SDPA attention), its
    router logits from HF's output recorder."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    from ds_omni.data.packing import pack
    from ds_omni.model.convert import _plain_attention
    hf = built.model.hf_model
    one = pack([sample], built.item_processors)
    keep = one.target_positions()
    with _plain_attention(hf.config):
        out = hf.model.language_model(inputs_embeds=built.model.embed(one),
                                      position_ids=one.position_ids, output_router_logits=True)
    logits = hf.lm_head(out.last_hidden_state)[0, keep]
    ce = torch.nn.functional.cross_entropy(logits, one.targets[0, keep])
    cfg = hf.config.get_text_config()
    aux = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
    return len(keep) * (ce + cfg.router_aux_loss_coef * aux), len(keep) * aux


@pytest.mark.slow  # about 5 s: builds the model, runs each sample through HF apart
def test_aux_loss_and_gradients_are_hfs_per_sample(tmp_path):
    """A packed row of 3 samples: loss_sum = sum_s targets_s x HF's loss on s alone, and the same
    gradients (router and experts included)."""
    from ds_omni.data.packing import pack
    cfg, built = _moe_model(tmp_path)
    samples = _samples(cfg, built)
    model = built.model
    model.zero_grad()
    got = model(pack(samples, built.item_processors)).loss_sum
    got.backward()
    got = got.detach()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    parts = [_hf_loss_sum(built, s) for s in samples]
    want = sum(p[0] for p in parts)
    want.backward()
    want = want.detach()
    assert float(sum(p[1].detach() for p in parts)) * 0.5 > 1e-3 * float(want)  # aux matters
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    atol = oracle.GRAD_ATOL_FRAC * max(float(g.abs().max()) for g in ours.values())
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[name], p.grad, rtol=oracle.GRAD_RTOL, atol=atol,
                                       msg=name)
    assert any("mlp.gate" in n for n in ours) and any("experts.down_proj" in n for n in ours)


def test_no_aux_loss_without_output_router_logits(tmp_path):
    """HF adds the aux loss only when the config asks (output_router_logits): so does ds_omni."""
    cfg, built = _moe_model(tmp_path, output_router_logits=False)
    assert built.model.backbone.router_aux is None


def test_autoep_section_keeps_hfs_router():
    from transformers import Qwen3MoeConfig
    from ds_omni.parallelize.expert_parallel import autoep_section
    fields = {k: v for k, v in MOE.items() if k != "model_type"}
    section = autoep_section(Qwen3MoeConfig(**fields), 2)
    assert section["preset_model"] == "qwen3_moe" and section["autoep_size"] == 2
    assert section["top_k"] == 2 and section["route_norm"] is False  # HF's norm_topk_prob
    assert section["moe_layer_pattern"].startswith(r"backbone\.")  # the backbone only
    assert autoep_section(Qwen3MoeConfig(**fields, norm_topk_prob=True), 4)["route_norm"] is True


def _plan(tmp_path, world, **parallel):
    from ds_omni.train.setup import plan_run
    cfg = tiny_config(str(tmp_path), global_batch_size=2 * world)
    cfg.model.llm.config = dict(MOE)
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return plan_run(cfg, ds_config(1), world)


def test_plan_derives_the_autoep_section(tmp_path):
    from ds_omni.train.setup import describe_plan
    plan, ds = _plan(tmp_path, 4, ep=2)
    assert plan.ep == 2 and plan.ep_group_ranks() == [[0, 1], [2, 3]]
    assert ds["expert_parallel"]["autoep_size"] == 2
    shown = describe_plan(tiny_config(str(tmp_path)), plan, ds)["plan"]  # what `ds-omni plan` prints
    assert shown["ep"] == 2 and shown["ep_groups"] == [[0, 1], [2, 3]]


def test_plan_prints_the_expert_groups_and_which_cross_nodes():
    """`ds-omni plan --gpus-per-node` lists the expert-parallel groups (each MoE layer's
    all-to-alls) and the ranks holding the same experts (their gradients' reduction), and says
    which of them cross nodes: ep2 x dp4 on 2-GPU nodes keeps the all-to-alls in a node."""
    from ds_omni.config import ReorderConfig
    from ds_omni.parallel.plan import ParallelPlan
    plan = ParallelPlan.from_config(ParallelConfig(ep=2), 4, ReorderConfig())
    layout = plan.layout(gpus_per_node=2)
    assert layout["ep_groups"] == [[0, 1], [2, 3]]
    assert layout["expert_data_groups"] == [[0, 2], [1, 3]]
    assert layout["cross_node"]["ep_groups"] == []
    assert layout["cross_node"]["expert_data_groups"] == [[0, 2], [1, 3]]
    wide = ParallelPlan.from_config(ParallelConfig(ep=4, sp=2), 8, ReorderConfig())
    assert wide.layout(gpus_per_node=2)["cross_node"]["ep_groups"] == [[0, 1, 2, 3],
                                                                       [4, 5, 6, 7]]
    assert "ep_groups" not in ParallelPlan.from_config(ParallelConfig(), 4,
                                                       ReorderConfig()).layout(2)


def test_zero3_with_ep_is_refused_before_a_run_that_would_export(tmp_path):
    """ZeRO-3 under ep trains (the ep2_zero3 parity case) but its expert checkpoint does not
    export: with train.export_hf on, start-up says so, not the end of the run."""
    from ds_omni.train.setup import plan_run
    cfg = tiny_config(str(tmp_path), global_batch_size=4)
    cfg.model.llm.config = dict(MOE)
    cfg.parallel.ep = 2
    cfg.train.export_hf = True
    with pytest.raises(ConfigError, match=r"parallel.ep=2 cannot be combined with "
                                          r"zero_optimization.stage=3 .*train.export_hf to false"):
        plan_run(cfg, ds_config(3), 2)
    cfg.train.export_hf = False
    plan, ds = plan_run(cfg, ds_config(3), 2)
    assert plan.ep == 2 and ds["zero_optimization"]["stage"] == 3


def test_ep_not_dividing_the_experts(tmp_path):
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide the LLM's 4 experts"):
        _plan(tmp_path, 3, ep=3)


def test_ep_not_dividing_dp(tmp_path):
    with pytest.raises(LaunchError, match="parallel.ep=2 does not divide the data-parallel"):
        _plan(tmp_path, 3, ep=2)


def test_ep_with_sequence_parallelism_draws_ep_from_the_sp_x_dp_ranks(tmp_path):
    """ep inside dp x sp: the expert-parallel groups are consecutive ranks of the sequence x
    data group, as DeepSpeed's AutoEP draws them under an SP mpu (an EP group may be an SP
    group: ep=2 x sp=2 on 2 ranks); ZeRO 0 and 3 are refused with it, tp and pp still are."""
    plan, ds = _plan(tmp_path, 4, ep=2, sp=2)
    assert plan.dp == 2 and plan.ep_group_ranks() == [[0, 1], [2, 3]]
    assert ds["expert_parallel"]["autoep_size"] == 2
    plan, _ = _plan(tmp_path, 2, ep=2, sp=2)
    assert plan.dp == 1 and plan.ep_group_ranks() == [[0, 1]]
    plan, _ = _plan(tmp_path, 4, ep=4, sp=2)
    assert plan.ep_group_ranks() == [[0, 1, 2, 3]]
    with pytest.raises(LaunchError, match=r"does not divide the data-parallel x sequence-parallel "
                                          r"x tensor-parallel ranks of a pipeline stage, "
                                          r"1 x 2 x 1 = 2"):
        _plan(tmp_path, 2, ep=4, sp=2)
    from ds_omni.train.setup import plan_run
    cfg = tiny_config(str(tmp_path), global_batch_size=8)
    cfg.model.llm.config = dict(MOE)
    cfg.parallel.ep, cfg.parallel.sp = 2, 2
    for stage in (0, 3):
        with pytest.raises(ConfigError, match=f"when zero_optimization.stage={stage}"):
            plan_run(cfg, ds_config(stage), 4)


def test_ep_with_pipeline_draws_ep_inside_each_stage(tmp_path):
    """pp x ep: the EP groups are drawn inside each stage's data-parallel ranks, and AutoEP finds
    the MoE blocks by the names a pipeline stage gives them; under sp too, each stage's EP group
    drawn from its dp x sp ranks (the aux statistics summed over the row's SP ranks)."""
    plan, ds = _plan(tmp_path, 8, ep=2, pp=2)
    assert plan.ep_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.expert_data_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ds["expert_parallel"]["moe_layer_pattern"] == r"\d+\.layer\.mlp"
    plan, _ = _plan(tmp_path, 8, ep=2, pp=2, sp=2)
    assert plan.ep_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_ep_with_tensor_parallelism_shards_the_attention_and_folds_the_experts(tmp_path):
    """ep x tp: the HF plan without its expert entries converts (AutoTP splits the attention;
    the experts are AutoEP's, folded over TP), the engine's own AutoEP stays off; with them the
    plan is what DeepSpeed refuses; a family with no tp plan at all is refused before any
    process group, naming both degrees' way out."""
    from transformers import AutoConfig
    from ds_omni.errors import ModelError
    from ds_omni.parallelize.tensor_parallel import check_tensor_parallel, tp_plan_of
    plan, ds = _plan(tmp_path, 4, ep=2, tp=2)
    assert plan.ep_group_ranks() == [[0, 1], [2, 3]] and "expert_parallel" not in ds
    config = AutoConfig.for_model(**MOE)
    assert not any(".experts" in k for k in tp_plan_of(config, experts_apart=True))
    check_tensor_parallel(config, 2, "model.llm", experts_apart=True)
    with pytest.raises(ModelError, match=r"AutoTP cannot shard model.llm \(qwen3_moe\).*"
                                         r"'moe_tp_experts', 'packed_colwise'"):
        check_tensor_parallel(config, 2, "model.llm")
    config.base_model_tp_plan = None
    with pytest.raises(ModelError, match=r"parallel.tp=2: model.llm \(qwen3_moe\) has no "
                                         r"HuggingFace tensor-parallel plan"):
        check_tensor_parallel(config, 2, "model.llm", experts_apart=True)


@pytest.mark.parametrize("model_type, says", [("deepseek_v3", "sigmoid scores"),
                                               ("deepseek_v2", "routed_scaling_factor")])
def test_a_preset_whose_hf_router_is_not_softmax_top_k_is_refused(model_type, says):
    """DeepSeek-V2/V3 have AutoEP presets, but HF's routers there are not the softmax top-k at
    scale 1 that ds_omni writes into AutoEP's section: refused, saying how they route."""
    from transformers import AutoConfig
    from ds_omni.parallelize.expert_parallel import autoep_section
    config = AutoConfig.for_model(model_type, n_routed_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError, match=rf"parallel.ep=2: the LLM \({model_type}\) routes "
                                          rf"tokens .*{says}.*set parallel.ep to 1"):
        autoep_section(config, 2)


def test_ep_below_one():
    with pytest.raises(ConfigError, match="parallel.ep must be >= 1"):
        ParallelConfig(ep=0)


def test_family_without_a_preset_names_the_presets(tmp_path, capsys):
    """A dense LLM (Llama) under parallel.ep: ds-omni train stops at start-up naming AutoEP's
    presets."""
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["parallel"] = {"ep": 2}
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds_config(1)))
    import os
    os.environ["WORLD_SIZE"] = "2"
    try:
        code = main(["train", "--config", str(c), "--deepspeed", str(d)])
    finally:
        del os.environ["WORLD_SIZE"]
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "'llama' has none" in err and "qwen3_moe" in err and "mixtral" in err, err


def test_hf_expert_state_gathers_hfs_layout():
    """AutoEP's shards (w1 gate, w3 up [E/ep, I, H], w2 [E/ep, H, I]) of two EP ranks -> HF's
    gate_up_proj [E, 2I, H] and down_proj [E, H, I], the router's weight under HF's name."""
    from ds_omni.parallelize.expert_parallel import hf_expert_state
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(4, 2 * 3, 5, generator=g), torch.randn(4, 5, 3, generator=g)
    router = torch.randn(4, 5, generator=g)
    head = "backbone.layers.0.mlp."

    def shard(r):  # rank r's tensors, as AutoEP repacks them (ep_repack.py, gate_up_first)
        e = slice(2 * r, 2 * r + 2)
        return {head + "experts.w1": gate_up[e, :3], head + "experts.w3": gate_up[e, 3:],
                head + "experts.w2": down[e], head + "router.gate.weight": router,
                head + "shared_experts.up_proj.weight": router,  # Qwen3.5-MoE's, AutoEP's name
                head + "shared_experts_gate.weight": router[:1],
                "backbone.norm.weight": torch.ones(5)}
    ranks = [shard(0), shard(1)]
    owner = {id(t): (k, ) for r in ranks for k, t in r.items()}

    def gather(t):
        (key,) = owner[id(t)]
        return [r[key] for r in ranks]
    out = hf_expert_state(ranks[0], 2, gather)
    assert set(out) == {head + "experts.gate_up_proj", head + "experts.down_proj",
                        head + "gate.weight", "backbone.norm.weight",
                        head + "shared_expert.up_proj.weight", head + "shared_expert_gate.weight"}
    assert torch.equal(out[head + "experts.gate_up_proj"], gate_up)
    assert torch.equal(out[head + "experts.down_proj"], down)
    assert torch.equal(out[head + "gate.weight"], router)


def test_expert_checkpoint_files_read_back_in_hfs_layout(tmp_path):
    """AutoEP's checkpoint layout (one file per layer and expert, the router under its names in
    the model states) -> OmniModel keys with HF's fused experts; ZeRO-3's is refused."""
    from ds_omni.errors import ModelError
    from ds_omni.model.expert_checkpoint import expert_checkpoint_state, is_expert_checkpoint
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(4, 6, 5, generator=g), torch.randn(4, 5, 3, generator=g)
    router, head = torch.randn(4, 5, generator=g), "backbone.layers.0.mlp."
    module = {head + "router.gate.weight": router, head + "gate.gate.weight": router,
              "backbone.norm.weight": torch.ones(5)}
    torch.save({"module": module, "ds_config": {"zero_optimization": {"stage": 2}}},
               tmp_path / "mp_rank_00_model_states.pt")
    assert not is_expert_checkpoint(tmp_path)
    for e in range(4):
        torch.save({f"{head}experts.w1.{e}": gate_up[e, :3], f"{head}experts.w3.{e}": gate_up[e, 3:],
                    f"{head}experts.w2.{e}": down[e]},
                   tmp_path / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
    assert is_expert_checkpoint(tmp_path)
    state = expert_checkpoint_state(tmp_path)
    assert set(state) == {head + "gate.weight", head + "experts.gate_up_proj",
                          head + "experts.down_proj", "backbone.norm.weight"}
    assert torch.equal(state[head + "experts.gate_up_proj"], gate_up)
    assert torch.equal(state[head + "experts.down_proj"], down)
    torch.save({"module": module, "ds_config": {"zero_optimization": {"stage": 3}}},
               tmp_path / "mp_rank_00_model_states.pt")
    with pytest.raises(ModelError, match="ZeRO-3"):
        expert_checkpoint_state(tmp_path)


@pytest.mark.slow  # about 5 s
def test_aux_loss_with_decoder_layers_recomputed(tmp_path):
    """Activation checkpointing of the LLM: the router logits recorded in the forward carry the
    aux loss's gradient through the recomputed layers (the hooks do not record again)."""
    from ds_omni.data.packing import pack
    cfg, built = _moe_model(tmp_path)
    model, mb = built.model, pack(_samples(cfg, built), built.item_processors)

    def run():
        model.zero_grad()
        out = model(mb)
        out.loss_sum.backward()
        return out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}
    plain = run()
    model.set_checkpointing({"llm"})
    recomputed = run()
    torch.testing.assert_close(recomputed[0], plain[0], rtol=0, atol=0)
    assert recomputed[1].keys() == plain[1].keys()
    for name, grad in plain[1].items():
        torch.testing.assert_close(recomputed[1][name], grad, rtol=1e-6, atol=0, msg=name)


def test_aux_loss_with_sequence_parallelism_plans(tmp_path):
    """An MoE LLM with the aux loss on and an SP degree plans (its aux is summed over the SP
    ranks, `test_sharded_aux_is_hfs_on_the_whole_sample`)."""
    from ds_omni.train.setup import plan_run
    cfg = tiny_config(str(tmp_path))
    cfg.model.llm.config = dict(MOE)
    cfg.parallel.sp = 2
    plan, _ = plan_run(cfg, ds_config(1), 2)
    assert plan.sp == 2


def _row(seed: int):
    """Router logits of 2 MoE layers [2, T, E] (a leaf), over a row of 2 samples and padding
    (T = 16: 5 + 7 + 4 tokens), its bounds and targets (some tokens untrained)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 16, 4, generator=g).requires_grad_()
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    targets = torch.randint(0, 50, (1, 16), generator=g)
    targets[0, [0, 6, 7]] = -100
    targets[0, 12:] = -100  # padding
    return logits, cu, targets


def _hf_row_aux(aux, logits, cu, targets):
    """sum_s targets_s x HF's load_balancing_loss_func on sample s alone (its layers' logits)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    total = 0
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = int((targets[0, lo:hi] >= 0).sum())
        if n:
            total = total + n * load_balancing_loss_func(tuple(logits[:, lo:hi]),
                                                         aux.num_experts, aux.top_k)
    return total


def test_sharded_aux_is_hfs_on_the_whole_sample():
    """A row split over 2 simulated SP shards (8 tokens each, a sample across the cut): each
    shard's stats, summed (what `sp_aux_sum`'s all-reduces do), give HF's per-sample aux of the
    whole row, value and gradient; one shard's stats alone (no reduction) do not."""
    from ds_omni.model.moe_aux import RouterAux, aux_from_stats, per_sample_aux, shard_stats
    aux = RouterAux(coef=0.5, num_experts=4, top_k=2)
    logits, cu, targets = _row(0)
    want = _hf_row_aux(aux, logits, cu, targets)
    (want_grad,) = torch.autograd.grad(want, logits)
    shards = [shard_stats(aux, list(logits[:, lo:lo + 8]), cu, targets[:, lo:lo + 8], lo)
              for lo in (0, 8)]
    got = aux_from_stats(aux, shards[0] + shards[1])
    (got_grad,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5,
                               atol=1e-6 * float(want_grad.abs().max()))
    assert float(want_grad.abs().max()) > 0
    whole = per_sample_aux(aux, list(logits), cu, targets)  # a row held whole: the same
    torch.testing.assert_close(whole, want, rtol=1e-6, atol=0)
    alone = sum(aux_from_stats(aux, s).detach() for s in shards)  # the plant: no reduction
    assert abs(float(alone) - float(want.detach())) > 1e-3 * abs(float(want.detach()))


@pytest.mark.slow  # about 3.5 s: builds the model
def test_hf_experts_count_the_picks_of_hfs_own_router(tmp_path):
    check_hf_experts_count(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("hf_expert_count"))
def test_plant_hf_expert_count(plant, tmp_path):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_hf_experts_count(tmp_path)


def check_hf_experts_count(tmp_path):
    """parallel.ep=1 keeps HF's MoE blocks: `count_hf_experts` makes their experts modules count
    the tokens their router sent each expert (what `expert_load` reports), equal to the top-k of
    the router logits HF's own recorder returns from the same forward."""
    from ds_omni.data.packing import pack
    from ds_omni.model.convert import _plain_attention
    from ds_omni.parallelize.expert_parallel import HF_COUNTER, count_hf_experts
    cfg, built = _moe_model(tmp_path)
    assert count_hf_experts(built.model.backbone) == MOE["num_hidden_layers"]
    assert count_hf_experts(built.model.backbone) == 0  # counting once, however often asked
    one = pack(_samples(cfg, built), built.item_processors)
    hf = built.model.hf_model
    with _plain_attention(hf.config), torch.no_grad():
        out = hf.model.language_model(inputs_embeds=built.model.embed(one),
                                      position_ids=one.position_ids, output_router_logits=True)
    counters = [getattr(m, HF_COUNTER) for m in built.model.backbone.modules()
                if hasattr(m, HF_COUNTER)]
    for layer, (logits, counted) in enumerate(zip(out.router_logits, counters)):
        picks = logits.topk(MOE["num_experts_per_tok"], dim=-1).indices
        assert counted.tolist() == torch.bincount(picks.reshape(-1), minlength=4).tolist(), layer
        assert int(counted.sum()) == MOE["num_experts_per_tok"] * one.position_ids.shape[-1]


def test_zigzag_sharded_aux_is_hfs_on_the_whole_sample():
    """Under parallel.cp a rank's tokens are the ring's zigzag slots (`zigzag_layout`): each
    shard's stats at its row positions, summed, give HF's per-sample aux of the whole row; read
    as contiguous offsets (the plant `moe_aux_contiguous_under_ring`) they do not."""
    from ds_omni.model.moe_aux import RouterAux, aux_from_stats, shard_stats
    from ds_omni.parallel.zigzag import zigzag_layout
    aux = RouterAux(coef=0.5, num_experts=4, top_k=2)
    logits, cu, targets = _row(0)
    want = _hf_row_aux(aux, logits, cu, targets)
    order = torch.as_tensor(zigzag_layout([5, 7, 4], 2).order)  # [16]: no padding added
    slots = [order[lo:lo + 8] for lo in (0, 8)]
    zigzag = [shard_stats(aux, list(logits[:, p]), cu, targets[:, p], 0, p) for p in slots]
    got = aux_from_stats(aux, zigzag[0] + zigzag[1])
    (got_grad,) = torch.autograd.grad(got, logits, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5,
                               atol=1e-6 * float(want_grad.abs().max()))
    flat = [shard_stats(aux, list(logits[:, p]), cu, targets[:, p], lo)
            for lo, p in zip((0, 8), slots)]
    contiguous = aux_from_stats(aux, flat[0] + flat[1]).detach()
    assert abs(float(contiguous) - float(want)) > 1e-3 * abs(float(want))
