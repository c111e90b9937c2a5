"""Deepstack layer maps: before which LLM decoder layer each level of an HF model's vision features
is added, read from its config, and its image-feature output flattened into rows [N, (1 + k) D]
(the main embedding, then the k levels side by side); `Deepstack`: the levels at their rows.

Two layouts in transformers 5.24: Qwen3-VL and its kin return the main rows and k levels, added
after decoder layers 0..k-1 (the map 1..k); Granite 4 Vision has no main rows (zeros here) and
(LLM layer, features) pairs, one per `deepstack_layer_map` then `spatial_target_layers` entry, of
which the later wins for a layer (`granite_levels` keeps the same pairs).

Dims: N embeddings of the images of one call, D LLM width, k levels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Layout(NamedTuple):
    """Where an HF model's deepstack levels go and how its feature output holds them."""

    layers: tuple[int, ...] = ()
    """[k] the decoder layer each level is added before (`ModalityEncoder.deepstack_layers`)."""
    pairs: tuple[int, ...] | None = None
    """Granite 4 Vision: the index, in the output's (layer, features) pairs, of each kept level;
    None: Qwen3-VL's main rows and plain list of levels (or no levels at all)."""


def layout(config) -> Layout:
    """The deepstack layout of an HF model with this config (no levels for most models)."""
    if getattr(config, "deepstack_layer_map", None) is not None:
        targets = [int(layer) for _, layer in config.deepstack_layer_map]
        targets += [int(layer) for layer in getattr(config, "spatial_target_layers", None) or ()]
        pairs, layers = granite_levels(targets, config.get_text_config().num_hidden_layers)
        return Layout(layers, pairs)
    vision = getattr(config, "vision_config", None)
    k = len(getattr(vision, "deepstack_visual_indexes", None) or ())
    return Layout(tuple(range(1, k + 1)))  # after layers 0..k-1


def granite_levels(targets: list[int], num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(kept pair indices, their layers) of Granite 4 Vision's pairs aimed at `targets`: the last
    pair for each layer its text model has (0 <= layer < num_layers), in pair order."""
    last = {layer: i for i, layer in enumerate(targets) if 0 <= layer < num_layers}
    pairs = tuple(sorted(last.values()))
    return pairs, tuple(targets[i] for i in pairs)


def feature_rows(out, layout: Layout) -> torch.Tensor:
    """What `get_image_features` returns (an output with `pooler_output`, else its
    `last_hidden_state` (Fuyu's), a tensor, or a tuple of per-image tensors; with deepstack
    levels, module docstring) -> [N, (1 + k) D]."""
    levels = getattr(out, "deepstack_features", None) or []
    if layout.pairs is not None:
        first = flat(levels[0][1])  # [N, D]: every pair covers the same image tokens
        main, levels = torch.zeros_like(first), [levels[i][1] for i in layout.pairs]
    else:
        main = getattr(out, "pooler_output", None)
        if main is None:  # a tensor, or an output whose features are its last_hidden_state
            main = getattr(out, "last_hidden_state", out)
        main = flat(main)
    return torch.cat([main, *map(flat, levels)], dim=-1) if levels else main


def flat(feats) -> torch.Tensor:
    """A tensor or a tuple of per-image tensors -> [N, D]."""
    if isinstance(feats, (list, tuple)):
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(-1, feats.shape[-1])


class Deepstack(NamedTuple):
    """Deepstack levels at their rows (`ds_omni.model.omni`'s docstring): the backbone adds level i to the hidden
    states at `positions` before decoder layer `layers[i]`, as HF's `_deepstack_process` (Qwen3-VL)
    and Granite 4 Vision's layer loop do."""

    positions: torch.Tensor  # [n] row positions (of this rank's shard under SP), any order
    levels: torch.Tensor  # [n, k, D]
    layers: tuple[int, ...]  # [k] the layer each level goes before (the encoders' layer map)

    def add_before(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """hidden [1, S, D] with every level the map sends before `layer` added, in level order."""
        for level, target in enumerate(self.layers):
            if target == layer:
                hidden = self.add(hidden, level)
        return hidden

    def add(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        """hidden [1, S, D] with level `level` added at the positions (HF's exact sum: the rows
        read, added, written back)."""
        rows = hidden[0].index_select(0, self.positions) + self.levels[:, level].to(hidden.dtype)
        return hidden[0].index_copy(0, self.positions, rows).unsqueeze(0)


def split_levels(rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rows [N, (1 + k) D] -> (main [N, D], levels [N, k, D] or None when k = 0)."""
    k = rows.shape[-1] // width - 1
    if k == 0:
        return rows, None
    return rows[:, :width], rows[:, width:].reshape(rows.shape[0], k, width)  # [N, k, D]


def join_deepstack(parts: list[Deepstack]) -> Deepstack | None:
    """One `Deepstack` of several encoders' (None when there are none; their layer maps are one,
    `OmniModel` checks)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return Deepstack(torch.cat([p.positions for p in parts]), torch.cat([p.levels for p in parts]),
                     parts[0].layers)
