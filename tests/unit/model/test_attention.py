"""Packed attention, tier 1: the per-sample kernel against plain attention over each sample, and
the KV-head repetition Ulysses needs, with DeepSpeed's head scatter simulated by slicing heads per
rank. (The SP all-to-all itself runs multi-process in tests/dist.)

References repeat KV heads the way HF's `repeat_kv` does (query head h reads KV head h // (H / Hkv))
and call SDPA on plain multi-head tensors, so they share no GQA code path with the kernel.

Dims: T packed tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ds_omni.model.attention import PackedAttention, packed_attention, repeat_kv_for_sp


def _qkv(h: int, hkv: int, t: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, t, d, generator=g)  # [1, H, T, D]
    k, v = (torch.randn(1, hkv, t, d, generator=g).requires_grad_() for _ in range(2))  # [1, Hkv, T, D]
    return q, k, v


def _mha(q, k, v, scale=None):
    """Causal attention with KV heads repeated as HF's repeat_kv does: [1, H, L, D]."""
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=True, scale=scale)


@pytest.mark.parametrize("sp", [2, 4, 8])
@pytest.mark.parametrize("hkv", [1, 2, 4, 8])
def test_repeated_kv_keeps_each_query_heads_kv_head(hkv, sp):
    """Each of sp ranks takes H/sp query heads and its share of the repeated KV heads (what
    DistributedAttention's all-to-all hands it); together they give the GQA output and gradients."""
    h, t, d = 8, 6, 4
    q, k, v = _qkv(h, hkv, t, d, seed=10 * hkv + sp)
    w = torch.randn(1, h, t, d)
    ref = _mha(q, k, v)  # [1, H, T, D]
    ref_grads = torch.autograd.grad((ref * w).sum(), (k, v))
    kr, vr = (repeat_kv_for_sp(x, h, sp) for x in (k, v))  # [1, lcm(Hkv, sp), T, D]
    assert kr.shape[1] == math.lcm(hkv, sp) and kr.shape[1] % sp == 0
    hq, hk = h // sp, kr.shape[1] // sp  # heads per rank
    outs = [_mha(q[:, r * hq:(r + 1) * hq], kr[:, r * hk:(r + 1) * hk], vr[:, r * hk:(r + 1) * hk])
            for r in range(sp)]
    out = torch.cat(outs, dim=1)  # [1, H, T, D]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for got, want in zip(torch.autograd.grad((out * w).sum(), (k, v)), ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # the copies' gradients add up


def test_packed_attention_is_attention_over_each_sample():
    h, hkv, d, cu = 4, 2, 8, [0, 5, 12, 20, 21]
    q, k, v = _qkv(h, hkv, cu[-1], d, seed=0)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    out = PackedAttention()(q, k, v, cu_seqlens, 8, 0.3, 0.0)  # [1, T, H, D]
    ref = torch.cat([_mha(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.3)
                     for a, b in zip(cu[:-1], cu[1:])], dim=2).transpose(1, 2)  # [1, T, H, D]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    via_hf, weights = packed_attention(None, q, k, v, scaling=0.3, cu_seqlens=cu_seqlens, max_seqlen=8)
    assert weights is None and torch.equal(via_hf, out)


def test_no_sample_attends_to_another():
    q, k, v = _qkv(4, 2, 12, 8, seed=1)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = PackedAttention()(q, k, v, cu, 7, None, 0.0)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, :5] += 1.0  # change only the first sample's keys and values
    v2[:, :, :5] -= 1.0
    out2 = PackedAttention()(q, k2, v2, cu, 7, None, 0.0)
    assert torch.equal(out[:, 5:], out2[:, 5:]) and not torch.allclose(out[:, :5], out2[:, :5])


def test_unknown_kernel():
    with pytest.raises(ValueError, match=r"unknown attention kernel 'flash'; choose one of"):
        PackedAttention("flash")


