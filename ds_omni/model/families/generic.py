"""The generic adapter: any transformers image-text-to-text model built on the common pattern.

Most VLMs of transformers 5.x have a vision tower and projector behind `get_image_features`, whose
output replaces the image placeholder tokens, and a decoder-only `language_model`. For those
nothing family-specific is written: HF's processor (`hf_processor`), `get_image_features` and
`get_rope_index` (`hf_rope`) are routed through ds_omni's per-item representation, one tower call
per image (so images of different sizes never share a batch layout). Sliding windows,
bidirectional blocks from `token_type_ids` (`BIDIRECTIONAL`), deepstack levels (`deepstack.py`),
indicator tokens and numbers applied outside the modules (`outside.py`) follow HF. A family that
deviates otherwise is refused by `class_problem` / `config_problem`, never trained with other
numbers. LLaVA, LLaVA-NeXT and Qwen2-VL keep dedicated files (batched towers, processors built
from the config, video). More: docs/models.md, "The generic adapter".

Dims: n images of a micro-batch, N embeddings of all of them, D LLM width, L tokens of one sample.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
from torch import nn

from ds_omni.errors import ModelError
from ds_omni.model import deepstack
from ds_omni.model.families.hf_processor import (INDICATOR_SLOTS, GenericItemProcessor,
                                                 appended_text, hf_class_of, hf_folder,
                                                 list_inputs, load_hf_processor, processor_marker)
from ds_omni.model.families.hf_rope import rope_model, rope_positions
from ds_omni.model.families.hf_video import (VIDEO_INPUT, VIDEO_PROCESSORS, video_item_processor,
                                             video_token_id)
from ds_omni.model.family import Family
from ds_omni.model.omni import NORM_NAMES, ModalityEncoder, OmniModel, backbone_of, final_norm

HOOKS = ("get_image_features",)
"""What the generic path calls. HF's `get_placeholder_mask` (image token == placeholder, checked
against the feature count) is what `OmniModel.embed` does itself on the host, so a family that
merges by the same rule under another name (Idefics3's `inputs_merger`) fits too."""
BACKBONE_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
BIDIRECTIONAL = {"gemma3": "images", "paligemma": "prefix"}
"""HF model folder -> how its `token_type_ids` mask opens causal attention, as its forward builds
it: "images", each run of image tokens is one block (`get_block_sequence_ids_for_mask`); "prefix",
everything before the first trained token is one block (PaliGemma's prompt, `token_type_ids == 0`)."""
MOE_TYPES = "moe_mm_token_type_ids"
"""ERNIE-4.5-VL's per-token modality ids, which its decoder layers route MoE experts by
(`GenericFamily.layer_inputs`)."""
POSITION_OFFSET = {"paligemma": 1}
"""HF model folder -> what its forward adds to 0-based positions (PaliGemma's are 1-indexed)."""
_TOWER_NAMES = ("vision", "visual", "image_encoder", "tower", "audio", "vqmodel")
_LLM_NAMES = ("language_model", "text_model", "llm")


def llm_name(inner: nn.Module) -> str:
    """The attribute of `inner` holding its decoder-only LLM; "" when `inner` is the LLM itself
    (Chameleon, Emu3: embed_tokens, layers and norm sit next to the image tokenizer)."""
    for name in _LLM_NAMES:
        if isinstance(getattr(inner, name, None), nn.Module):
            return name
    if all(hasattr(inner, p) for p in ("embed_tokens", "layers", "rotary_emb")):
        return ""
    raise ModelError(f"{type(inner).__name__} has none of {list(_LLM_NAMES)}: the generic adapter "
                     "cannot find its language model")


# ------------------------------------------------------------------------------ what fits
def inner_class(hf_class, model_type: str | None = None):
    """The `...Model` class inside `...ForConditionalGeneration` (it holds the hooks), or None: by
    name, else the base model class transformers' AutoModel maps `model_type` to, where it lives
    next to `hf_class` (MiniMax-M3's MiniMaxM3SparseForConditionalGeneration holds a
    MiniMaxM3VLModel)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    module = inspect.getmodule(hf_class)
    for suffix in ("ForConditionalGeneration", "ForCausalLM"):
        if hf_class.__name__.endswith(suffix):
            found = getattr(module, hf_class.__name__[:-len(suffix)] + "Model", None)
            if found is not None:
                return found
    base = MODEL_MAPPING_NAMES.get(model_type) if model_type else None
    if not isinstance(base, str) or base == hf_class.__name__:  # Llama 4: the class itself
        return None
    return getattr(module, base, None)




def class_problem(model_type: str) -> str | None:
    """Why the generic adapter cannot take `model_type` from its classes alone, or None."""
    hf_class = hf_class_of(model_type)
    if hf_class is None:
        return "not in transformers' image-text-to-text mapping (or its class does not import)"
    inner = inner_class(hf_class, model_type)
    if inner is None:
        return (f"{hf_class.__name__} has no inner ...Model holding the vision tower and the "
                "language model")
    missing = [h for h in HOOKS if not hasattr(inner, h)]
    if missing:
        return f"{inner.__name__} has no {' / '.join(missing)} (image-feature hooks)"
    forward = inspect.signature(hf_class.forward).parameters
    if "token_type_ids" in forward and "mm_token_type_ids" not in forward and (
            hf_folder(hf_class) not in BIDIRECTIONAL):
        return ("its attention mask depends on token_type_ids in its own way; ds_omni's packed "
                "attention builds only Gemma 3's image blocks and PaliGemma's prefix")
    return merge_problem(inner)


ADDED_FEATURES = re.compile(
    r"masked_scatter\(\s*special_image_mask,\s*inputs_embeds\[special_image_mask\]\s*\+")
"""A forward that adds the image features onto the placeholder tokens' embeddings (Molmo 2)."""
ONE_IMAGE_BLOCK = re.compile(r"torch\.where\(mm_token_type_ids[^\n]*== 1, 0, -1\)")
"""A forward whose mask puts every image token of a sample in block 0 (Molmo 2)."""


def merge_problem(inner) -> str | None:
    """Why the way `inner.forward` (the `...Model` class) merges image features or masks image
    tokens differs from the generic path's (features replace the placeholder embeddings; image
    blocks are contiguous runs), read from its source; None when neither is found."""
    try:
        code = inspect.getsource(inner.forward)
    except (OSError, TypeError):
        return None
    found = []
    if ADDED_FEATURES.search(code):
        found.append("adds the image features onto the placeholder tokens' embeddings (a "
                     "residual merge), where the generic path puts the features in their place")
    if ONE_IMAGE_BLOCK.search(code):
        found.append("makes all image tokens of a sample one bidirectional block (block id 0 "
                     "from mm_token_type_ids: the tokens of one image also see those of the "
                     "images after it, across the text between them), where ds_omni's blocks "
                     "are contiguous spans")
    return f"its forward {'; and it '.join(found)}" if found else None


def config_problem(config) -> str | None:
    """Why a model with this HF config would not be exact through the generic path, or None."""
    text = config.get_text_config()
    problem = per_layer_problem(text) or cross_layer_problem(text)
    if problem is not None:
        return problem
    hf_class = hf_class_of(config.model_type)
    from ds_omni.model import outside  # multipliers, soft-capping: followed where known
    problem = outside.problem(hf_class, text)
    if problem is not None:
        return problem
    if getattr(text, "use_bidirectional_attention", False) and (
            hf_class is None or hf_folder(hf_class) not in BIDIRECTIONAL):
        # (PaliGemma sets it, but its forward's prefix mask decides, as BIDIRECTIONAL builds it)
        return "its LLM attends both ways everywhere (use_bidirectional_attention); not a decoder"
    from ds_omni.model.per_sample import layer_types_problem
    return layer_types_problem(getattr(text, "layer_types", None))


def per_layer_problem(text) -> str | None:
    """Why Gemma 4's per-layer extras keep this LLM off the generic backbone, or None."""
    if getattr(text, "hidden_size_per_layer_input", 0):
        return ("its LLM feeds every decoder layer its own per-layer input embeddings "
                "(hidden_size_per_layer_input, Gemma 4's PLE); the backbone calls its layers "
                "without them")
    if getattr(text, "num_kv_shared_layers", 0):
        return ("its last num_kv_shared_layers decoder layers reuse the keys and values of "
                "earlier ones (Gemma 4); ds_omni has not checked that sharing under packing, "
                "SP and pipeline stages")
    if getattr(text, "use_bidirectional_attention", None) == "vision":
        return ("its image tokens attend to each other both ways (use_bidirectional_attention "
                "\"vision\", Gemma 4 Unified): each run of image or video tokens is one block, as "
                "Gemma 3's image runs, but on sliding layers its forward opens the block on top of "
                "the window (windowed causal OR block: a run wider than sliding_window is seen "
                "whole), where Gemma 3's mask and ds_omni's kernel keep the window over the block "
                "(window AND (causal OR block)); its generate path builds Gemma 4's masks instead "
                "(causal full layers, windowed blocks on sliding ones), so its training and "
                "serving masks differ")
    return None


def cross_layer_problem(text) -> str | None:
    """Why layers of this LLM that reuse what an earlier layer computed (Mistral Large 4's shared
    indexer and latent KV) keep it off the backbone, or None."""
    shared = [i for i, t in enumerate(getattr(text, "indexer_types", None) or ()) if t == "shared"]
    if shared:
        return (f"its layers {shared} reuse the top-k pick of an earlier indexer layer "
                "(indexer_types \"shared\", Mistral Large 4); the backbone runs its indexed "
                "layers one sample at a time and hands a layer no earlier layer's pick")
    sources = getattr(text, "kv_source_layers", None) or ()
    reused = [i for i, s in enumerate(sources) if s != i]
    if reused:
        return (f"its layers {reused} attend to the latent keys and values of an earlier layer "
                "(kv_source_layers, Mistral Large 4); ds_omni has not checked that sharing under "
                "packing, per-sample layers and pipeline stages")
    return None


def generic_family(model_type: str) -> "GenericFamily":
    """The generic adapter for `model_type`; a clear error when the model lacks the hooks."""
    problem = class_problem(model_type)
    if problem is not None:
        raise ModelError(
            f"model_type {model_type!r} cannot be loaded by ds_omni's generic adapter: {problem}. "
            "Compose the model from parts instead (model.llm plus model.vision, see "
            "docs/models.md), or add a dedicated adapter, one file in ds_omni/model/families/ "
            "(see generic.py and qwen2_vl.py)")
    return GenericFamily(model_type)


# ------------------------------------------------------------------------------ encoder
class GenericVisionEncoder(ModalityEncoder):
    """Per-image inputs (keys "<item>.<name>") -> the images' embeddings [N, D], in item order.

    Each image runs HF's `get_image_features` on the inputs HF's processor made for it alone, each
    video (`hf_video`: items with `pixel_values_videos`) HF's `get_video_features`.
    """

    modality = "image"

    def __init__(self, *, features_fn, family: "GenericFamily", video_fn=None, **kw):
        super().__init__(**kw)
        object.__setattr__(self, "_features", features_fn)  # HF's bound method (not a submodule)
        object.__setattr__(self, "_video_features", video_fn)
        object.__setattr__(self, "_family", family)  # holds the dummy image's inputs
        self.layout = deepstack.Layout()  # its deepstack levels (`GenericFamily.to_omni`)

    def encode(self, inputs):
        per_item: dict[int, dict[str, torch.Tensor]] = {}
        lists = self._family.list_inputs
        for key, value in inputs.items():
            index, name = key.split(".", 1)
            per_item.setdefault(int(index), {})[name] = value.tolist() if name in lists else value
        return torch.cat([self._item_rows(per_item[i])
                          for i in sorted(per_item)])  # n x [N_i, D] -> [N, D]

    def _item_rows(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One item's rows [N_i, D]: its image tokens', and its indicator tokens' in text order."""
        slots = inputs.pop(INDICATOR_SLOTS, None)
        out = (self._video_features if VIDEO_INPUT in inputs else self._features)(**inputs)
        rows = flat_features(out, self.layout)
        return rows if slots is None else with_indicators(rows, out.visual_indicator_features,
                                                          slots)

    def dummy_inputs(self, device, dtype):
        """A small blank image as HF's processor makes it (`GenericFamily.item_processors`)."""
        dummy = self._family.dummy
        if dummy is None:
            raise ModelError("the generic vision encoder has no dummy input yet: build the item "
                             "processors (family.item_processors) before training")
        return {f"0.{k}": v.to(device) for k, v in dummy.items()}




def indicator_ids(config) -> tuple[int, ...]:
    """The visual indicator tokens that the model's forward replaces by embeddings of its visual
    table wherever it has images (Ovis2's `visual_indicator_token_ids`: image start, grid, column,
    row and end marks), or () for a model without them."""
    return tuple(int(i) for i in getattr(config, "visual_indicator_token_ids", None) or ())


def with_indicators(rows: torch.Tensor, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """An item's image rows [n, D] and its model's indicator embeddings [m, D] -> its rows [L, D]
    in text order, by `slots` [L] (`INDICATOR_SLOTS`), as Ovis2's forward fills those tokens."""
    image = slots < 0
    if int(image.sum()) != rows.shape[0]:
        raise ModelError(f"the image yields {rows.shape[0]} embeddings but its tokens hold "
                         f"{int(image.sum())} image tokens between its indicator tokens; its "
                         "processor and model disagree on the image's size")
    index = torch.where(image, image.long().cumsum(0) - 1, rows.shape[0] + slots)  # [L]
    return torch.cat([rows, table.to(rows.dtype)]).index_select(0, index)


def flat_features(out, layout: deepstack.Layout = deepstack.Layout()) -> torch.Tensor:
    """What `get_image_features` returns -> [N, D], as HF's forward flattens it before
    `masked_scatter`; with deepstack levels (`layout`) -> [N, (1 + k) D], the levels side by side
    after the main rows (`ds_omni.model.deepstack`)."""
    return deepstack.feature_rows(out, layout)


def split_modules(inner: nn.Module) -> tuple[nn.ModuleDict, nn.Module]:
    """(tower, projector): the encoder modules, and every other non-LLM module or parameter of
    `inner` (projector, image_newline, ...), so each HF parameter is registered exactly once."""
    tower, rest, llm = nn.ModuleDict(), nn.ModuleDict(), llm_name(inner)
    own = {llm} if llm else {*BACKBONE_PARTS, *NORM_NAMES}  # "": the LLM's parts are children
    for name, child in inner.named_children():
        if name in own:
            continue
        (tower if any(v in name for v in _TOWER_NAMES) else rest)[name] = child
    params = dict(inner.named_parameters(recurse=False))
    projector = _Projector(rest, nn.ParameterDict(params))
    return tower, projector


def gather_with(module: nn.Module, params) -> None:
    """Parameters that HF's code reads as attributes (LLaVA-OneVision's `image_newline`), not
    through a submodule's forward: ZeRO-3 gathers them when `module` runs (DeepSpeed's external
    parameters), else they would stay partitioned there."""
    params = list(params)
    if params:
        from deepspeed.runtime.zero import register_external_parameter
        for param in params:
            register_external_parameter(module, param)


class _Projector(nn.Module):
    def __init__(self, modules: nn.ModuleDict, params: nn.ParameterDict):
        super().__init__()
        self.modules_ = modules
        self.params = params


# ------------------------------------------------------------------------------ family
class GenericFamily(Family):
    """One instance per model type (the HF class and position helper differ)."""

    def __init__(self, model_type: str):
        self.name = model_type
        self.model_types = (model_type,)
        self._hf = hf_class_of(model_type)
        self.hf_class = self._hf.__name__
        self._inner = inner_class(self._hf, model_type)
        self.bidirectional = BIDIRECTIONAL.get(hf_folder(self._hf))
        self._offset = POSITION_OFFSET.get(hf_folder(self._hf), 0)
        self._image_id: int | None = None  # set with the config (`_set_rope`)
        self._rope: nn.Module | None = None  # a weightless instance for HF's positions
        self.dummy: dict[str, torch.Tensor] | None = None
        self.list_inputs: tuple[str, ...] = ()  # set with the item processors
        self._moe_types: dict[int, list[int]] | None = None  # `layer_inputs` (set with the config)

    @property
    def takes_video(self) -> bool:
        """Whether videos are carried for this family (`hf_video.VIDEO_PROCESSORS`)."""
        return hf_folder(self._hf) in VIDEO_PROCESSORS

    def hf_model_class(self):
        return self._hf

    def check_config(self, config) -> None:
        problem = config_problem(config)
        if problem is not None:
            raise ModelError(f"{config.model_type!r} model cannot run through ds_omni's generic "
                             f"adapter exactly: {problem}. A dedicated adapter (one file in "
                             "ds_omni/model/families/) is needed for it")

    def to_omni(self, hf_model, tokenizer=None) -> OmniModel:
        self.check_config(hf_model.config)
        inner = hf_model.model
        llm = getattr(inner, llm_name(inner)) if llm_name(inner) else inner
        missing = [p for p in BACKBONE_PARTS if not hasattr(llm, p) and not (
            p == "norm" and final_norm(llm) is not None)]  # Persimmon's `final_layernorm`, LFM's `embedding_norm`
        if missing:
            raise ModelError(f"{type(llm).__name__} has no {missing}: the generic "
                             "adapter needs a decoder-only LLM with embed_tokens, layers, norm and "
                             "rotary_emb")
        tower, projector = split_modules(inner)
        video = (video_token_id(hf_model.config),) if self.takes_video else ()
        encoder = GenericVisionEncoder(
            tower=tower, projector=projector, placeholder_id=image_token_id(hf_model.config),
            more_placeholder_ids=indicator_ids(hf_model.config) + video,
            features_fn=inner.get_image_features, family=self,
            video_fn=inner.get_video_features if video else None)
        encoder.layout = deepstack.layout(hf_model.config)  # Qwen3-VL, Granite 4 Vision
        encoder.deepstack_layers = encoder.layout.layers
        gather_with(encoder, projector.params.values())
        self._set_rope(hf_model.config)
        if len(llm.layers):
            self._set_moe_types(hf_model.config, llm.layers[0])
        return OmniModel(encoders={"vision": encoder},
                         backbone=backbone_of(llm, hf_model.lm_head, hf_model),
                         family=self, hf_model=hf_model)

    def _set_rope(self, config) -> None:
        self._image_id = image_token_id(config)
        if self._inner is not None and hasattr(self._inner, "get_rope_index") and (
                self._rope is None or self._rope.config is not config):
            self._rope = rope_model(self._inner, config)

    def item_processors(self, hf_config, model_dir=None, tokenizer=None):
        hf_proc = load_hf_processor(self.name, model_dir, tokenizer)
        self.list_inputs = list_inputs(hf_proc, self._inner)
        appended = appended_text(hf_config)
        proc = GenericItemProcessor(
            hf_proc, processor_marker(hf_proc, hf_config), image_token_id(hf_config),
            tokenizer.bos_token_id, indicator_ids(hf_config),
            tokenizer(appended, add_special_tokens=False)["input_ids"] if appended else (),
            self.list_inputs)
        from PIL import Image
        self.dummy = proc.process(Image.new("RGB", (32, 32))).inputs
        self._set_rope(hf_config)
        video = video_item_processor(hf_folder(self._hf), hf_config, hf_proc, model_dir)
        return {"vision": proc, **({"video": video} if video is not None else {})}

    def position_ids(self, input_ids, items):
        """0..L-1, or [R, L] from HF's `get_rope_index` for a family that has one."""
        if self._inner is None or not hasattr(self._inner, "get_rope_index"):
            return torch.arange(input_ids.shape[0]) + self._offset
        if self._rope is None:
            raise ModelError(f"{self.name}: 3-D positions need the model's config; build the "
                             "model or its item processors through this family first")
        config = self._rope.config
        return rope_positions(self._rope, input_ids, items, image_token_id(config),
                              getattr(config, "video_token_id", None))

    def attention_blocks(self, input_ids, loss_mask):
        """The sample's spans attended both ways (`BIDIRECTIONAL`); none for a causal family."""
        if self.bidirectional == "images":
            if self._image_id is None:
                raise ModelError(f"{self.name}: image blocks need the model's config; build the "
                                 "model or its item processors through this family first")
            return image_runs(input_ids, self._image_id)
        if self.bidirectional == "prefix":
            trained = loss_mask.nonzero()
            end = int(trained[0]) if len(trained) else int(input_ids.shape[0])
            return [(0, end)] if end > 1 else []
        return []

    def layer_inputs(self, input_ids):
        """ERNIE-4.5-VL's `moe_mm_token_type_ids` [1, S]: 1 on image tokens and their start / end
        tokens, 2 on video ones, as its processor's `create_moe_mm_token_type_ids` writes them (its
        MoE layers send those tokens to the vision experts); {} for the other families."""
        if self._moe_types is None:
            return {}
        types = torch.zeros_like(input_ids)
        for kind, ids in self._moe_types.items():
            types[torch.isin(input_ids, torch.tensor(ids, device=input_ids.device))] = kind
        return {MOE_TYPES: types}

    def _set_moe_types(self, config, layer: nn.Module) -> None:
        """The token ids of each kind of `layer_inputs`, if the LLM's decoder `layer` takes them."""
        if MOE_TYPES not in inspect.signature(type(layer).forward).parameters:
            self._moe_types = None
            return
        kinds = {1: ("image_token_id", "image_start_token_id", "image_end_token_id"),
                 2: ("video_token_id", "video_start_token_id", "video_end_token_id")}
        self._moe_types = {k: [int(getattr(config, a)) for a in names
                               if getattr(config, a, None) is not None]
                           for k, names in kinds.items()}

    def save_processor(self, out_dir, hf_config, tokenizer, model_dir=None):
        tokenizer.save_pretrained(str(out_dir))
        if model_dir is None or Path(out_dir).resolve() == Path(model_dir).resolve():
            return
        for name in ("processor_config.json", "preprocessor_config.json",
                     "video_preprocessor_config.json", "chat_template.jinja"):
            if (Path(model_dir) / name).is_file():
                (Path(out_dir) / name).write_text((Path(model_dir) / name).read_text())


def image_runs(input_ids: torch.Tensor, token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of `token_id` in `input_ids` [L], longer than one token."""
    hit = torch.cat([torch.zeros(1, dtype=torch.bool), input_ids == token_id,
                     torch.zeros(1, dtype=torch.bool)]).int()  # [L + 2]
    edges = (hit[1:] - hit[:-1]).nonzero().squeeze(1).tolist()  # starts and ends, alternating
    return [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a > 1]


def image_token_id(config) -> int:
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    raise ModelError(f"{config.model_type!r} config has no image_token_id; the generic adapter "
                     "cannot find the image placeholder token")
