"""What HF forwards do outside their modules (`ds_omni.model.outside`), followed by the backbone.

Soft-capped logits, Granite's embedding and logit multipliers, Cohere's logit scale and
Chameleon's suppressed tokens are applied in HF's order wherever ds_omni makes logits or a loss
(`Backbone.head`, the pipeline's last stage); the sweep checks the logits of every family with a
recipe, this file the rule itself, loss and gradients on a packed row, and the refusals.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_omni.model import outside
from ds_omni.model.families import generic
from ds_omni.model.omni import final_norm


def test_logit_rule_is_hfs_op_sequence():
    """Each rule applies HF's own ops in HF's order (bitwise), and suppressed tokens get the
    dtype's minimum and no gradient."""
    x = torch.randn(5, 11, requires_grad=True)
    capped = outside.LogitRule(multiplier=0.2, softcap=3.0)(x)
    assert torch.equal(capped, torch.tanh(x * 0.2 / 3.0) * 3.0)
    assert torch.equal(outside.LogitRule(divisor=4.0)(x), x / 4.0)
    masked = outside.LogitRule(suppressed=(2, 7))(x)
    assert (masked[:, [2, 7]] == torch.finfo(x.dtype).min).all()
    masked.sum().backward()
    assert not x.grad[:, [2, 7]].any() and (x.grad[:, 0] == 1).all()
    assert outside.LogitRule()(x) is x


def test_rules_are_read_from_the_classes_that_apply_them():
    """A Granite LLM's embedding multiplier is its own forward's; logit scaling and logit_scale
    are the head owner's forward's (Granite's causal LM, Cohere's; LLaVA-NeXT's applies none)."""
    from transformers import (AutoConfig, CohereForCausalLM, GraniteForCausalLM, GraniteModel,
                              LlavaNextForConditionalGeneration)
    granite = AutoConfig.for_model("granite", embedding_multiplier=12.0, logits_scaling=4.0)
    assert outside.embed_scale(GraniteModel, granite) == 12.0
    assert outside.logit_rule(GraniteForCausalLM, granite) == outside.LogitRule(divisor=4.0)
    # Granite Vision 3 (LLaVA-NeXT around a Granite LLM): HF's LLaVA-NeXT head scales nothing
    assert outside.logit_rule(LlavaNextForConditionalGeneration, granite) == outside.LogitRule()
    cohere = AutoConfig.for_model("cohere", logit_scale=0.0625)
    assert outside.logit_rule(CohereForCausalLM, cohere).multiplier == 0.0625


def test_final_norm_under_its_aliases():
    """Persimmon (Fuyu's LLM) names its final norm `final_layernorm`."""
    norm = nn.LayerNorm(4)
    persimmon_like = nn.Module()
    persimmon_like.final_layernorm = norm
    assert final_norm(persimmon_like) is norm
    assert final_norm(nn.Module()) is None


def test_what_is_not_followed_is_refused_with_the_reason():
    from transformers import AutoConfig
    inkling = generic.config_problem(AutoConfig.for_model("inkling_mm_model"))
    assert "hybrid" in inkling and "embedding_multiplier" not in inkling  # muP: followed
    gemma4 = AutoConfig.for_model("gemma4")  # its default: per-layer input embeddings
    assert "hidden_size_per_layer_input" in generic.config_problem(gemma4)
    gemma4.text_config.hidden_size_per_layer_input = 0
    gemma4.text_config.use_bidirectional_attention = "vision"
    assert "both ways" in generic.config_problem(gemma4)
    assert "window AND (causal OR block)" in generic.config_problem(gemma4)  # Gemma 4 Unified's
    large4 = AutoConfig.for_model("mistral_large4")  # its default: every indexer runs, no KV reuse
    assert generic.config_problem(large4) is None
    large4.text_config.indexer_types = ["full"] + ["shared"] * 71
    assert "top-k pick of an earlier indexer layer" in generic.config_problem(large4)
    large4.text_config.indexer_types = ["full"] * 72
    large4.text_config.kv_source_layers = [0, 0] + list(range(2, 72))
    assert "latent keys and values of an earlier layer" in generic.config_problem(large4)


