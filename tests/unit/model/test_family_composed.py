"""Composition: any vision and/or audio encoder + any causal LM, described in JSON."""

import numpy as np
import pytest
import torch

from ds_omni.config import ModelConfig, PartConfig
from ds_omni.model.build import build_model, load
from tests.family_checks import (assert_logits_match, assert_loss_and_grads_match,
                                 assert_round_trip, processor_for)
from tests.fixtures import TINY_LLAMA, TINY_VISION

TINY_SIGLIP = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
TINY_WHISPER = {"model_type": "whisper", "d_model": 32, "encoder_layers": 2,
                "encoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_layers": 1,
                "decoder_attention_heads": 4, "decoder_ffn_dim": 64, "num_mel_bins": 16,
                "max_source_positions": 50, "vocab_size": 64, "pad_token_id": 0,
                "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
TINY_QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}


def _compose(**parts) -> ModelConfig:
    return ModelConfig(tokenizer="builtin:shapes", **{
        k: PartConfig(config=v) if isinstance(v, dict) else v for k, v in parts.items()})


def _clip(seconds, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return {"array": (np.sin(2 * np.pi * rng.uniform(100, 800) * t) * 0.3).astype(np.float32),
            "sampling_rate": 16000}


def _image(seed, size=32):
    from PIL import Image
    g = np.random.default_rng(seed)
    return Image.fromarray(g.integers(0, 255, (size, size, 3), dtype=np.uint8))


def _samples(built):
    proc = processor_for(built)
    both = [{"from": "human", "value": "<image> and <audio>: same?"}, {"from": "gpt", "value": "no"}]
    return [
        proc(text=both, media={"vision": [_image(0)], "audio": [_clip(0.7, 1)]}, sample_id="both",
             source="t"),
        proc(text="plain text", media={}, sample_id="text", source="t"),
        proc(text=[{"from": "human", "value": "<audio> <audio>"}, {"from": "gpt", "value": "two"}],
             media={"audio": [_clip(0.3, 2), _clip(1.4, 3)]}, sample_id="two clips", source="t"),
    ]


def _hf_inputs(sample):
    out = {"input_ids": sample.input_ids[None]}
    for enc, key in (("vision", "pixel_values"), ("audio", "input_features")):
        items = [it for e, it in sample.items if e == enc]
        if items:
            out[key] = torch.stack([it.inputs[key] for it in items])
            if enc == "audio":
                out["feature_attention_mask"] = torch.stack(
                    [it.inputs["feature_attention_mask"] for it in items])
    return out


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """CLIP + Whisper + Llama: built from configs, exported, loaded back as a model directory."""
    from ds_omni.model.convert import export_hf
    built = build_model(_compose(vision=TINY_VISION, audio=TINY_WHISPER, llm=TINY_LLAMA))
    assert built.family.name == "composed" and set(built.model.encoders) == {"vision", "audio"}
    out = tmp_path_factory.mktemp("omni")
    export_hf(built.model, out, built.tokenizer)
    return out, load(out)


def test_exported_omni_model_loads_with_transformers(omni):
    from transformers import AutoModelForImageTextToText
    out, built = omni
    hf = AutoModelForImageTextToText.from_pretrained(str(out))
    assert type(hf).__name__ == "OmniComposedForConditionalGeneration"
    assert_logits_match(built, hf, _samples(built), _hf_inputs)


def test_omni_loss_and_gradients(omni):
    from transformers import AutoModelForImageTextToText
    out, built = omni
    assert_loss_and_grads_match(built, AutoModelForImageTextToText.from_pretrained(str(out)),
                                _samples(built), _hf_inputs)


def test_omni_round_trip_and_generate(omni, tmp_path):
    from transformers import AutoModelForImageTextToText
    out, built = omni
    reference = AutoModelForImageTextToText.from_pretrained(str(out))
    assert_round_trip(built, tmp_path / "again", reference)
    sample = _samples(built)[0]
    prompt = _hf_inputs(sample)
    gen = reference.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == sample.length + 4


def test_siglip_qwen2_vision_composition_is_stock_llava(tmp_path):
    from transformers import LlavaForConditionalGeneration
    from ds_omni.model.convert import export_hf
    built = build_model(_compose(vision=TINY_SIGLIP, llm=TINY_QWEN2))
    assert built.family.name == "llava"
    assert built.item_processors["vision"].process(_image(1)).num_embeddings == 16  # no CLS
    export_hf(built.model, tmp_path, built.tokenizer)
    hf = LlavaForConditionalGeneration.from_pretrained(str(tmp_path))
    assert_logits_match(built, hf, [processor_for(built)(
        text=[{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "x"}],
        media={"vision": [_image(2)]}, sample_id="s", source="t")], _hf_inputs)


def test_linear_projector_and_audio_only(tmp_path):
    built = build_model(ModelConfig(tokenizer="builtin:shapes", projector="linear",
                                    audio=PartConfig(config=TINY_WHISPER),
                                    llm=PartConfig(config=TINY_QWEN2)))
    assert built.family.name == "composed" and list(built.model.encoders) == ["audio"]
    assert not hasattr(built.model.encoders["audio"].projector, "linear_2")
    from ds_omni.data.packing import pack
    clips = processor_for(built)(text=[{"from": "human", "value": "<audio>"},
                                       {"from": "gpt", "value": "a tone"}],
                                 media={"audio": [_clip(0.5, 4)]}, sample_id="a", source="t")
    out = built.model(pack([clips], built.item_processors))
    assert torch.isfinite(out.loss_sum) and out.num_targets > 0


def test_parts_load_from_their_own_directories(tmp_path):
    from transformers import (AutoConfig, LlamaForCausalLM, SiglipVisionModel, WhisperModel)
    from ds_omni.data.demo import ensure_builtin
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("builtin:shapes", "tokenizer")))
    cfgs = {"llm": {**TINY_LLAMA, "vocab_size": len(tok)}, "vision": TINY_SIGLIP, "audio": TINY_WHISPER}
    classes = {"llm": LlamaForCausalLM, "vision": SiglipVisionModel, "audio": WhisperModel}
    parts = {}
    for name, cls in classes.items():
        fields = dict(cfgs[name])
        model = cls(AutoConfig.for_model(fields.pop("model_type"), **fields))
        model.save_pretrained(str(tmp_path / name))
        parts[name] = model
    built = build_model(ModelConfig(tokenizer="builtin:shapes", **{
        n: PartConfig(pretrained=str(tmp_path / n)) for n in classes}))
    hf = built.model.hf_model
    assert torch.equal(hf.language_model.lm_head.weight, parts["llm"].lm_head.weight)
    assert torch.equal(hf.vision_tower.embeddings.patch_embedding.weight,
                       parts["vision"].embeddings.patch_embedding.weight)
    assert torch.equal(hf.audio_tower.conv1.weight, parts["audio"].encoder.conv1.weight)
