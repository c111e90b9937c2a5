"""The cost model: dims read from HF configs, FLOPs checked against torch's counter, calibration."""

import itertools

import numpy as np
import pytest
import torch
import transformers as tf
from torch.utils.flop_counter import FlopCounterMode

from ds_omni.data.cost import CostModel, EncoderDims, ModelDims, nnls

TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, vocab_size=101,
                  num_attention_heads=4, num_key_value_heads=2)
TINY_CLIP = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                 image_size=32, patch_size=8)


def _flops(fn) -> dict:
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


# ----------------------------------------------------------------------------- HF configs
def test_dims_from_llava_config():
    cfg = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**TINY_CLIP),
                         text_config=tf.LlamaConfig(**TINY_LLAMA))
    d = ModelDims.from_hf_config(cfg)
    assert (d.hidden, d.layers, d.intermediate, d.vocab) == (64, 2, 96, 101)
    assert d.kv_hidden == 2 * 64 // 4 and d.mlp_matrices == 3
    assert list(d.encoders) == ["vision"]
    v = d.encoders["vision"]
    assert (v.hidden, v.layers, v.intermediate, v.mlp_matrices) == (32, 2, 64, 2)


def test_dims_from_qwen2_vl_config_use_vit_width_not_output_width():
    cfg = tf.Qwen2VLConfig(
        text_config=dict(hidden_size=48, num_hidden_layers=3, intermediate_size=80, vocab_size=77,
                         num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(embed_dim=24, depth=2, mlp_ratio=3, num_heads=2, hidden_size=48))
    d = ModelDims.from_hf_config(cfg)
    assert (d.hidden, d.layers, d.intermediate, d.vocab) == (48, 3, 80, 77)
    v = d.encoders["vision"]
    assert (v.hidden, v.layers, v.intermediate) == (24, 2, 72)


def test_dims_from_qwen2_audio_config():
    cfg = tf.Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=3, encoder_ffn_dim=40, encoder_attention_heads=4,
                          num_mel_bins=16, max_source_positions=20),
        text_config=TINY_LLAMA | {"model_type": "qwen2"})
    d = ModelDims.from_hf_config(cfg)
    assert list(d.encoders) == ["audio"]
    a = d.encoders["audio"]
    assert (a.hidden, a.layers, a.intermediate, a.mlp_matrices) == (32, 3, 40, 2)
    assert (d.hidden, d.vocab) == (64, 101)


def test_dims_from_plain_causal_lm_configs():
    d = ModelDims.from_hf_config(tf.LlamaConfig(**TINY_LLAMA))
    assert d.encoders == {} and d.mlp_matrices == 3
    g = ModelDims.from_hf_config(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50))
    assert (g.hidden, g.layers, g.intermediate, g.mlp_matrices) == (32, 2, 128, 2)


