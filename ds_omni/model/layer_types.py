"""Per-layer-type rotary tables, for LLMs whose layers differ by type (Gemma 3's local and global).

Such an LLM's rotary embedding takes a `layer_type` and gives each type its own table (Gemma 3:
rope base 10k on sliding layers, 1M on full ones); HF's own forward computes one per type and
hands each layer its type's. The backbone does the same: `rotary_tables` makes the tables of a row
once, `for_layer` picks a layer's. An LLM with one table is untouched. Layers HF's model forward
gives no table at all (Muse's NoPE layers, `mark_nope`) get none.

Dims: S tokens of the row (or SP shard), d rotary dim.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn


class PerLayerType(dict):
    """{layer type: (cos, sin)}, each [1, S, d] (a dict, so a pipeline stage can tell it apart)."""


def takes_layer_type(rotary: nn.Module) -> bool:
    # asked once a row: `inspect.signature` (13 us, with its own Python calls) is read once per
    # forward function
    return _has_layer_type(getattr(rotary.forward, "__func__", rotary.forward))


@functools.cache
def _has_layer_type(forward) -> bool:
    return "layer_type" in inspect.signature(forward).parameters


def rotary_tables(rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor):
    """(cos, sin) of the row, or `PerLayerType` when the rotary embedding has one per type."""
    if not takes_layer_type(rotary):
        return rotary(hidden, position_ids)
    types = getattr(rotary, "layer_types", None) or rotary.config.layer_types
    return PerLayerType({t: rotary(hidden, position_ids, t) for t in sorted(set(types))})


def layer_type(layer: nn.Module) -> str:
    """A decoder layer's type ("sliding_attention", "full_attention", ...), as its config says."""
    if getattr(layer, "ds_omni_per_sample", None) is not None:  # `per_sample.mark` found it
        return layer.ds_omni_per_sample
    for holder in (layer, getattr(layer, "self_attn", None)):
        for attr in ("attention_type", "layer_type"):
            if isinstance(getattr(holder, attr, None), str):
                return getattr(holder, attr)
    attn = getattr(layer, "self_attn", layer)
    return attn.config.layer_types[attn.layer_idx]


def mark_nope(decoder_model: nn.Module) -> None:
    """Tag the decoder layers to which HF's model forward hands no rotary table: Muse's NoPE
    layers (`position_embeddings if self.config.layer_rope_theta[i] else None`, every 4th layer
    counted back from the last), read from the config where the model's own forward reads it."""
    thetas = getattr(decoder_model.config, "layer_rope_theta", None)
    try:
        reads = "layer_rope_theta" in inspect.getsource(type(decoder_model).forward)
    except (OSError, TypeError):  # no source at hand
        reads = False
    if thetas and reads:
        for layer, theta in zip(decoder_model.layers, thetas):
            layer.ds_omni_nope = not theta


def for_layer(layer: nn.Module, kwargs: dict) -> dict:
    """`kwargs` with the layer's own rotary table where the row has one per layer type (None for
    a type without one: LFM's convolution layers, as HF's `position_embeddings.get(type)`), and
    none for a NoPE layer (`mark_nope`)."""
    if getattr(layer, "ds_omni_nope", False):
        return {**kwargs, "position_embeddings": None}
    tables = kwargs.get("position_embeddings")
    if not isinstance(tables, PerLayerType):
        return kwargs
    return {**kwargs, "position_embeddings": tables.get(layer_type(layer))}
