"""LLaVA: a CLIP/SigLIP vision tower, a 2-layer MLP projector, a decoder-only LLM.

Every image is resized to the tower's square input and yields (image_size / patch_size)^2
embeddings (plus one with the "full" feature strategy on a CLIP tower, which keeps CLS; SigLIP
has no CLS).

Why a dedicated file, when the generic adapter is exact for LLaVA too (`ds-omni families`): it
batches the tower over all images of a micro-batch (the generic path calls it once per image),
builds the image processor from the config when a folder has none, and compositions of a CLIP or
SigLIP tower with any LLM are built as LLaVA.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.data.media import image_size, load_image
from ds_omni.model.families.registry import register
from ds_omni.model.family import Family
from ds_omni.model.omni import ModalityEncoder, OmniModel, backbone_of
from ds_omni.parallel import long_short


def select_features(hidden_states: tuple[torch.Tensor, ...], layer: int | list[int],
                    strategy: str) -> torch.Tensor:
    """LLaVA's feature choice: one layer's (or several layers' concatenated) patch states."""
    layers = [layer] if isinstance(layer, int) else layer
    pool = [hidden_states[i] for i in layers]  # each [N, 1 + P, C]
    if strategy == "default":  # drop CLS
        pool = [h[:, 1:] for h in pool]
    return torch.cat(pool, dim=-1)


class LlavaVisionEncoder(ModalityEncoder):
    """pixel_values [N, 3, S, S] -> projected patch embeddings [N * P, D]."""

    modality = "image"

    def __init__(self, *, feature_layer, select_strategy: str, image_size: int, **kw):
        super().__init__(**kw)
        self.feature_layer = feature_layer
        self.select_strategy = select_strategy
        self.image_size = image_size

    def encode(self, inputs):
        out = self.tower(inputs["pixel_values"], output_hidden_states=True, return_dict=True)
        feats = select_features(out.hidden_states, self.feature_layer, self.select_strategy)
        return self.projector(feats).flatten(0, 1)  # [N, P, D] -> [N * P, D]

    # A long image: each rank of the group runs the tower on a piece of its 1 + P tokens.
    def attention_heads(self):
        return self.tower.config.num_attention_heads

    def piece_tokens(self, inputs, rows):
        cls = int(self.select_strategy == "default")  # row i is token i + 1 when CLS is dropped
        return (0, *(r + cls for r in rows[1:]))

    def encode_piece(self, inputs, shard):
        with long_short.sharded(self.tower.config, shard), \
                long_short.cut_input(long_short.first_layer(self.tower), shard, dim=1):
            out = self.tower(inputs["pixel_values"], output_hidden_states=True, return_dict=True)
        full = shard.tokens[-1]
        # states before the first layer are whole; the others are this rank's piece [1, L_r, C]
        states = tuple(h if h.shape[1] != full else shard.cut(h, 1) for h in out.hidden_states)
        feats = select_features(states, self.feature_layer, "full")
        if self.select_strategy == "default" and shard.rank == 0:
            feats = feats[:, 1:]  # CLS sits in the first piece
        return self.projector(feats).flatten(0, 1)  # [1, rows_r, D] -> [rows_r, D]

    def dummy_inputs(self, device, dtype):
        return {"pixel_values": torch.zeros(1, 3, self.image_size, self.image_size,
                                            device=device, dtype=dtype)}


class ClipImageProcessor(ItemProcessor):
    """Image -> pixel_values [3, S, S] through the model's HF image processor.

    Every image is resized to the tower's input, so its size is known without decoding it:
    `measure` only checks that the image header reads.
    """

    def __init__(self, hf_processor, num_embeddings: int, placeholder_id: int, seq_len: int):
        self.hf_processor = hf_processor
        self.num_embeddings = num_embeddings
        self.placeholder_id = placeholder_id
        self.seq_len = seq_len  # the tower's sequence: patches (+ CLS)

    def process(self, image):
        pixels = self.hf_processor(images=[load_image(image)], return_tensors="pt")["pixel_values"][0]
        return EncodedItem(inputs={"pixel_values": pixels}, num_embeddings=self.num_embeddings,
                           encoder_seqs=[self.seq_len])

    def measure(self, image):
        image_size(image)
        return EncodedItem(inputs={}, num_embeddings=self.num_embeddings, encoder_seqs=[self.seq_len])


def has_cls(vision_config) -> bool:
    """CLIP prepends a CLS state to the patch states; SigLIP does not."""
    return vision_config.model_type.startswith("clip")


def num_additional_image_tokens(vision_config) -> int:
    """The tower's states per image beyond its patches, as HF's LLaVA processors count them."""
    return int(has_cls(vision_config))


def tower_normalization(vision_config) -> dict[str, list[float]]:
    """The tower's pixel mean and std: CLIP's (OpenAI's) or SigLIP's (0.5, 0.5)."""
    if has_cls(vision_config):
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as Proc
    else:
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil as Proc
    return {"image_mean": list(Proc.image_mean), "image_std": list(Proc.image_std)}


def saved_image_processor(model_dir: Path | None):
    """The HF image processor saved in `model_dir`, or None.

    transformers < 5 saves it as preprocessor_config.json; 5.x nests it in processor_config.json
    when the whole processor is saved.
    """
    if model_dir is None:
        return None
    model_dir = Path(model_dir)
    processor_file = model_dir / "processor_config.json"
    if not ((model_dir / "preprocessor_config.json").is_file() or (
            processor_file.is_file() and "image_processor" in json.loads(processor_file.read_text()))):
        return None
    from transformers import AutoImageProcessor
    return AutoImageProcessor.from_pretrained(str(model_dir))


def clip_image_processor(vision_config, model_dir: Path | None):
    """The HF image processor saved in `model_dir`, else one matching the tower's input size."""
    saved = saved_image_processor(model_dir)
    if saved is not None:
        return saved
    size = vision_config.image_size
    if has_cls(vision_config):
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        return CLIPImageProcessorPil(size={"shortest_edge": size},
                                     crop_size={"height": size, "width": size})
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    return SiglipImageProcessorPil(size={"height": size, "width": size})


def tower_seq_len(vision_config) -> int:
    """The tower's sequence per image: patches, plus CLS for CLIP."""
    return (vision_config.image_size // vision_config.patch_size) ** 2 + has_cls(vision_config)


def tokens_per_image(config) -> int:
    """Hidden states per image minus the one "default" drops."""
    return tower_seq_len(config.vision_config) - (config.vision_feature_select_strategy == "default")


class Llava(Family):
    name = "llava"
    model_types = ("llava",)
    hf_class = "LlavaForConditionalGeneration"

    def to_omni(self, hf_model, tokenizer=None) -> OmniModel:
        config, inner = hf_model.config, hf_model.model
        encoder = LlavaVisionEncoder(
            tower=inner.vision_tower, projector=inner.multi_modal_projector,
            placeholder_id=config.image_token_id, feature_layer=config.vision_feature_layer,
            select_strategy=config.vision_feature_select_strategy,
            image_size=config.vision_config.image_size)
        return OmniModel(encoders={"vision": encoder},
                         backbone=backbone_of(inner.language_model, hf_model.lm_head, hf_model),
                         family=self, hf_model=hf_model)

    def item_processors(self, hf_config, model_dir=None, tokenizer=None):
        hf_proc = clip_image_processor(hf_config.vision_config, model_dir)
        return {"vision": ClipImageProcessor(hf_proc, tokens_per_image(hf_config),
                                             hf_config.image_token_id,
                                             tower_seq_len(hf_config.vision_config))}

    def save_processor(self, out_dir, hf_config, tokenizer, model_dir=None):
        from transformers import LlavaProcessor
        image_processor = clip_image_processor(hf_config.vision_config, model_dir)
        LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                       patch_size=hf_config.vision_config.patch_size,
                       vision_feature_select_strategy=hf_config.vision_feature_select_strategy,
                       image_token=tokenizer.convert_ids_to_tokens(hf_config.image_token_id),
                       num_additional_image_tokens=num_additional_image_tokens(
                           hf_config.vision_config)).save_pretrained(str(out_dir))


register(Llava())