def test_auto_picks_torch_varlen_on_cuda_and_sdpa_elsewhere():
    from ds_omni.errors import ConfigError
    from ds_omni.model.attention import choose_kernel
    assert choose_kernel("auto", varlen=True, flash_attn=True) == "varlen"
    assert choose_kernel("auto", varlen=False, flash_attn=True) == "sdpa"
    assert choose_kernel("flash_attention_2", varlen=True, flash_attn=True) == "flash_attention_2"
    assert choose_kernel("eager", varlen=True, flash_attn=False) == "sdpa"
    for asked, have in (("varlen", {"varlen": False, "flash_attn": True}),
                        ("flash_attention_2", {"varlen": True, "flash_attn": False})):
        with pytest.raises(ConfigError, match="use 'auto'"):
            choose_kernel(asked, **have)


def test_auto_on_this_machine_matches_sdpa():
    """On CPU "auto" resolves to the per-sample SDPA path: same outputs as asking for "sdpa"."""
    from ds_omni.model.attention import PackedAttention
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    auto = PackedAttention("auto")
    assert auto.kernel == ("varlen" if torch.cuda.is_available() else "sdpa")
    torch.testing.assert_close(auto(q, k, v, cu, 7, None, 0.0),
                               PackedAttention("sdpa")(q, k, v, cu, 7, None, 0.0))


def test_varlen_call_fits_the_installed_torch_signature():
    """torch 2.10's varlen_attn takes `is_causal` only; later ones take window_size, scale and
    enable_gqa. Either way the call is causal, keeps GQA pairs and applies the scale."""
    from ds_omni.model.attention import varlen_call
    base = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux"}
    new = frozenset(base | {"scale", "window_size", "enable_gqa"})
    old = frozenset(base | {"is_causal"})
    assert varlen_call(new, 32, 8, 0.125, 64) == (
        {"window_size": (-1, 0), "enable_gqa": True, "scale": 0.125}, 1, 1.0)
    assert varlen_call(new, 8, 8, None, 64) == ({"window_size": (-1, 0)}, 1, 1.0)
    assert varlen_call(old, 32, 8, 64 ** -0.5, 64) == ({"is_causal": True}, 4, 1.0)  # default scale
    kwargs, repeat, q_scale = varlen_call(old, 32, 32, 0.1, 64)
    assert kwargs == {"is_causal": True} and repeat == 1 and q_scale == pytest.approx(0.8)


def test_varlen_call_takes_the_layers_sliding_window():
    """HF's window W lets a query see itself and W - 1 keys before it: window_size (W - 1, 0); a
    torch whose varlen kernel has no window_size refuses a sliding layer instead of ignoring it."""
    from ds_omni.model.attention import varlen_call
    base = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"}
    new = frozenset(base | {"scale", "window_size", "enable_gqa"})
    assert varlen_call(new, 8, 8, None, 64, window=4) == ({"window_size": (3, 0)}, 1, 1.0)
    with pytest.raises(ValueError, match="no window_size.*window 4.*'sdpa'"):
        varlen_call(frozenset(base | {"is_causal"}), 8, 8, None, 64, window=4)


def _hf_mask(fn, length: int) -> torch.Tensor:
    """[L, L] bool of an HF mask function (b, h, q, kv) -> bool, on broadcast index grids."""
    zero = torch.tensor(0)
    return fn(zero, zero, torch.arange(length)[:, None], torch.arange(length)[None, :])


