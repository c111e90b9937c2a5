"""3-D positions through the generic adapter (`generic.GenericFamily`): HF's own `get_rope_index`.

A family whose inner `...Model` has `get_rope_index` (Qwen2-VL's M-RoPE and its descendants,
HunYuan-VL's four axes, ...) gets each sample's positions from that method, called on a weightless
instance of the class (`rope_model`: on the meta device, it reads only the config) with the patch
grids HF's processor wrote into the items' meta (`hf_processor.GRID_KEYS`).

Dims: R rope axes, L tokens of one sample.
"""

from __future__ import annotations

import inspect

import torch

from ds_omni.model.families.hf_processor import GRID_KEYS


def rope_model(inner_cls, config):
    """An instance of the model's inner class with its config, on the meta device (no memory):
    HF's `get_rope_index` reads only the config and what `__init__` derives from it, so the
    positions come from HF's own code without the weights."""
    with torch.device("meta"):
        return inner_cls(config)


def rope_axes(config) -> int:
    """How many position rows the LLM's rotary embedding takes: one per `mrope_section` (3 for
    Qwen2-VL's t/h/w, 4 for HunYuan-VL's), 3 where the config does not say."""
    rope = getattr(config.get_text_config(), "rope_parameters", None) or {}
    return len(rope.get("mrope_section") or (0, 0, 0))


def rope_positions(model, input_ids: torch.Tensor, items, image_token_id: int,
                   video_token_id: int | None) -> torch.Tensor:
    """[R, L] positions of one sample from HF's own `get_rope_index` (R rope axes); text only:
    0..L-1 on every axis.

    `mm_token_type_ids` (1 on image tokens, 2 on video tokens) is what HF's processors make for
    the families whose `get_rope_index` takes it; the others find images by their tokens.
    """
    key = next((k for k in GRID_KEYS if any(k in item.meta for _, item in items)), None)
    if key is None:
        return torch.arange(input_ids.shape[0]).expand(rope_axes(model.config), -1).contiguous()
    kwargs = {key: torch.tensor([g for _, item in items for g in item.meta.get(key, [])])}
    params = inspect.signature(model.get_rope_index).parameters
    if "attention_mask" in params:  # all ones: one sample; Qwen3-Omni's fails without it
        kwargs["attention_mask"] = torch.ones_like(input_ids)[None]
    if "mm_token_type_ids" in params:
        types = (input_ids == image_token_id).int()  # [L]
        if video_token_id is not None:
            types = types + 2 * (input_ids == video_token_id).int()
        kwargs["mm_token_type_ids"] = types[None]
    pos, _ = model.get_rope_index(input_ids[None], **kwargs)
    return pos[:, 0]  # [R, 1, L] -> [R, L]
