"""LoRA through peft: adapters on the linear layers of chosen parts, applied before DeepSpeed.

peft's `get_peft_model` injects the adapters into the HF model in place (each targeted
`nn.Linear` becomes a `lora.Linear` holding it as `base_layer`) and freezes everything else; the
OmniModel is then rebuilt over the same HF modules, so both see the adapters, DeepSpeed (any ZeRO
stage) trains them like any other parameter, and its checkpoints hold them. Targets are resolved
here to full HF module names, restricted to the chosen parts, so peft's own matching cannot reach
into a part the user did not name, and `PeftModel.from_pretrained` finds the same modules again.

Export (`hf_state`, `save_adapter`) leaves the live model as it is: "merged" folds each adapter
into its weight with peft's `get_delta_weight` (what `merge_and_unload` adds); "adapter" writes
the base weights plus peft's own adapter directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ds_omni.errors import ModelError

LORA_META = "ds_omni_lora.json"
ADAPTER_DIR = "adapter"


def lora_targets(model, parts: list[str], targets: list[str]) -> list[str]:
    """Full HF names of the linear layers of `parts` that `targets` name (by name or name suffix;
    "all-linear": all of them, the LM head excepted). A target that matches nothing is an error
    listing names that exist."""
    owner = {id(sub): part for part, modules in model.parts().items() for m in modules
             for sub in m.modules()}
    head = model.backbone.lm_head
    linear = [name for name, mod in model.hf_model.named_modules()
              if isinstance(mod, nn.Linear) and mod is not head and owner.get(id(mod)) in parts]
    if not linear:
        present = sorted(p for p, modules in model.parts().items() if modules)
        raise ModelError(f"model.lora.parts {parts}: no linear layer there for an adapter; this "
                         f"model's parts are {present}")
    if "all-linear" in targets:
        return linear
    chosen = []
    for target in targets:
        hits = [n for n in linear if n == target or n.endswith("." + target)]
        if not hits:
            names = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ModelError(f"model.lora.target_modules: {target!r} matches no linear layer of the "
                             f"parts {parts}. Their linear layers are named {names[:12]}"
                             f"{' ...' if len(names) > 12 else ''} (e.g. {linear[0]!r}); use those "
                             "names (a suffix such as \"self_attn.q_proj\" works too) or "
                             "\"all-linear\"")
        chosen += [n for n in hits if n not in chosen]
    return chosen


def peft_config(target_modules: list[str], rank: int, alpha: float, dropout: float):
    import peft
    return peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                           target_modules=list(target_modules), bias="none")


def apply_lora(model, cfg, tokenizer=None):
    """`model` (an OmniModel) with adapters on `cfg.parts` (a `LoraConfig`); returns the rebuilt
    OmniModel, in which only the adapters and `cfg.trainable` parts have gradients."""
    targets = lora_targets(model, cfg.parts, cfg.target_modules)
    meta = {"target_modules": targets, "rank": cfg.rank, "alpha": cfg.alpha,
            "dropout": cfg.dropout, "trainable": list(cfg.trainable), "export": cfg.export}
    return inject(model, meta, tokenizer)


def inject(model, meta: dict, tokenizer=None):
    """Adapters as `meta` (what `apply_lora` resolved, or a checkpoint's LORA_META) says."""
    import peft
    hf_model = model.hf_model
    peft_model = peft.get_peft_model(hf_model, peft_config(
        meta["target_modules"], meta["rank"], meta["alpha"], meta["dropout"]))
    new = model.family.to_omni(hf_model, tokenizer)
    for part in meta["trainable"]:
        for module in new.parts()[part]:
            module.requires_grad_(True)
    object.__setattr__(new, "peft_model", peft_model)  # kept out of the module tree, as hf_model
    object.__setattr__(new, "lora_meta", meta)
    return new


def save_meta(model, out_dir: Path) -> None:
    if getattr(model, "lora_meta", None) is not None:
        (Path(out_dir) / LORA_META).write_text(json.dumps(model.lora_meta, indent=1))


def load_meta(meta_dir: Path) -> dict | None:
    path = Path(meta_dir) / LORA_META
    return json.loads(path.read_text()) if path.is_file() else None


def lora_layers(hf_model) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer
    return {name: m for name, m in hf_model.named_modules() if isinstance(m, LoraLayer)}


def hf_state(model, merged: bool) -> dict[str, torch.Tensor]:
    """The HF state dict without adapter layers: each adapted layer's base weights under the plain
    layer's keys, with the adapter's update added when `merged`."""
    hf_model = model.hf_model
    layers = lora_layers(hf_model)
    state = {}
    for key, tensor in hf_model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        owner = module.removesuffix(".base_layer")
        if owner in layers and module.endswith(".base_layer"):
            if merged and leaf == "weight":
                tensor = tensor + layers[owner].get_delta_weight("default").to(tensor.dtype)
            state[f"{owner}.{leaf}"] = tensor
        elif ".lora_" not in key:  # the adapters' own weights stay out
            state[key] = tensor
    return state


def save_adapter(model, out_dir: Path) -> Path:
    """peft's adapter directory (adapter_config.json + adapter_model.safetensors)."""
    out = Path(out_dir) / ADAPTER_DIR
    model.peft_model.save_pretrained(str(out))
    return out
