"""Activation checkpointing of the LLM's decoder layers and of encoder layers changes memory, not
numbers."""

import numpy as np
import pytest
import torch

from ds_omni.config import ModelConfig, PartConfig
from ds_omni.errors import ConfigError, ModelError
from ds_omni.data.packing import pack
from ds_omni.model.build import build_model
from ds_omni.model.recompute import recompute_in_backward
from tests.family_checks import processor_for
from tests.fixtures import TINY_LLAMA, TINY_VISION



def _built(checkpointing):
    return build_model(ModelConfig(tokenizer="builtin:shapes", vision=PartConfig(config=TINY_VISION),
                                   llm=PartConfig(config=TINY_LLAMA),
                                   activation_checkpointing=checkpointing))


def _batch(built):
    from PIL import Image
    proc = processor_for(built)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    samples = [proc(text=[{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "a red disc"}],
                    media={"vision": [image]}, sample_id="a", source="t"),
               proc(text="plain text only", media={}, sample_id="b", source="t")]
    return pack(samples, built.item_processors)


def _count_calls(module, count):
    """Count runs of `module`'s forward, recompute included. A pre-hook: the recompute stops
    (torch's early stop) once it has the tensors backward needs, before the module returns."""
    module.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))


def _run(built, mb):
    """(loss, gradients, runs of the first LLM and vision layers' MLPs) of one forward+backward."""
    built.model.eval()  # as loaded by from_pretrained: recompute must not need train mode
    llm, vision = [0], [0]
    _count_calls(built.model.backbone.layers[0].mlp, llm)
    _count_calls(built.model.encoders["vision"].tower.encoder.layers[0].mlp, vision)
    out = built.model(mb)
    out.loss_sum.backward()
    grads = {n: p.grad for n, p in built.model.named_parameters() if p.grad is not None}
    return out.loss_sum.detach(), grads, (llm[0], vision[0])


@pytest.fixture(scope="module")
def reference():
    plain = _built(False)
    mb = _batch(plain)
    return mb, _run(plain, mb)


@pytest.mark.parametrize("asked, recomputed", [(True, (2, 2)), (["encoders"], (1, 2)),
                                               (["llm"], (2, 1))])
def test_checkpointed_layers_give_the_same_loss_and_gradients(reference, asked, recomputed):
    mb, (loss, grads, calls) = reference
    ckpt_loss, ckpt_grads, ckpt_calls = _run(_built(asked), mb)
    assert calls == (1, 1) and ckpt_calls == recomputed  # a recomputed layer runs again in backward
    torch.testing.assert_close(ckpt_loss, loss, rtol=0, atol=0)
    assert ckpt_grads.keys() == grads.keys() and grads
    for name, g in grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, rtol=1e-6, atol=1e-8, msg=name)


def _tiny_whisper_encoder():
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    cfg = WhisperConfig(d_model=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32,
                        num_mel_bins=8, max_source_positions=10)
    return WhisperEncoder(cfg), {"input_features": torch.randn(2, 8, 20)}


def _tiny_qwen2_vl_tower():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    cfg = Qwen2VLVisionConfig(depth=2, embed_dim=16, hidden_size=16, num_heads=2, patch_size=2,
                              spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    grid = torch.tensor([[1, 4, 4]])
    return (Qwen2VisionTransformerPretrainedModel(cfg),
            {"hidden_states": torch.randn(16, 3 * 2 * 2 * 2), "grid_thw": grid})


@pytest.mark.parametrize("make", [_tiny_whisper_encoder, _tiny_qwen2_vl_tower])
def test_other_encoder_towers_recompute_exactly(make):
    """Whisper (audio) and Qwen2-VL (native-resolution vision) towers: every block, same numbers."""
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        tower, inputs = make()
        if recompute:
            assert recompute_in_backward(tower) == 2  # both blocks, nothing nested
            assert recompute_in_backward(tower) == 2  # idempotent: no checkpoint in a checkpoint
        out = tower(**inputs)
        out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in tower.named_parameters()
                                       if p.grad is not None}))
    (out0, g0), (out1, g1) = results
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    assert g0.keys() == g1.keys() and g0
    for name, g in g0.items():
        torch.testing.assert_close(g1[name], g, rtol=1e-6, atol=1e-8, msg=name)


def test_checkpointing_config_names_parts():
    def parts(asked):
        return ModelConfig(llm=PartConfig(config=TINY_LLAMA),
                           activation_checkpointing=asked).checkpointed_parts()
    assert parts(False) == set() and parts(True) == {"llm", "vision", "audio"}
    assert parts(["encoders"]) == {"vision", "audio"} and parts(["llm", "audio"]) == {"llm", "audio"}
    from ds_omni.config import from_dict
    with pytest.raises(ConfigError, match=r"activation_checkpointing\[0\] must be one of .*'encoders'"):
        from_dict(ModelConfig, {"llm": {"config": TINY_LLAMA}, "activation_checkpointing": ["vit"]})
    with pytest.raises(ModelError, match=r"names \['audio'\] but this model has no such part; it "
                                         r"has \['llm', 'vision'\]"):
        _built(["audio"])