@pytest.mark.parametrize("model_type,extra", [
    ("gemma3_text", {"final_logit_softcapping": 1.0}),
    ("granite", {"embedding_multiplier": 12.0, "logits_scaling": 4.0}),
])
def test_loss_and_gradients_equal_hf_on_a_packed_row(model_type, extra):
    """A soft-capped head (Gemma 3's causal LM) and Granite's multipliers: the packed row's summed
    loss and every gradient equal HF's own forward run per sample (which applies them itself);
    the pipeline's last stage makes the same loss; without the rules the loss moves."""
    from types import SimpleNamespace
    from transformers import AutoConfig, AutoModelForCausalLM
    from ds_omni.model.omni import backbone_of, summed_token_loss
    from ds_omni.parallelize.pipeline import HeadStage, StepInputs
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, vocab_size=50,
                                  attn_implementation="sdpa", tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    lengths = [9, 2, 12]
    ids = torch.randint(0, 50, (sum(lengths),))
    # next-token targets per sample, none past a sample's end (built here, not by the packer)
    targets = torch.cat([torch.cat([p[1:], torch.tensor([-100])]) for p in ids.split(lengths)])
    reference = sum(F.cross_entropy(hf(input_ids=p[None]).logits[0].float(), t,
                                    ignore_index=-100, reduction="sum")
                    for p, t in zip(ids.split(lengths), targets.split(lengths)))
    reference.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    hf.zero_grad()

    backbone = backbone_of(hf.model, hf.lm_head, hf)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 9, 11, 23], dtype=torch.int32)
    keep = (targets != -100).nonzero().squeeze(1)
    hidden = backbone(backbone.embed_tokens(ids[None]), positions, cu, 12)
    loss = summed_token_loss(backbone.head, hidden, targets[None], keep)
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-5)
    for name, param in hf.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        head = HeadStage(SimpleNamespace(backbone=backbone), StepInputs())
        last = head.loss_sum(hidden, targets[None])
        assert torch.equal(last, loss.detach())
        backbone.logit_rule, backbone.embed_scale = outside.LogitRule(), 1.0
        hidden = backbone(backbone.embed_tokens(ids[None]), positions, cu, 12)
        plain = summed_token_loss(backbone.head, hidden, targets[None], keep)
    with pytest.raises(AssertionError):  # the comparison above sees the rules
        torch.testing.assert_close(plain, reference.detach(), rtol=1e-6, atol=1e-5)


def test_inklings_mup_head_equals_hf():
    """Inkling divides the final hidden states by logits_mup_width_multiplier before its head and
    keeps the first unpadded_vocab_size logits: the rule read from its class gives HF's loss and
    gradients (its hybrid layers stay HF's: the backbone refuses them), the pipeline's last stage
    the same loss; without the rule the loss moves."""
    from types import SimpleNamespace
    from transformers import AutoConfig, AutoModelForCausalLM
    from ds_omni.model.omni import summed_token_loss
    from ds_omni.parallelize.pipeline import HeadStage, StepInputs
    config = AutoConfig.for_model(
        "inkling_text", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, vocab_size=64, unpadded_vocab_size=50,
        logits_mup_width_multiplier=4.0, sliding_window_size=4, rel_extent=16, d_rel=4,
        max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    rule = outside.logit_rule(type(hf), config)
    assert (rule.hidden_divisor, rule.vocab) == (4.0, 50)
    ids = torch.randint(0, 50, (1, 9))
    targets = torch.cat([ids[0, 1:], torch.tensor([-100])])[None]
    reference = F.cross_entropy(hf(input_ids=ids).logits[0], targets[0], reduction="sum")
    reference.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    hf.zero_grad()
    hidden = hf.model(input_ids=ids).last_hidden_state  # [1, 9, D], normed
    keep = torch.arange(8)
    loss = summed_token_loss(lambda h: rule.head(hf.lm_head, h), hidden, targets, keep)
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-5)
    for name, param in hf.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    backbone = SimpleNamespace(norm=None, lm_head=hf.lm_head, logit_rule=rule, layers=[])
    with torch.no_grad():
        last = HeadStage(SimpleNamespace(backbone=backbone), StepInputs()).loss_sum(hidden, targets)
        assert torch.equal(last, loss.detach())
        plain = summed_token_loss(hf.lm_head, hidden, targets, keep)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(plain, reference.detach(), rtol=1e-6, atol=1e-5)
