"""Encoder towers recomputed in backward (activation checkpointing, `model.activation_checkpointing`).

The LLM's decoder layers recompute through `Backbone.run_layer`; an encoder tower is HF's own
module, so its layers are wrapped here, on the instance (`recompute_in_backward`). A layer that
encodes a piece of a long item (`ds_omni.parallel.long_short`) recomputes inside its group.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_omni.parallel import long_short


def recompute_in_backward(tower: nn.Module) -> int:
    """Make each transformer layer of `tower` recompute in backward; returns how many there are.

    The layers are the modules HF marks as `GradientCheckpointingLayer` (CLIP, SigLIP, Whisper and
    Qwen2-VL blocks all are), outermost ones only. Each layer's forward then runs under
    non-reentrant `checkpoint` whenever gradients are on, in train or eval mode alike (HF's own
    switch also needs train mode, which a model loaded with `from_pretrained` is not in). The
    wrapper is set on the instance, not the class, so parameters, state-dict keys and module hooks
    (ZeRO-3 gathers parameters in them) stay outside it, as with HF's gradient checkpointing.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer
    layers: dict[str, nn.Module] = {}
    for name, module in tower.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(
                name.startswith(f"{outer}.") for outer in layers):
            layers[name] = module
    for layer in layers.values():
        if not isinstance(layer.__dict__.get("forward"), _Recompute):
            layer.forward = _Recompute(layer)
    return len(layers)


class _Recompute:
    """A layer's forward under non-reentrant checkpointing (an object, not a closure, so a model
    holding it still deep-copies and pickles)."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __call__(self, *args, **kwargs):
        forward = type(self.layer).forward.__get__(self.layer)
        if torch.is_grad_enabled():
            context_fn = long_short.recompute_context()  # a long item's piece: recompute in its group
            if context_fn is not None:
                return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn,
                                  **kwargs)
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)
