"""Conversion between HF model directories, OmniModels and DeepSpeed checkpoints (loading an HF or
an OmniModel directory for use is `build.load`, the same path as `model.pretrained`).

- `save_omni`: an OmniModel -> an OmniModel directory: weights in family-neutral keys
  (`encoders.vision.tower...`, `backbone.layers.3...`) plus the HF config, tokenizer and processor.
- `export_hf`: an OmniModel (optionally with a state dict in OmniModel keys) -> an HF directory
  that `from_pretrained` loads, with tokenizer and processor.
- `consolidate_checkpoint`: a DeepSpeed checkpoint of any ZeRO stage and any pp / tp / ep ->
  one fp32 state dict in OmniModel keys (ZeRO-3 partitions and ZeRO-1/2 optimizer shards merged
  by DeepSpeed's own `zero_to_fp32`; a pipeline's files by `layer_files`, AutoTP's shards by
  `tp_files`, AutoEP's experts by `expert_checkpoint`).
- `export_checkpoint`: the two together: one command from a training run to an HF model.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from ds_omni.errors import ModelError
from ds_omni.model.expert_checkpoint import expert_checkpoint_state, is_expert_checkpoint
from ds_omni.model.layer_files import (is_pipeline_checkpoint, omni_key, pipeline_prefixes,
                                       pipeline_tp_states)
from ds_omni.model.omni import OmniModel
from ds_omni.model.tp_files import merge_tp, merge_tp_states, tp_degree, tp_layout_of


OMNI_WEIGHTS = "omni.safetensors"
OMNI_MARKER = "ds_omni.json"
OMNI_FORMAT_VERSION = 1
MODEL_META_DIR = "model"
"""A checkpoint's directory (beside its tags) holding the HF config, tokenizer and processor that
`model_from_meta` rebuilds the model from (`train.checkpoint.save_model_meta` writes it)."""


def is_omni_dir(model_dir: str | Path) -> bool:
    return (Path(model_dir) / OMNI_MARKER).is_file()


def save_omni(model: OmniModel, out_dir: str | Path, tokenizer, model_dir: Path | None = None) -> Path:
    """Write `model` as an OmniModel directory (weights keyed by the OmniModel's names)."""
    from safetensors.torch import save_model
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / OMNI_WEIGHTS))  # handles tied (shared) weights
    model.hf_model.config.save_pretrained(str(out))
    model.family.save_processor(out, model.hf_model.config, tokenizer, model_dir)
    (out / OMNI_MARKER).write_text(json.dumps(
        {"format": "ds_omni.omni_model", "version": OMNI_FORMAT_VERSION,
         "family": model.family.name}, indent=1))
    return out


def load_omni_dir(model_dir: str | Path):
    """(OmniModel, tokenizer) from an OmniModel directory written by `save_omni`."""
    from safetensors.torch import load_file
    model_dir = Path(model_dir)
    meta = json.loads((model_dir / OMNI_MARKER).read_text())
    if meta.get("version") != OMNI_FORMAT_VERSION:
        raise ModelError(f"{str(model_dir)!r} is an OmniModel directory of format version "
                         f"{meta.get('version')}; this ds_omni reads version {OMNI_FORMAT_VERSION}")
    weights = model_dir / OMNI_WEIGHTS
    if not weights.is_file():
        raise ModelError(f"{str(model_dir)!r} has no {OMNI_WEIGHTS}: the OmniModel's weights are missing")
    model, tokenizer = model_from_meta(model_dir)
    load_omni_state(model, _untie(model, load_file(str(weights))))
    return model, tokenizer


def _untie(model: OmniModel, state: dict) -> dict:
    """safetensors stores a tied tensor once; give each of the model's names its tensor back."""
    own = model.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for key, tensor in own.items():
        by_id.setdefault(id(tensor), []).append(key)
    for keys in by_id.values():
        present = [k for k in keys if k in state]
        for k in keys:
            if k not in state and present:
                state[k] = state[present[0]]
    return state


