"""Qwen2-VL: a ViT over native-resolution patch grids, a patch merger, a Qwen2 LLM with M-RoPE.

An image is resized (aspect kept) to multiples of patch_size * merge_size and cut into a t x h x w
patch grid; the tower attends within each image; the merger folds merge_size^2 patches into one
embedding, written as <|vision_start|> <|image_pad|> * n <|vision_end|>. Images of any size share
a micro-batch (`image_grid_thw` says where each ends). A video is the same with t > 1
(`qwen2_vl_video`, <|video_pad|>). Qwen2.5-VL (window attention, video time in seconds) is a
subclass below. M-RoPE: three positions a token (temporal, height, width); text has all three
equal; an image's tokens sit at (s, s + row, s + col) and the text after resumes at
s + max(rows, cols); a video's temporal patch k at s + k (Qwen2-VL) or
s + floor(k x tokens_per_second x seconds per temporal patch) (Qwen2.5-VL).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch
from torch import nn

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.errors import ModelError
from ds_omni.data.media import load_image
from ds_omni.model.families.qwen2_vl_video import (Qwen2VLVideoItemProcessor, VideoSettings,
                                                  video_processor_entry)
from ds_omni.model.families.registry import register
from ds_omni.model.family import Family
from ds_omni.model.omni import ModalityEncoder, OmniModel, backbone_of
from ds_omni.parallel import long_short
from ds_omni.parallel.long_short import EncoderShard


# ------------------------------------------------------------------------------------- encoder
class Qwen2VLVisionEncoder(ModalityEncoder):
    """pixel_values [P, C*T*p*p] + image_grid_thw [n, 3] -> embeddings [P / m^2, D], in image order.

    Dims: P patches of all n images of the micro-batch, E tower width, m merge size, D LLM width.
    The tower runs as HF's `Qwen2VisionTransformerPretrainedModel.forward` does, from the same
    modules and the same HF helpers, so the numbers are HF's; the merger is the projector.
    """

    modality = "image"

    def __init__(self, *, vision_config, **kw):
        super().__init__(**kw)
        self.vision_config = vision_config

    def encode(self, inputs):
        grid = inputs["image_grid_thw"]  # [n, 3]
        hidden = self.tower_states(inputs["pixel_values"], grid)  # [P, E]
        return self.projector(hidden)  # [P, E] -> [P / m^2, D]

    def tower_states(self, pixel_values: torch.Tensor, grid: torch.Tensor,
                     shard: EncoderShard | None = None) -> torch.Tensor:
        """Patch states of the last block [P, E]; attention stays inside each image (cu_seqlens).

        With `shard` (one long image): this rank's piece [P_r, E], its blocks attending over the
        whole image through Ulysses attention.
        """
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids
        tower = self.tower
        hidden = tower.patch_embed(pixel_values)  # [P, C*T*p*p] -> [P, E]
        # 2-D rotary positions (row, col) of each patch, in the merger's block order
        rotary = tower.rotary_pos_emb(hidden, get_vision_position_ids(
            grid, self.vision_config.spatial_merge_size))
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, self.vision_config)
        context = contextlib.nullcontext()
        if shard is not None:
            hidden = shard.cut(hidden, 0)
            rotary = tuple(shard.cut(t, 0) for t in rotary)  # (cos, sin), each [P, d] -> [P_r, d]
            context = long_short.sharded(tower.blocks[0].attn.config, shard)  # the blocks' config
        with context:
            for block in tower.blocks:
                hidden = block(hidden, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                               position_embeddings=rotary)
        return hidden

    # A long image: pieces are whole merge blocks (m x m patches, one embedding each).
    def attention_heads(self):
        return getattr(self.vision_config, "num_heads", None) or self.vision_config.num_attention_heads

    def piece_tokens(self, inputs, rows):
        return tuple(r * self.vision_config.spatial_merge_size ** 2 for r in rows)

    def encode_piece(self, inputs, shard):
        hidden = self.tower_states(inputs["pixel_values"], inputs["image_grid_thw"], shard)
        return self.projector(hidden)  # [P_r, E] -> [P_r / m^2, D]

    def dummy_inputs(self, device, dtype):
        """One image of one merge block (m x m patches), which yields one embedding."""
        vc = self.vision_config
        m = vc.spatial_merge_size
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        return {"pixel_values": torch.zeros(m * m, patch_dim, device=device, dtype=dtype),
                "image_grid_thw": torch.tensor([[1, m, m]], device=device)}


def vision_tower(visual: nn.Module) -> nn.ModuleDict:
    """HF's vision transformer without its merger: the merger is registered as the projector, so
    freezing "vision" and "projector" act on disjoint parameters, each registered once."""
    return nn.ModuleDict({"patch_embed": visual.patch_embed,
                          "rotary_pos_emb": visual.rotary_pos_emb, "blocks": visual.blocks})


# ------------------------------------------------------------------------------------- items
class Qwen2VLItemProcessor(ItemProcessor):
    """PIL image -> its patches [p, C*T*p*p] and grid [3] through HF's Qwen2-VL image processor."""

    def __init__(self, hf_processor, *, merge_size: int, image_token_id: int,
                 vision_start_id: int, vision_end_id: int):
        self.hf_processor = hf_processor
        self.merge_size = merge_size
        self.placeholder_id = image_token_id
        self.vision_start_id = vision_start_id
        self.vision_end_id = vision_end_id

    def process(self, image):
        out = self.hf_processor(images=[load_image(image)], return_tensors="pt")
        grid = out["image_grid_thw"][0]  # [3]: t, h, w in patches
        patches = int(grid.prod())
        return EncodedItem(inputs={"pixel_values": out["pixel_values"], "image_grid_thw": grid},
                           num_embeddings=patches // self.merge_size ** 2,
                           meta={"grid_thw": tuple(grid.tolist()), "patches": patches,
                                 "placeholder_id": self.placeholder_id,
                                 "merge_size": self.merge_size}, encoder_seqs=[patches])

    def tokens(self, item):
        pads = [self.placeholder_id] * item.num_embeddings
        return [self.vision_start_id, *pads, self.vision_end_id]

    def collate(self, items):
        """Patches of all images end to end [sum p, C*T*p*p]; grids [n, 3] say where each ends."""
        return {"pixel_values": torch.cat([it.inputs["pixel_values"] for it in items]),
                "image_grid_thw": torch.stack([it.inputs["image_grid_thw"] for it in items])}


