"""Deepstack levels over pipeline stages (parallel.pp x Qwen3-VL, Granite 4 Vision).

The embedding stage sends its row's deepstack positions [n] (integers, no gradient) and levels
[n, k, D] (sent a gradient back like the hidden states) after the row's index, ahead of any MoE
aux statistics (`pipeline_moe`); each decoder stage adds level i before layer `layers[i]` as
`Backbone.forward` does (the head stage: the levels aimed at the final norm), and passes them on
while a later layer still adds one. Their gradient reaches the encoders on the stage that
encoded them through the embedding stage's backward. Under SP each shard's levels are its own
(`EmbeddingRouter.embed_shard`: shard positions), so a stage adds them to its shard alone.

Dims: n rows at the row's (or its shard's) placeholders, k levels, D LLM hidden size.
"""

from __future__ import annotations

import torch

from ds_omni.model.deepstack import Deepstack


class DeepstackCarry:
    """The levels of one model's rows over the pipeline's layers (module docstring): `layers` the
    encoders' layer map, `num_layers` the LLM's; `levels_added` counts the non-empty levels this
    rank's stages added (the tests' proof that a later stage added them)."""

    def __init__(self, layers: tuple[int, ...], num_layers: int):
        self.layers = tuple(layers)
        used = [t for t in self.layers if 0 <= t <= num_layers]  # past the norm: unused, as in HF
        self.last = max(used) if used else -1  # the last pipeline layer that adds a level
        self.levels_added = 0

    def start(self, deep: Deepstack | None, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the embedding stage sends: (positions [n], levels [n, k, D]), empty where the row
        has no placeholder; () for a model without levels. The levels ask for a gradient even
        where the encoders are frozen, so each stage's backward has one to send."""
        if self.last < 0:
            return ()
        if deep is None:
            positions = torch.zeros(0, dtype=torch.long, device=hidden.device)
            levels = hidden.new_zeros((0, len(self.layers), hidden.shape[-1]))
        else:
            positions, levels = deep.positions.contiguous(), deep.levels.contiguous()  # sent
        if not levels.requires_grad:
            levels = levels.detach().requires_grad_()
        return positions, levels

    def split(self, layer: int, carry: list) -> tuple[Deepstack | None, list]:
        """(the levels pipeline layer `layer` (decoder i, or the head at the LLM's layer count)
        receives or None, the rest of its `carry`)."""
        if layer > self.last:
            return None, carry
        positions, levels, *rest = carry
        return Deepstack(positions, levels, self.layers), rest

    def add_before(self, hidden: torch.Tensor, layer: int, deep: Deepstack | None) -> torch.Tensor:
        """hidden [1, S, D] with the levels aimed at `layer` added (`Deepstack.add_before`)."""
        if deep is None:
            return hidden
        for level, target in enumerate(self.layers):
            if target == layer:
                hidden = deep.add(hidden, level)
                self.levels_added += int(deep.positions.numel() > 0)
        return hidden

    def passed_on(self, layer: int, deep: Deepstack | None) -> tuple[torch.Tensor, ...]:
        """What layer `layer` sends on: the levels while a later layer adds one, else ()."""
        if deep is None or layer >= self.last:
            return ()
        return deep.positions, deep.levels
