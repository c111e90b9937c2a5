"""Activation checkpointing of the LLM's decoder layers changes memory, not numbers."""

import numpy as np
import torch

from ds_omni.config import ModelConfig, PartConfig
from ds_omni.data.packing import pack
from ds_omni.model.build import build_model
from tests.family_checks import processor_for
from tests.fixtures import TINY_LLAMA, TINY_VISION


def _built(checkpointing: bool):
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


def _counting(forward, count):
    def wrapped(*args, **kwargs):
        count[0] += 1
        return forward(*args, **kwargs)
    return wrapped


def test_checkpointed_layers_give_the_same_loss_and_gradients():
    plain, ckpt = _built(False), _built(True)
    assert ckpt.model.backbone.checkpoint_layers and not plain.model.backbone.checkpoint_layers
    mb = _batch(plain)
    outs, calls = [], []
    for built in (plain, ckpt):
        count, layer = [0], built.model.backbone.layers[0]
        layer.forward = _counting(layer.forward, count)  # hooks don't fire on recompute; this does
        out = built.model(mb)
        out.loss_sum.backward()
        outs.append(out.loss_sum)
        calls.append(count[0])
    assert calls == [1, 2]  # checkpointed: the layer runs again in backward
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    grads = [{n: p.grad for n, p in b.model.named_parameters() if p.grad is not None}
             for b in (plain, ckpt)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-8, msg=name)
