"""LLaVA-NeXT: LLaVA with any-resolution tiling.

An image is resized onto the best grid of tower-sized tiles (`image_grid_pinpoints`) plus one
downscaled overview tile; the tiles' patch features are unpadded back to the image's aspect ratio
and a learned `image_newline` embedding ends each row. So the number of embeddings depends on the
image size: the item processor asks HF's processor for it, per image.

Why a dedicated file (the generic adapter is exact for LLaVA-NeXT too): one tower call over all
tiles of a micro-batch instead of one per image, and a processor built from the config when the
folder has none.

Dims: n images, K tiles of all images, S tower input size, P patches per tile, D LLM width.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.model.families.llava import (LlavaVisionEncoder, num_additional_image_tokens,
                                          saved_image_processor, select_features,
                                          tower_normalization, tower_seq_len)
from ds_omni.data.media import load_image
from ds_omni.model.families.registry import register
from ds_omni.model.family import Family
from ds_omni.model.omni import OmniModel, backbone_of


class LlavaNextProjector(nn.Module):
    """The MLP projector and the row-end embedding: both map vision features into the LLM."""

    def __init__(self, mlp: nn.Module, image_newline: nn.Parameter):
        super().__init__()
        self.mlp = mlp
        self.image_newline = image_newline


class LlavaNextVisionEncoder(LlavaVisionEncoder):
    """pixel_values [K, 3, S, S] + image_sizes [n, 2] + tiles [n] -> embeddings [N, D]."""

    def __init__(self, *, pack_fn, **kw):
        super().__init__(**kw)
        object.__setattr__(self, "_pack", pack_fn)  # HF's unpad-and-pack (a bound method)

    def attention_heads(self):
        return None  # an image's tiles are packed (unpadded) after the tower: long images run whole

    def encode(self, inputs):
        out = self.tower(inputs["pixel_values"], output_hidden_states=True, return_dict=True)
        feats = select_features(out.hidden_states, self.feature_layer, self.select_strategy)
        feats = self.projector.mlp(feats)  # [K, P, D]
        per_image = torch.split(feats, inputs["tiles"].tolist(), dim=0)  # n x [k_i, P, D]
        packed, _ = self._pack(per_image, inputs["image_sizes"], self.select_strategy,
                               image_newline=self.projector.image_newline)
        return torch.cat(packed, dim=0) if isinstance(packed, (list, tuple)) else packed  # [N, D]

    def dummy_inputs(self, device, dtype):
        s = self.image_size
        return {"pixel_values": torch.zeros(1, 3, s, s, device=device, dtype=dtype),
                "image_sizes": torch.tensor([[s, s]], device=device),
                "tiles": torch.tensor([1])}


class AnyResImageProcessor(ItemProcessor):
    """PIL image -> its tiles [k, 3, S, S] and size; the embedding count from HF's processor."""

    def __init__(self, hf_processor, placeholder_id: int, tile_seq_len: int):
        self.hf_processor = hf_processor  # a LlavaNextProcessor
        self.placeholder_id = placeholder_id
        self.tile_seq_len = tile_seq_len  # the tower's sequence per tile

    def process(self, image):
        out = self.hf_processor.image_processor(images=[load_image(image)], return_tensors="pt")
        tiles = out["pixel_values"][0]  # [k, 3, S, S]
        height, width = out["image_sizes"][0].tolist()
        size = tiles.shape[-1]
        n = self.hf_processor._get_number_of_features(height, width, size, size)
        if self.hf_processor.vision_feature_select_strategy == "default":
            n -= 1  # the processor counts the extra (CLS) state, which "default" drops
        return EncodedItem(inputs={"pixel_values": tiles, "image_sizes": out["image_sizes"][0]},
                           num_embeddings=n, meta={"tiles": tiles.shape[0], "height": height,
                                                   "width": width},
                           encoder_seqs=[self.tile_seq_len] * tiles.shape[0])

    def collate(self, items):
        return {"pixel_values": torch.cat([it.inputs["pixel_values"] for it in items]),
                "image_sizes": torch.stack([it.inputs["image_sizes"] for it in items]),
                "tiles": torch.tensor([it.inputs["pixel_values"].shape[0] for it in items])}


def anyres_processor(hf_config, tokenizer, model_dir: Path | None):
    """A LlavaNextProcessor with the model's saved image processor, else one matching the tower.

    The count of extra states per tile (CLS) always follows the tower, not a saved
    processor_config.json: a SigLIP tower has none, and counting one puts a placeholder too many
    per image.
    """
    from transformers import LlavaNextProcessor
    image_processor = saved_image_processor(model_dir)
    if image_processor is None:
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil)
        s = hf_config.vision_config.image_size
        image_processor = LlavaNextImageProcessorPil(
            size={"shortest_edge": s}, crop_size={"height": s, "width": s},
            image_grid_pinpoints=hf_config.image_grid_pinpoints,
            **tower_normalization(hf_config.vision_config))
    return LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer,
        patch_size=hf_config.vision_config.patch_size,
        vision_feature_select_strategy=hf_config.vision_feature_select_strategy,
        image_token=tokenizer.convert_ids_to_tokens(hf_config.image_token_id),
        num_additional_image_tokens=num_additional_image_tokens(hf_config.vision_config))


class LlavaNext(Family):
    name = "llava_next"
    model_types = ("llava_next",)
    hf_class = "LlavaNextForConditionalGeneration"

    def to_omni(self, hf_model, tokenizer=None) -> OmniModel:
        config, inner = hf_model.config, hf_model.model
        encoder = LlavaNextVisionEncoder(
            tower=inner.vision_tower,
            projector=LlavaNextProjector(inner.multi_modal_projector, inner.image_newline),
            placeholder_id=config.image_token_id, feature_layer=config.vision_feature_layer,
            select_strategy=config.vision_feature_select_strategy,
            image_size=config.vision_config.image_size, pack_fn=inner.pack_image_features)
        return OmniModel(encoders={"vision": encoder},
                         backbone=backbone_of(inner.language_model, hf_model.lm_head, hf_model),
                         family=self, hf_model=hf_model)

    def item_processors(self, hf_config, model_dir=None, tokenizer=None):
        proc = anyres_processor(hf_config, tokenizer, model_dir)
        return {"vision": AnyResImageProcessor(proc, hf_config.image_token_id,
                                               tower_seq_len(hf_config.vision_config))}

    def save_processor(self, out_dir, hf_config, tokenizer, model_dir=None):
        anyres_processor(hf_config, tokenizer, model_dir).save_pretrained(str(out_dir))


register(LlavaNext())
