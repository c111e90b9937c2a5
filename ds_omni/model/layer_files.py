"""A pipeline checkpoint's weights: one file per pipeline layer, read back into an OmniModel.

DeepSpeed's pipeline engine (`PipelineModule.save_state_dict`) writes the state dict of each
pipeline layer to its own file. ds_omni's pipeline layers (`ds_omni.parallelize.pipeline`: the
embedding, one per decoder layer, the head) are made of the OmniModel's own modules, registered
under the names `layer_modules` gives, so file i loaded into layer i's modules puts every weight
under its OmniModel name: an export reads a pipeline checkpoint without the pipeline engine.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ds_omni.errors import ModelError
from ds_omni.model.omni import OmniModel


def layer_file(directory: Path, index: int) -> Path:
    """The file DeepSpeed's `PipelineModule.save_state_dict` writes for pipeline layer `index`
    (its topology has pipe and data axes only, so the name carries no rank)."""
    return directory / f"layer_{index:02d}-model_states.pt"


def is_pipeline_checkpoint(directory: Path) -> bool:
    return layer_file(directory, 0).is_file()


def layer_modules(model: OmniModel) -> list[nn.ModuleDict]:
    """The OmniModel's modules in each pipeline layer [L + 2], by the names its stage registers
    them under: the embedding (token embedding, encoders), each decoder layer (with the rotary
    embedding it runs), the head (final norm, LM head)."""
    backbone = model.backbone
    embed = nn.ModuleDict({"embed_tokens": backbone.embed_tokens, "encoders": model.encoders})
    decoders = [nn.ModuleDict({"layer": layer, "rotary_emb": backbone.rotary_emb})
                for layer in backbone.layers]
    head = nn.ModuleDict({"norm": backbone.norm, "lm_head": backbone.lm_head})
    return [embed, *decoders, head]


def load_layer_files(model: OmniModel, directory: Path) -> None:
    """Set `model`'s weights from a pipeline checkpoint directory: file i is the state dict of
    pipeline layer i (`layer_modules`). Under "uniform" placement stage 0's encoders are the
    saved ones (the other stages' copies are not layers)."""
    layers = layer_modules(model)
    found = sorted(p.name for p in directory.glob("layer_*-model_states.pt"))
    if len(found) != len(layers) or not all(layer_file(directory, i).is_file()
                                            for i in range(len(layers))):
        raise ModelError(f"{str(directory)!r} holds {len(found)} pipeline layer files but this "
                         f"model has {len(layers)} pipeline layers (embedding, "
                         f"{len(layers) - 2} decoder layers, head): was the checkpoint written "
                         "for another model, or is it incomplete?")
    for i, layer in enumerate(layers):
        state = torch.load(layer_file(directory, i), map_location="cpu", weights_only=True)
        try:
            layer.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ModelError(f"{layer_file(directory, i).name} does not fit pipeline layer {i} "
                             f"of this model: {e}") from None
