"""A pipeline checkpoint's weights: one file per pipeline layer, read back into an OmniModel.

DeepSpeed's pipeline engine (`PipelineModule.save_state_dict`) writes the state dict of each
pipeline layer to its own file (one per layer and TP rank under parallel.tp:
`layer_03-model_01-model_states.pt`). ds_omni's pipeline layers (`ds_omni.parallelize.pipeline`:
the embedding, one per decoder layer, the head) are made of the OmniModel's own modules,
registered under the names `layer_modules` gives, so a pipeline name (`2.layer.mlp.up_proj.weight`:
layer index, then the name inside it) maps to an OmniModel name (`omni_key`) and an export reads
a pipeline checkpoint without the pipeline engine. Under an MoE LLM the engine writes each
stage's whole module instead (`mp_rank_SS_model_states.pt`, pipeline names, AutoEP's experts in
their own files): `stage_states` reads those.
"""

from __future__ import annotations

from pathlib import Path

import re

import torch
from torch import nn

from ds_omni.errors import ModelError
from ds_omni.model.omni import OmniModel


_PIPELINE_KEY = re.compile(r"(\d+)\.([^.]+)(\..*)")  # layer index, its child, the rest


def layer_file(directory: Path, index: int, tp_rank: int | None = None) -> Path:
    """The file DeepSpeed's `PipelineModule.save_state_dict` writes for pipeline layer `index`
    (without parallel.tp its topology has pipe and data axes only: the name carries no rank)."""
    model = "" if tp_rank is None else f"-model_{tp_rank:02d}"
    return directory / f"layer_{index:02d}{model}-model_states.pt"


def is_pipeline_checkpoint(directory: Path) -> bool:
    """Written by the pipeline engine: per-layer files, or (an MoE LLM) per-stage modules."""
    return (layer_file(directory, 0).is_file() or layer_file(directory, 0, 0).is_file()
            or _pp_degree(directory) > 1)


def _pp_degree(directory: Path) -> int:
    states = directory / "mp_rank_00_model_states.pt"
    if not states.is_file():
        return 1
    dims = torch.load(states, map_location="cpu", weights_only=False).get(
        "checkpoint_parallel_dimensions") or {}
    return int(dims.get("pp_degree", 1))


def omni_key(key: str, prefixes: list[dict[str, str]]) -> str | None:
    """The OmniModel name of pipeline name `key` (`prefixes`: `pipeline_prefixes`); a name
    without a layer index as it is; None for a stage's replica of another layer's module (the
    encoders under "uniform" placement, registered as `joint_encoders`: stage 0's are saved)."""
    m = _PIPELINE_KEY.fullmatch(key)
    if m is None:
        return None if key.startswith("joint_encoders.") else key
    index, child, rest = int(m.group(1)), m.group(2), m.group(3)
    if index >= len(prefixes) or child not in prefixes[index]:
        raise ModelError(f"the checkpoint holds {key!r}, which pipeline layer {index} of this "
                         "model does not have: was it written for another model?")
    return prefixes[index][child] + rest


def pipeline_prefixes(model: OmniModel) -> list[dict[str, str]]:
    """Per pipeline layer, {child name: its OmniModel module name} (`layer_modules`)."""
    names = {id(m): n for n, m in model.named_modules()}
    return [{child: names[id(m)] for child, m in layer.items()} for layer in layer_modules(model)]


def pipeline_tp_states(directory: Path, prefixes: list[dict[str, str]], tp: int) -> list[dict]:
    """Each TP rank's weights (OmniModel names by `prefixes`, `pipeline_prefixes`; AutoTP's
    shards as saved) of a pipeline checkpoint: its per-layer files, or, under an MoE LLM, its
    stages' modules (tp 1)."""
    if not (layer_file(directory, 0).is_file() or layer_file(directory, 0, 0).is_file()):
        return [stage_states(directory, prefixes)]
    out = []
    for t in range(tp):
        state = {}
        for i, layer in enumerate(prefixes):
            path = layer_file(directory, i, t if tp > 1 else None)
            if not path.is_file():
                raise ModelError(f"the pipeline checkpoint {str(directory)!r} lacks {path.name}: "
                                 "was it copied whole, or written for another model?")
            for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
                state[omni_key(f"{i}.{key}", prefixes)] = value
        out.append(state)
    return out


def stage_states(directory: Path, prefixes: list[dict[str, str]]) -> dict:
    """The stages' modules (`mp_rank_SS_model_states.pt`, one per stage) in OmniModel names."""
    state = {}
    for path in sorted(directory.glob("mp_rank_*_model_states.pt")):
        module = torch.load(path, map_location="cpu", weights_only=True)["module"]
        for key, value in module.items():
            if (name := omni_key(key, prefixes)) is not None:
                state[name] = value
    return state


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