def export_hf(model: OmniModel, out_dir: str | Path, tokenizer, *, state_dict: dict | None = None,
              model_dir: Path | None = None) -> Path:
    """Write `model` (or `state_dict`, in OmniModel keys, loaded into it) as an HF directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if state_dict is not None:
        load_omni_state(model, state_dict)
    hf_model = model.hf_model
    lora_meta = getattr(model, "lora_meta", None)
    with _plain_attention(hf_model.config):
        if lora_meta is None:
            hf_model.save_pretrained(str(out), safe_serialization=True)
        else:  # LoRA: merged into the weights, or the base weights plus peft's adapter directory
            _save_lora(model, out, merged=lora_meta["export"] == "merged")
        model.family.save_processor(out, hf_model.config, tokenizer, model_dir)
    return out


def _save_lora(model: OmniModel, out: Path, merged: bool) -> None:
    from ds_omni.model import lora
    model.hf_model.save_pretrained(str(out), state_dict=lora.hf_state(model, merged),
                                   safe_serialization=True)
    if not merged:
        lora.save_adapter(model, out)


@contextmanager
def _plain_attention(config):
    """The exported config names HF's SDPA, not ds_omni's packed attention; the live model's
    config is the same object (its decoder layers read it at every call), so it gets its packed
    attention back afterwards: switched for good, packed samples would attend to each other."""
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", None) or {}]
    configs = [config] + [c for c in subs if c is not None]  # restored top first (it may cascade)
    exported = [config, getattr(config, "text_config", None)]
    saved = [c._attn_implementation for c in configs]
    try:
        for c in exported:
            if c is not None:
                c._attn_implementation = "sdpa"
        yield
    finally:
        for c, attn in zip(configs, saved):
            c._attn_implementation = attn


def load_omni_state(model: OmniModel, state_dict: dict) -> None:
    """Load a state dict in OmniModel keys; a key or shape mismatch is a clear error."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ModelError(f"weights do not match the model: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{'...' if len(unexpected) > 5 else ''}; were they written for another config?")
    for key, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise ModelError(f"weight {key!r} has shape {tuple(tensor.shape)} but the model expects "
                             f"{tuple(own[key].shape)}; were the weights written for another config?")
    model.load_state_dict(state_dict, strict=True)


def consolidate_checkpoint(ckpt_root: str | Path, tag: str | None = None,
                           model: OmniModel | None = None) -> dict[str, torch.Tensor]:
    """fp32 state dict (OmniModel keys) of a DeepSpeed checkpoint written under `ckpt_root`.

    Any model-parallel layout: a pipeline's per-layer (or, MoE, per-stage) files read through
    `model` (default: rebuilt from the checkpoint's model/ directory), AutoTP's shards joined
    (`tp_layout.json`), AutoEP's experts stacked into HF's layout. The weights are the ones the
    model states hold: fp32 under fp32 training, the bf16 copies under bf16 (the fp32 master
    copy stays in the optimizer shards)."""
    root = Path(ckpt_root)
    tag = tag or _latest(root)
    directory = root / tag
    if not list(directory.glob("*model_states.pt")):
        raise ModelError(f"{str(directory)!r} holds no DeepSpeed model states")
    layout = tp_layout_of(root / MODEL_META_DIR)
    rename = lambda key: key  # noqa: E731 (the expert files' keys: OmniModel names)
    if is_pipeline_checkpoint(directory):
        model = model if model is not None else model_from_meta(root / MODEL_META_DIR)[0]
        prefixes = pipeline_prefixes(model)
        rename = lambda key: omni_key(key, prefixes)  # noqa: E731
        shards = pipeline_tp_states(directory, prefixes, tp_degree(layout) if layout else 1)
        state = merge_tp(shards, layout, directory) if layout else shards[0]
    elif layout is not None:  # parallel.tp > 1 (beside ep or not)
        state = merge_tp_states(directory, layout)
    elif list(directory.glob("*optim_states.pt")) and not is_expert_checkpoint(directory):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)  # ZeRO 1/2/3
    else:  # no ZeRO, or parallel.ep: every rank held the rest of the model whole; rank 0's
        state = torch.load(directory / "mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)["module"]
    if is_expert_checkpoint(directory):  # parallel.ep: AutoEP's per-expert files
        state = expert_checkpoint_state(directory, state, rename)
    if model is not None:
        state = _untie(model, state)  # a pipeline saves a tied weight on its first stage only
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def _latest(root: Path) -> str:
    latest = root / "latest"
    if not latest.is_file():
        raise ModelError(f"{str(root)!r} is not a DeepSpeed checkpoint directory (no 'latest' file); "
                         "pass <output_dir>/checkpoints")
    return latest.read_text().strip()


def model_from_meta(meta_dir: str | Path):
    """(OmniModel, tokenizer) rebuilt from a checkpoint's model/ directory (random weights)."""
    from transformers import AutoConfig, AutoTokenizer
    from ds_omni.model.families import family_for
    meta_dir = Path(meta_dir)
    config = AutoConfig.from_pretrained(str(meta_dir))
    family = family_for(config.model_type)
    tokenizer = AutoTokenizer.from_pretrained(str(meta_dir))
    model = family.to_omni(family.build_hf(config), tokenizer)
    from ds_omni.model import lora
    meta = lora.load_meta(meta_dir)
    return (model if meta is None else lora.inject(model, meta, tokenizer)), tokenizer


def export_checkpoint(ckpt_root: str | Path, out_dir: str | Path, tag: str | None = None) -> Path:
    """A DeepSpeed checkpoint (any ZeRO stage) -> an HF directory."""
    root = Path(ckpt_root)
    meta = root / MODEL_META_DIR
    if not (meta / "config.json").is_file():
        raise ModelError(f"{str(meta)!r} is missing: {str(root)!r} was not written by ds-omni train")
    model, tokenizer = model_from_meta(meta)
    state = consolidate_checkpoint(root, tag, model)
    out = export_hf(model, out_dir, tokenizer, state_dict=state, model_dir=meta)
    (out / "ds_omni_export.json").write_text(json.dumps(
        {"checkpoint": str(root.resolve()), "tag": tag or _latest(root)}, indent=1))
    return out