def qwen2_vl_image_processor(vision_config, model_dir: Path | None):
    """HF's PIL Qwen2-VL image processor: with the settings saved in the model dir, if any.

    The PIL one (not `AutoImageProcessor`, which picks the torchvision one when torchvision is
    installed and resizes with another kernel) so pixels do not depend on what is installed.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    saved = model_dir is not None and any((Path(model_dir) / f).is_file() for f in
                                          ("processor_config.json", "preprocessor_config.json"))
    if saved:
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    else:
        processor = Qwen2VLImageProcessorPil(patch_size=vision_config.patch_size,
                                             temporal_patch_size=vision_config.temporal_patch_size,
                                             merge_size=vision_config.spatial_merge_size)
    check_patching(processor, vision_config, model_dir)
    return processor


def check_patching(processor, vision_config, model_dir) -> None:
    """The image processor must cut patches the way the tower embeds and merges them."""
    pairs = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
             "merge_size": "spatial_merge_size"}
    bad = {k: (getattr(processor, k), getattr(vision_config, v)) for k, v in pairs.items()
           if getattr(processor, k) != getattr(vision_config, v)}
    if bad:
        facts = ", ".join(f"{k}={p} but the vision config has {c}" for k, (p, c) in bad.items())
        raise ModelError(f"the image processor saved in {str(model_dir)!r} does not fit the model: "
                         f"{facts}; fix its processor_config.json/preprocessor_config.json, or "
                         "remove it to use the model config's values")


# ------------------------------------------------------------------------------------- M-RoPE
def mrope_position_ids(input_ids: torch.Tensor, grids: list, placeholder_ids,
                       merge_size: int, time_intervals: list | None = None) -> torch.Tensor:
    """[3, L] (temporal, height, width) positions of one sample, as HF's `get_rope_index` has them.

    `grids`: the (t, h, w) patch grid of each image or video, in text order; item i owns the next
    t*h*w / merge_size^2 tokens of its placeholder, `placeholder_ids[i]` (one id: the same for
    all; a video's is the video token). A video's slices sit at temporal offsets k *
    `time_intervals[i]` (Qwen2-VL: 1, whatever the frame rate; Qwen2.5-VL: tokens per second x
    seconds per slice). A sample without items gets 0..L-1 three times.
    """
    ids = input_ids.tolist()
    slots = {placeholder_ids} if isinstance(placeholder_ids, int) else set(placeholder_ids)
    if isinstance(placeholder_ids, int):
        placeholder_ids = [placeholder_ids] * len(grids)
    intervals = time_intervals or [1.0] * len(grids)
    pieces, pos, i, items = [], 0, 0, iter(zip(grids, placeholder_ids, intervals))
    while i < len(ids):
        if ids[i] not in slots:
            run = _text_run(ids, i, slots)
            pieces.append(torch.arange(pos, pos + run).expand(3, run))
            pos, i = pos + run, i + run
            continue
        grid, token, interval = next(items, (None, None, None))
        if grid is None:
            raise ModelError(f"image token at position {i} has no image: the sample has "
                             f"{len(grids)} images but more image placeholder tokens")
        block = image_positions(grid, merge_size, interval) + pos  # [3, n]
        if ids[i:i + block.shape[1]] != [token] * block.shape[1]:
            raise ModelError(f"the image at token {i} needs {block.shape[1]} consecutive image "
                             "placeholder tokens, fewer are there")
        pieces.append(block)
        pos += max(int(grid[1]), int(grid[2])) // merge_size
        i += block.shape[1]
    if next(items, None) is not None:
        raise ModelError(f"{len(grids)} images but fewer image placeholder runs in the sample")
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)


def _text_run(ids: list[int], start: int, slots: set[int]) -> int:
    end = start
    while end < len(ids) and ids[end] not in slots:
        end += 1
    return end - start


def image_positions(grid, merge_size: int, time_interval=1.0) -> torch.Tensor:
    """[3, t * h' * w'] offsets (frame, row, col) of one image's merged tokens, row-major; frame
    k's time offset is floor(k * time_interval), as HF computes it.

    Dims: h' = h / merge_size, w' = w / merge_size (the merged grid).
    """
    t, h, w = int(grid[0]), int(grid[1]) // merge_size, int(grid[2]) // merge_size
    frames = (torch.arange(t) * time_interval).long()
    frame, row, col = torch.meshgrid(frames, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([frame, row, col]).reshape(3, -1)  # [3, t, h', w'] -> [3, t*h'*w']


# ------------------------------------------------------------------------------------- family
class Qwen2VL(Family):
    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    hf_class = "Qwen2VLForConditionalGeneration"
    processor_class = "Qwen2VLProcessor"
    vision_encoder = Qwen2VLVisionEncoder

    def to_omni(self, hf_model, tokenizer=None) -> OmniModel:
        config, inner = hf_model.config, hf_model.model
        encoder = self.vision_encoder(
            tower=vision_tower(inner.visual), projector=inner.visual.merger,
            placeholder_id=config.image_token_id, vision_config=config.vision_config,
            more_placeholder_ids=(config.video_token_id,))  # videos run through the same tower
        return OmniModel(encoders={"vision": encoder},
                         backbone=backbone_of(inner.language_model, hf_model.lm_head, hf_model),
                         family=self, hf_model=hf_model)

    def item_processors(self, hf_config, model_dir=None, tokenizer=None):
        vc = hf_config.vision_config
        hf_proc = qwen2_vl_image_processor(vc, model_dir)
        return {"vision": Qwen2VLItemProcessor(
            hf_proc, merge_size=vc.spatial_merge_size, image_token_id=hf_config.image_token_id,
            vision_start_id=hf_config.vision_start_token_id,
            vision_end_id=hf_config.vision_end_token_id),
            "video": Qwen2VLVideoItemProcessor(
                VideoSettings.from_saved(video_processor_entry(vc, model_dir), vc),
                video_token_id=hf_config.video_token_id,
                vision_start_id=hf_config.vision_start_token_id,
                vision_end_id=hf_config.vision_end_token_id,
                tokens_per_second=self.tokens_per_second(vc))}

    def tokens_per_second(self, vision_config) -> int | None:
        """M-RoPE time steps per second of video; None: one step per temporal patch (Qwen2-VL)."""
        return None

    def position_ids(self, input_ids, items):
        """[3, L] M-RoPE positions; an image's or video's meta has its grid, placeholder id and
        merge size."""
        images = [item.meta for enc, item in items if enc == "vision"]
        if not images:  # text only: HF uses 0..L-1 on all three axes
            return torch.arange(input_ids.shape[0]).expand(3, -1).contiguous()
        return mrope_position_ids(input_ids, [m["grid_thw"] for m in images],
                                  [m["placeholder_id"] for m in images], images[0]["merge_size"],
                                  [m.get("time_interval", 1.0) for m in images])

    def save_processor(self, out_dir, hf_config, tokenizer, model_dir=None):
        """Write a Qwen2VLProcessor: tokenizer files plus processor_config.json.

        HF's `Qwen2VLProcessor` cannot be built without torchvision (its constructor demands a
        video processor, and HF's are torchvision-only), and torchvision is no ds_omni
        dependency; so the files its `save_pretrained` writes are written here from the image
        processor and a video processor entry. `AutoProcessor` loads them wherever HF's Qwen2-VL
        processor itself can be used (with torchvision).
        """
        out = Path(out_dir)
        image_processor = qwen2_vl_image_processor(hf_config.vision_config, model_dir)
        _processor_tokenizer(tokenizer, hf_config).save_pretrained(str(out))
        processor_config = {
            "processor_class": self.processor_class,
            "image_processor": json.loads(image_processor.to_json_string()),
            "video_processor": video_processor_entry(hf_config.vision_config, model_dir),
        }
        (out / "processor_config.json").write_text(json.dumps(processor_config, indent=2,
                                                              sort_keys=True) + "\n")


def _processor_tokenizer(tokenizer, hf_config):
    """The tokenizer with `image_token` / `video_token` naming the config's placeholder tokens.

    Qwen2VLProcessor expands `tokenizer.image_token` when the tokenizer has one, else
    "<|image_pad|>"; a tokenizer whose image_token is another token (the demo tokenizer's is
    "<image>") would make the exported processor expand a token the model never replaces. A copy is
    changed, never the caller's tokenizer.
    """
    want = {attr: tokenizer.convert_ids_to_tokens(token_id) for attr, token_id in
            (("image_token", hf_config.image_token_id), ("video_token", hf_config.video_token_id))
            if token_id is not None and token_id < len(tokenizer)}
    if all(getattr(tokenizer, attr, None) == token for attr, token in want.items()):
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    for attr, token in want.items():
        setattr(tokenizer, attr, token)
    return tokenizer


class Qwen2_5VLVisionEncoder(Qwen2VLVisionEncoder):
    """Qwen2.5-VL's tower: window attention (full attention in `fullatt_block_indexes`) over
    patches reordered into windows, RMSNorm, gated MLPs. Its forward is HF's own, so the window
    order and its undoing around the merger are HF's; the module it runs is the same as the
    registered tower (patch_embed, rotary_pos_emb, blocks) + projector (merger)."""

    def encode(self, inputs):  # [P, C*T*p*p] -> [P / m^2, D]
        return self.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output

    def attention_heads(self):
        """None: no pieces for long-short SP (its windows reorder patches across the whole item,
        which Qwen2-VL's piece path does not do), so a long item runs whole on one rank."""
        return None


class Qwen2_5VL(Qwen2VL):
    """Qwen2.5-VL: Qwen2-VL's layout (image processor, tokens, M-RoPE) with a windowed ViT and
    a video time axis in seconds (`tokens_per_second` x seconds per temporal patch)."""

    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    hf_class = "Qwen2_5_VLForConditionalGeneration"
    processor_class = "Qwen2_5_VLProcessor"
    vision_encoder = Qwen2_5VLVisionEncoder

    def to_omni(self, hf_model, tokenizer=None) -> OmniModel:
        omni = super().to_omni(hf_model, tokenizer)
        # the whole ViT, unregistered: its parameters are registered once, as tower + projector
        object.__setattr__(omni.encoders["vision"], "visual", hf_model.model.visual)
        return omni

    def tokens_per_second(self, vision_config) -> int | None:
        return int(vision_config.tokens_per_second)


register(Qwen2VL())
register(Qwen2_5VL())