# ------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("s", [8, 40])
def test_llm_cost_matches_torch_flop_counter(s):
    """torch counts eager attention as full (non-causal) matmuls: twice our causal term."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**TINY_LLAMA, attn_implementation="eager")
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, s))
    counted = sum(_flops(lambda: model(input_ids=ids, labels=ids).loss.backward()).values())
    cm = CostModel(ModelDims.from_hf_config(cfg))
    c = cm.coefficients
    assert counted == pytest.approx(c["llm_lin"] * s + 2 * c["llm_quad"] * s * s, rel=1e-9)
    causal_attention = cm.llm_cost(np.array([s]))[0] - c["llm_lin"] * s
    assert causal_attention == pytest.approx((counted - c["llm_lin"] * s) / 2, rel=1e-9)


def test_encoder_cost_matches_torch_flop_counter():
    torch.manual_seed(0)
    vcfg = tf.CLIPVisionConfig(**TINY_CLIP, attn_implementation="eager")
    vit = tf.CLIPVisionModel(vcfg)
    px = torch.randn(1, 3, 32, 32)
    counts = _flops(lambda: vit(pixel_values=px).last_hidden_state.sum().backward())
    transformer = sum(n for op, n in counts.items() if "convolution" not in op)  # no patch embed
    cm = CostModel(ModelDims(hidden=8, layers=1, intermediate=8, vocab=8,
                             encoders={"vision": EncoderDims(hidden=32, layers=2, intermediate=64)}))
    positions = (32 // 8) ** 2 + 1  # patches + class token
    assert cm.encoder_cost("vision", np.array([positions]))[0] == pytest.approx(transformer, rel=1e-9)


def test_frozen_encoder_costs_forward_only():
    enc = dict(hidden=32, layers=2, intermediate=64)
    base = dict(hidden=8, layers=1, intermediate=8, vocab=8)
    live = CostModel(ModelDims(**base, encoders={"v": EncoderDims(**enc)}))
    frozen = CostModel(ModelDims(**base, encoders={"v": EncoderDims(**enc, frozen=True)}))
    p = np.array([5, 50, 500])
    np.testing.assert_allclose(live.encoder_cost("v", p), 3 * frozen.encoder_cost("v", p))


# ----------------------------------------------------------------------------- samples
def _model() -> CostModel:
    return CostModel(ModelDims(hidden=64, layers=2, intermediate=96, vocab=101, encoders={
        "vision": EncoderDims(hidden=32, layers=2, intermediate=64),
        "audio": EncoderDims(hidden=48, layers=3, intermediate=96)}))


def _workload(rng, n=60, m=90):
    tokens = rng.integers(10, 4000, n)
    item_sample = rng.integers(0, n, m)
    item_encoder = rng.integers(0, 2, m)
    item_len = rng.integers(16, 2000, m)
    return tokens, item_sample, item_encoder, item_len


def test_sample_costs_add_llm_and_item_costs():
    cm, rng = _model(), np.random.default_rng(0)
    tokens, owner, enc, length = _workload(rng)
    got = cm.sample_costs(tokens, owner, enc, length)
    expected = cm.llm_cost(tokens).copy()
    for o, e, p in zip(owner, enc, length):
        expected[o] += cm.encoder_cost(cm.encoder_names[e], np.array([p]))[0]
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    names = np.array(cm.encoder_names)[enc]  # by name gives the same; item order does not matter
    perm = rng.permutation(len(owner))
    np.testing.assert_allclose(cm.sample_costs(tokens, owner[perm], names[perm], length[perm]), got)
    np.testing.assert_allclose(cm.sample_costs(tokens), cm.llm_cost(tokens))


def test_cost_is_superlinear_in_length():
    cm = _model()
    c = cm.llm_cost(np.array([1000, 2000]))
    assert c[1] > 2 * c[0]


def test_bad_encoder_names_and_indices_are_errors():
    cm = _model()
    with pytest.raises(ValueError, match="unknown encoder name"):
        cm.sample_costs(np.array([5]), np.array([0]), np.array(["video"]), np.array([3]))
    with pytest.raises(ValueError, match="encoder indices"):
        cm.sample_costs(np.array([5]), np.array([0]), np.array([2]), np.array([3]))
    with pytest.raises(ValueError, match="item_sample"):
        cm.sample_costs(np.array([5]), np.array([1]), np.array([0]), np.array([3]))


# --------------------------------------------------------------------------- calibration
def test_nnls_matches_brute_force_over_active_sets():
    rng = np.random.default_rng(1)
    for _ in range(20):
        a, y = rng.normal(size=(12, 4)), rng.normal(size=12)
        best = np.inf
        for k in range(5):
            for active in itertools.combinations(range(4), k):
                x = np.zeros(4)
                if active:
                    x[list(active)] = np.linalg.lstsq(a[:, list(active)], y, rcond=None)[0]
                if x.min() >= 0:
                    best = min(best, np.linalg.norm(a @ x - y))
        x = nnls(a, y)
        assert x.min() >= 0
        assert np.linalg.norm(a @ x - y) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_calibrate_recovers_known_scales_from_step_timings():
    cm, rng = _model(), np.random.default_rng(2)
    tokens, owner, enc, length = _workload(rng, n=400, m=600)
    true = {"llm_quad": 3e-13, "llm_lin": 1e-13, "vision_quad": 5e-13, "vision_lin": 2e-13,
            "audio_quad": 1e-12, "audio_lin": 4e-13}
    step = rng.integers(0, 80, 400)  # 80 timed micro-batches of random samples
    per_sample = cm.with_scales(true).sample_costs(tokens, owner, enc, length)
    seconds = np.bincount(step, weights=per_sample, minlength=80)
    fitted = cm.calibrate(tokens, owner, enc, length, seconds, sample_step=step)
    for term, scale in true.items():
        assert fitted.scales[term] == pytest.approx(scale, rel=1e-6), term
    noisy = seconds * rng.normal(1, 0.01, 80)
    refit = cm.calibrate(tokens, owner, enc, length, noisy, sample_step=step)
    pred = refit.sample_costs(tokens, owner, enc, length)
    assert np.bincount(step, weights=pred, minlength=80) == pytest.approx(seconds, rel=0.05)


def test_calibrate_fills_unmeasured_terms_with_median_factor():
    cm, rng = _model(), np.random.default_rng(3)
    tokens, owner, _, length = _workload(rng, n=50, m=40)
    enc = np.zeros(40, dtype=np.int64)  # no audio in the profile
    seconds = 2e-12 * cm.sample_costs(tokens, owner, enc, length)
    fitted = cm.calibrate(tokens, owner, enc, length, seconds)
    assert fitted.scales["audio_lin"] == pytest.approx(2e-12, rel=1e-6)
    assert fitted.scales["llm_lin"] == pytest.approx(2e-12, rel=1e-6)


def test_unknown_scale_term_is_an_error():
    with pytest.raises(ValueError, match="unknown cost term"):
        _model().with_scales({"video_lin": 1.0})


def test_dummy_pass_of_an_absent_encoder_is_costed():
    """A micro-batch without audio still runs the audio encoder once, on a dummy (every rank runs
    every encoder every step, for ZeRO-3); for Whisper that is a whole window, as costly as a clip
    (a clip's encoder sequence is max_source_positions long, whatever its duration)."""
    cfg = tf.Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=3, encoder_ffn_dim=40, encoder_attention_heads=4,
                          num_mel_bins=16, max_source_positions=20),
        text_config=TINY_LLAMA | {"model_type": "qwen2"})
    cm = CostModel(ModelDims.from_hf_config(cfg))
    clip = cm.encoder_cost("audio", np.array([20]))[0]
    assert cm.dummy_cost(present=[]) == pytest.approx(clip) and clip > 0
    assert cm.dummy_cost(present=["audio"]) == 0.0