@pytest.mark.parametrize("window", [None, 3, 20])
def test_sample_mask_is_hfs_vision_mask(window):
    """Gemma 3's masks from HF's own mask functions: full layers OR(causal, block), sliding ones
    AND(window, OR(causal, block)); blocks are runs of image tokens (`token_type_ids == 1`)."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function,
                                            or_masks, sliding_window_overlay)
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask
    from ds_omni.model.attention import sample_mask
    from ds_omni.model.families.generic import image_runs
    types = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 1, 0]])  # [1, L]
    blocks = get_block_sequence_ids_for_mask(types)
    fn = or_masks(causal_mask_function, blockwise_overlay(blocks))
    if window:
        fn = and_masks(fn, sliding_window_overlay(window))
    runs = image_runs(torch.where(types[0] == 1, 7, 3), 7)
    assert runs == [(1, 4), (6, 8), (11, 15)]  # a lone image token is causal either way
    assert torch.equal(sample_mask(16, window, runs), _hf_mask(fn, 16))
    assert (sample_mask(16, window, []) is None) == (window in (None, 20))  # causal: no mask


def test_sliding_window_and_blocks_per_sample():
    """A window smaller than a sample bands it; samples stay apart; blocks open both ways inside
    their sample only; equal to SDPA with the explicit mask over each sample."""
    from ds_omni.model.attention import sample_mask
    h, hkv, d, cu = 4, 2, 8, [0, 9, 10, 21]
    q, k, v = _qkv(h, hkv, cu[-1], d, seed=3)
    blocks = torch.tensor([[2, 6], [12, 17]])  # one in sample 0, one in sample 2
    out = PackedAttention()(q, k, v, torch.tensor(cu, dtype=torch.int32), 11, 0.3, 0.0,
                            window=3, blocks=blocks)  # [1, T, H, D]
    refs = []
    for (a, b), span in zip(zip(cu[:-1], cu[1:]), ([(2, 6)], [], [(2, 7)])):
        mask = sample_mask(b - a, 3, span)
        rep = h // hkv
        refs.append(F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b].repeat_interleave(rep, 1),
            v[:, :, a:b].repeat_interleave(rep, 1), attn_mask=mask, scale=0.3))
    torch.testing.assert_close(out, torch.cat(refs, dim=2).transpose(1, 2), rtol=0, atol=1e-6)
    plain = PackedAttention()(q, k, v, torch.tensor(cu, dtype=torch.int32), 11, 0.3, 0.0)
    assert not torch.allclose(out, plain)


def test_a_row_with_blocks_leaves_the_varlen_kernels():
    """The varlen kernels cannot express blocks: "auto" runs such a row on SDPA, an explicit
    varlen kernel is an error naming the fix (its choice is simulated: no GPU here)."""
    auto = PackedAttention("auto")
    auto.kernel = "varlen"
    assert auto._blocks_fallback() == "sdpa"
    asked = PackedAttention("sdpa")
    asked.kernel, asked.asked = "varlen", "varlen"
    with pytest.raises(ValueError, match="both ways.*use 'auto' or 'sdpa'"):
        asked._blocks_fallback()


def test_softcapping_is_refused():
    q, k, v = _qkv(2, 2, 4, 4, seed=4)
    with pytest.raises(ValueError, match="softcap 50.0.*attn_logit_softcapping"):
        packed_attention(None, q, k, v, cu_seqlens=torch.tensor([0, 4]), max_seqlen=4,
                         softcap=50.0)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "muse_glimmer_text"])
def test_sliding_window_layers_match_hf(model_type):
    """A tiny Mistral (every layer windowed), Qwen2 (windows from layer `max_window_layers`
    on, as its config derives `layer_types`) and Muse Glimmer's LLM (a windowed layer, then a full
    one without rotary embedding: NoPE) over a packed row of samples longer than the window:
    the backbone's hidden states equal HF's own forward run on each sample alone (fp32)."""
    from transformers import AutoConfig, AutoModel
    from ds_omni.model.omni import backbone_of
    extra = {"use_sliding_window": True, "max_window_layers": 1} if model_type == "qwen2" else {}
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, vocab_size=50,
                                  sliding_window=3, attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    hf = AutoModel.from_config(config).eval()
    if model_type == "qwen2":
        assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    lengths = [9, 2, 12]
    ids = torch.randint(0, 50, (sum(lengths),))
    with torch.no_grad():
        refs = [hf(input_ids=part[None]).last_hidden_state[0] for part in ids.split(lengths)]
        backbone = backbone_of(hf, torch.nn.Identity())
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = torch.tensor([0, 9, 11, 23], dtype=torch.int32)
        ours = backbone(backbone.embed_tokens(ids[None]), positions, cu, 12)[0]
    torch.testing.assert_close(ours, torch.cat(refs), rtol=0, atol=1e-5)
