"""The generic adapter: any transformers image-text-to-text model built on the common pattern.

Most vision-language models of transformers 5.x share one shape: `model.model` holds a vision tower
and a projector reached through `get_image_features(pixel_values, ...)`, whose output replaces the
image placeholder tokens (`get_placeholder_mask`), and a decoder-only `language_model` (embedding,
layers, norm, rotary embedding) under `model.lm_head`. For such a model nothing family-specific has
to be written: HF's own processor says how an image becomes pixels and tokens, HF's own
`get_image_features` encodes it, and HF's own `get_rope_index` gives 3-D positions where the family
has them. This module only routes those calls through ds_omni's per-item representation.

Trade-off: each image is encoded by its own `get_image_features` call (exactly the inputs HF's
processor made for it alone), so images of different sizes, tile counts and padding never have to
share a batch layout the family may not support; the cost is one tower call per image.

Two deviations from a causal LLM are followed as HF computes them: sliding-window layers (each HF
attention layer passes its own window to the packed kernel) and bidirectional blocks built from
`token_type_ids` (`BIDIRECTIONAL`: Gemma 3's image tokens see each other both ways, PaliGemma's
whole prompt prefix does), which ride along each row as `MicroBatch.blocks`. Vision features that
a family also adds into the LLM's hidden states between layers (deepstack: Qwen3-VL after its first
layers, Granite 4 Vision before the layers its config names; `ds_omni.model.deepstack`) travel as
extra columns of the image rows (`ds_omni.model.omni.Deepstack`); tokens its forward replaces
next to the image tokens (Ovis2's visual indicator tokens, `indicator_ids`) become part of the
image's rows, in text order. Numbers its forwards apply outside the modules (Granite's
multipliers, logit soft-capping, Chameleon's suppressed tokens) the backbone applies too
(`ds_omni.model.outside`). Where a family deviates otherwise (another `token_type_ids` mask,
features added onto the placeholders and one block over all of a sample's images (Molmo 2),
Gemma 4's per-layer inputs, layers that are not attention), `class_problem` / `config_problem` say
so and the model is refused rather than trained with other numbers; a dedicated file in
`families/` is then the fix.
The dedicated files of LLaVA, LLaVA-NeXT and Qwen2-VL predate this one and stay (each says why):
the generic path is exact for them too, but they batch the tower over a micro-batch's images,
build their processor from the config when a folder has none, and Qwen2-VL's carries video.

Dims: n images of a micro-batch, N embeddings of all of them, D LLM width, L tokens of one sample.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ds_omni.data.media import load_image
from ds_omni.errors import ModelError
from ds_omni.model import deepstack
from ds_omni.model.family import EncodedItem, Family, ItemProcessor
from ds_omni.model.omni import NORM_NAMES, ModalityEncoder, OmniModel, backbone_of, final_norm

HOOKS = ("get_image_features",)
"""What the generic path calls. HF's `get_placeholder_mask` (image token == placeholder, checked
against the feature count) is what `OmniModel.embed` does itself on the host, so a family that
merges by the same rule under another name (Idefics3's `inputs_merger`) fits too."""
BACKBONE_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
EXTRA_TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids")
"""Per-token processor outputs: rebuilt from the token ids per sample, never carried per item."""
BIDIRECTIONAL = {"gemma3": "images", "paligemma": "prefix"}
"""HF model folder -> how its `token_type_ids` mask opens causal attention, as its forward builds
it: "images", each run of image tokens is one block (`get_block_sequence_ids_for_mask`); "prefix",
everything before the first trained token is one block (PaliGemma's prompt, `token_type_ids == 0`)."""
MOE_TYPES = "moe_mm_token_type_ids"
"""ERNIE-4.5-VL's per-token modality ids, which its decoder layers route MoE experts by
(`GenericFamily.layer_inputs`)."""
POSITION_OFFSET = {"paligemma": 1}
"""HF model folder -> what its forward adds to 0-based positions (PaliGemma's are 1-indexed)."""
WRITES_IMAGE_TOKEN = {"fuyu": "<0x04>"}
"""HF model folder -> the text its processor appends to a sample with an image, for a processor
that writes the image token before the sample's text itself (Fuyu's `prepare_inputs_layout`,
one image per text): an image is written as "" there, and the appended text (Fuyu's
beginning-of-answer token, which belongs after the prompt) is not part of the image's tokens."""
CALL_OPTIONS = {"return_legacy_image_output": False}
"""Processor call options, where its `__call__` takes them: the current output layout where a
processor still defaults to a legacy one (Fuyu's `image_patches`, which `get_image_features`
does not take)."""
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
def hf_class_of(model_type: str):
    """The transformers class that the image-text-to-text mapping names for `model_type`."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    if name is None:
        return None
    try:
        return getattr(transformers, name)
    except (ImportError, AttributeError):
        return None


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


def hf_folder(hf_class) -> str:
    """The transformers model folder of `hf_class` ("gemma3" for ShieldGemma 2's class too)."""
    return inspect.getmodule(hf_class).__name__.split(".")[-2]


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
            "Compose the model from parts instead (model.llm plus model.vision, see the README's "
            "Models section), or add a dedicated adapter, one file in ds_omni/model/families/ "
            "(see generic.py and qwen2_vl.py)")
    return GenericFamily(model_type)


# ------------------------------------------------------------------------------ encoder
class GenericVisionEncoder(ModalityEncoder):
    """Per-image inputs (keys "<item>.<name>") -> the images' embeddings [N, D], in item order.

    Each image runs HF's `get_image_features` on the inputs HF's processor made for it alone.
    """

    modality = "image"

    def __init__(self, *, features_fn, family: "GenericFamily", **kw):
        super().__init__(**kw)
        object.__setattr__(self, "_features", features_fn)  # HF's bound method (not a submodule)
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
        out = self._features(**inputs)
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


INDICATOR_SLOTS = "indicator_slots"
"""A per-item input of ds_omni's own (HF's model never sees it), for a model with visual indicator
tokens: for each token the item's rows replace, in text order, -1 for an image token, else the
index of the indicator it is (`indicator_ids`)."""


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


# ------------------------------------------------------------------------------ items
class GenericItemProcessor(ItemProcessor):
    """Image -> the pixel inputs and the token ids HF's processor makes for that image alone."""

    def __init__(self, hf_processor, marker: str, placeholder_id: int, bos_id: int | None,
                 indicators: tuple[int, ...] = (), appended: list[int] = (),
                 list_inputs: tuple[str, ...] = ()):
        self.hf_processor = hf_processor
        self.marker = marker  # the text HF's processor expands into the image's tokens
        self.placeholder_id = placeholder_id
        self.more_placeholder_ids = indicators  # `indicator_ids`: replaced by the encoder's rows
        self.bos_id = bos_id
        self.appended = list(appended)  # what the processor appends to the text (Fuyu's <0x04>)
        self.list_inputs = list_inputs  # HF hands them over as lists; items carry tensors
        self.image_ids = image_id_tokens(hf_processor)  # MiniCPM-V numbers a sample's images
        if marker:  # (a processor that writes the image token itself takes one image a call)
            self._read_layout()

    def _read_layout(self) -> None:
        """What HF's processor writes around images that is no single image's own, read off two
        probe calls (`probe_layout`): text it appends after a sample (Chameleon's separator,
        PaliGemma's newline) is cut from every image's tokens, and the tail adjacent images
        share is written once after a run of them (`shared_tail`)."""
        from PIL import Image
        blank = Image.new("RGB", (32, 32))
        tok = self.hf_processor.tokenizer

        def ids(n: int) -> list[int]:
            out = processor_call(self.hf_processor, [self.marker * n + LAYOUT_PROBE], [blank] * n)
            ids = out["input_ids"][0].tolist()
            return ids[1:] if self.bos_id is not None and ids[:1] == [self.bos_id] else ids

        probe = tok(LAYOUT_PROBE, add_special_tokens=False)["input_ids"]
        layout = probe_layout(ids(1), ids(2), probe, lambda t: self.numbered(t, 1))
        if layout is not None:
            suffix, self.shared_tail = layout
            self.appended = self.appended or suffix

    def numbered(self, ids: list[int], index: int) -> list[int]:
        """`ids` (an image's tokens as HF writes them alone, index 0) as the sample's `index`-th
        image: MiniCPM-V's `<image_id>N</image_id>` prefix carries N."""
        if self.image_ids is None or index == 0:
            return ids
        start, end = self.image_ids
        if start not in ids or end not in ids:
            return ids
        a, b = ids.index(start), ids.index(end)
        digits = self.hf_processor.tokenizer(str(index), add_special_tokens=False)["input_ids"]
        return ids[:a + 1] + digits + ids[b:]

    def tokens_at(self, item, index):
        return self.numbered(self.tokens(item), index)

    def process(self, image):
        out = processor_call(self.hf_processor, [self.marker], [load_image(image)])
        ids = out["input_ids"][0].tolist()
        if self.bos_id is not None and ids[:1] == [self.bos_id]:
            ids = ids[1:]  # the tokenizer's own start token, not part of the image
        if self.appended and ids[-len(self.appended):] == self.appended:
            ids = ids[:-len(self.appended)]
        inputs = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)
                  and k not in ("input_ids", "attention_mask", *EXTRA_TOKEN_INPUTS)}
        inputs.update({k: torch.tensor(out[k]) for k in self.list_inputs if k in out})
        n = ids.count(self.placeholder_id)
        if self.more_placeholder_ids:
            slots = [-1 if t == self.placeholder_id else self.more_placeholder_ids.index(t)
                     for t in ids if t == self.placeholder_id or t in self.more_placeholder_ids]
            inputs[INDICATOR_SLOTS], n = torch.tensor(slots), len(slots)
        meta = {"tokens": ids, **{k: v.tolist() for k, v in inputs.items()
                                  if k in ("image_grid_thw", "image_sizes", *GRID_KEYS)}}
        return EncodedItem(inputs=inputs, num_embeddings=n, meta=meta)

    def tokens(self, item):
        return list(item.meta["tokens"])

    def collate(self, items):
        return {f"{i}.{k}": v for i, it in enumerate(items) for k, v in it.inputs.items()}


LAYOUT_PROBE = " zq"
"""Text after the images in `GenericItemProcessor`'s layout probe: any that tokenises alone."""


def probe_layout(one: list[int], two: list[int], probe: list[int],
                 second: Callable[[list[int]], list[int]]) -> tuple[list[int], int] | None:
    """(suffix, shared tail) from HF's ids for one image and for two adjacent images, each
    followed by the `probe` text: the suffix is what follows the probe (text HF appends after a
    sample); the shared tail is how many last tokens of an image's own (`one` before the probe, P +
    Q) the two images write once (`two` before the probe is P + second(P) + Q). None if the probe
    cannot be found or the two calls fit no such layout."""
    at1, at2 = find_run(one, probe), find_run(two, probe)
    if at1 is None or at2 is None:
        return None
    own, both = one[:at1], two[:at2]
    lead = len(both) - len(own)  # P: what a second image adds
    if not 0 < lead <= len(own) or both != own[:lead] + second(own[:lead]) + own[lead:]:
        return None
    return one[at1 + len(probe):], len(own) - lead


def find_run(ids: list[int], run: list[int]) -> int | None:
    """Where `run` last occurs in `ids` as consecutive tokens, or None."""
    for i in range(len(ids) - len(run), -1, -1):
        if ids[i:i + len(run)] == run:
            return i
    return None


def image_id_tokens(hf_processor) -> tuple[int, int] | None:
    """The (start, end) ids of the per-sample image number a processor writes before each image
    (MiniCPM-V's `<image_id>N</image_id>`, its `use_image_id`), or None."""
    start = getattr(hf_processor, "image_id_start_token", None)
    end = getattr(hf_processor, "image_id_end_token", None)
    if start is None or end is None or not getattr(hf_processor, "default_use_image_id", True):
        return None
    tok = hf_processor.tokenizer
    return tok.convert_tokens_to_ids(start), tok.convert_tokens_to_ids(end)


def processor_call(hf_processor, text: list[str], images: list):
    """HF's processor on `text` and `images`, with the `CALL_OPTIONS` its `__call__` takes."""
    params = inspect.signature(type(hf_processor).__call__).parameters
    options = {k: v for k, v in CALL_OPTIONS.items() if k in params}
    return hf_processor(text=text, images=images, return_tensors="pt", **options)


def appended_text(config) -> str | None:
    """What the processor of a `WRITES_IMAGE_TOKEN` family appends to a sample, else None."""
    hf_class = hf_class_of(config.model_type)
    return WRITES_IMAGE_TOKEN.get(hf_folder(hf_class)) if hf_class is not None else None


def list_inputs(hf_processor, inner_cls) -> tuple[str, ...]:
    """The inputs of `get_image_features` that HF's processor hands over as Python lists (its
    `skip_tensor_conversion`: Unlimited-OCR's tile counts and grids). An item carries them as
    tensors, as its other inputs; `GenericVisionEncoder` gives them back as lists."""
    skipped = {k for p in (hf_processor, getattr(hf_processor, "image_processor", None))
               for k in getattr(p, "skip_tensor_conversion", None) or ()}
    wanted = inspect.signature(inner_cls.get_image_features).parameters if inner_cls else {}
    return tuple(k for k in wanted if k in skipped)


_WRAPPER_IDS = (("vision_start_token_id", "vision_end_token_id"),
                ("image_start_token_id", "image_end_token_id"),
                ("im_start_id", "im_end_id"))  # HunYuan-VL's <img_start>, <img_end>


def processor_marker(hf_processor, config) -> str:
    """The text an image is written as before the processor expands it (with the wrappers a chat
    template adds around it where the family has start/end tokens of its own); "" where the
    processor writes the image token itself (`WRITES_IMAGE_TOKEN`)."""
    if appended_text(config) is not None:
        return ""
    # the placeholder a chat template writes, where it differs from the expanded image token
    # (Qianfan-OCR's "<image>" becomes "<img><IMG_CONTEXT>...</img>")
    for attr in ("image_placeholder_token", "boi_token", "image_token"):
        marker = getattr(hf_processor, attr, None)
        if marker and (attr != "boi_token" or _boi_expands(hf_processor, marker)):
            break
    else:
        raise ModelError(f"{type(hf_processor).__name__} has no image_token; the generic adapter "
                         "cannot tell where an image goes")
    if attr != "image_token":
        return marker
    for names in _WRAPPER_IDS:
        start, end = (getattr(config, name, None) for name in names)
        if start is not None and end is not None:
            tok = hf_processor.tokenizer
            return tok.convert_ids_to_tokens(start) + marker + tok.convert_ids_to_tokens(end)
    return marker


def _boi_expands(hf_processor, boi: str) -> bool:
    """Whether the processor expands its begin-of-image token into the image's tokens (Gemma 3's
    does; Gemma 4's has one too but expands its image token), tried on a blank image."""
    from PIL import Image
    try:
        out = processor_call(hf_processor, [boi], [Image.new("RGB", (32, 32))])
    except ValueError:  # "the number of image tokens ... should be the same as ... images"
        return False
    image_id = hf_processor.tokenizer.convert_tokens_to_ids(hf_processor.image_token)
    return bool((out["input_ids"] == image_id).any())


def load_hf_processor(model_type: str, model_dir: Path | None, tokenizer):
    """HF's processor of `model_type` from the files saved in `model_dir`, with `tokenizer`.

    Built from its parts rather than by `AutoProcessor`: the image processor's PIL variant (the
    torchvision one resizes with another kernel, and torchvision is no dependency; the
    torchvision one where that is the only one, or the PIL one is broken: `BROKEN_PIL`) and no
    video processor (HF's need torchvision; images need none).
    """
    saved = _saved_processor_config(model_dir)
    if saved is None:
        raise ModelError(f"{str(model_dir)!r} has no saved processor (processor_config.json or "
                         "preprocessor_config.json): the generic adapter needs the model's own HF "
                         "processor to cut images and count their tokens. Save it next to the "
                         "weights (processor.save_pretrained)")
    try:
        cls = processor_class(model_type)
        cls.get_attributes()  # a placeholder class (a backend is missing) raises here
    except (KeyError, ImportError) as e:
        raise ModelError(f"transformers has no usable processor for {model_type!r} ({e}); "
                         "install what it names (e.g. torchvision) or compose the model from parts")
    image_processor = _pil_image_processor(processor_type(model_type), model_dir)
    kwargs = {k: v for k, v in saved.items()
              if k in inspect.signature(cls.__init__).parameters and k not in (
                  "image_processor", "tokenizer", "video_processor", "feature_extractor")}
    lenient = type(cls.__name__, (cls,), {"check_argument_for_proper_class":
                                          lambda self, name, arg: type(arg)})
    parts = {a: None for a in cls.get_attributes()}
    parts.update(image_processor=image_processor, tokenizer=tokenizer)
    if "video_processor" in parts and _reads_video_processor(cls):
        parts["video_processor"] = _video_processor(model_type, cls, saved, model_dir)
    return lenient(**parts, **kwargs)


def _reads_video_processor(cls) -> bool:
    """Whether HF's processor class reads its video processor's settings when it is built
    (MiniCPM-V 4.6's takes its slice mode), so that images too need one."""
    def reads(c) -> bool:
        try:
            return "self.video_processor." in inspect.getsource(c.__init__)
        except (OSError, TypeError):  # no source at hand
            return False
    return any(reads(c) for c in cls.__mro__
               if "__init__" in vars(c) and c.__module__.startswith("transformers.models."))


def _video_processor(model_type: str, processor_cls, saved: dict, model_dir: Path):
    """HF's video processor of `model_type`: the saved one, else its class defaults (the settings
    a processor reads at build time are video ones; images do not depend on them)."""
    from transformers.models.auto.video_processing_auto import (VIDEO_PROCESSOR_MAPPING_NAMES,
                                                                video_processor_class_from_name)
    from transformers.utils import is_torchvision_available
    names = VIDEO_PROCESSOR_MAPPING_NAMES.get(processor_type(model_type)) or {}
    name = names.get("torchvision") if isinstance(names, dict) else names
    if not is_torchvision_available() or name is None:
        raise ModelError(f"HF's {processor_cls.__name__} reads its video processor's settings when "
                         f"it is built, and transformers has {model_type!r}'s video processor only "
                         "as a torchvision class: install torchvision (the release matching your "
                         "torch) to train it, even on images only")
    video_cls = video_processor_class_from_name(name)
    if "video_processor" in saved or (Path(model_dir) / "video_preprocessor_config.json").is_file():
        return video_cls.from_pretrained(str(model_dir))
    return video_cls()


def processor_class(model_type: str):
    """HF's processor class of `model_type` (a placeholder that raises ImportError on use when a
    backend it names is missing).

    A processor module that imports its torchvision image processor only for the arithmetic the
    PIL variant repeats (Pixtral's, which Mistral3 uses, takes `get_resize_output_image_size`
    from it) is imported with the PIL module standing in, so it needs no torchvision; the PyPI
    torchvision wheel is a CUDA build that does not load next to a CPU torch.
    """
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    name = PROCESSOR_MAPPING_NAMES[processor_type(model_type)]
    cls = getattr(transformers, name)
    try:
        cls.get_attributes()
        return cls
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            return cls
    return getattr(_import_with_pil_stand_in(transformers._class_to_module[name]), name, cls)


def _import_with_pil_stand_in(module: str):
    """Import `transformers.<module>` with the family's PIL image processor module standing in,
    during the import only, for its torchvision one (which would fail to import)."""
    import importlib
    import sys
    package = "transformers." + module.rsplit(".", 1)[0]  # transformers.models.pixtral
    family = package.rsplit(".", 1)[1]
    fast = f"{package}.image_processing_{family}"
    try:
        pil = importlib.import_module(f"{package}.image_processing_pil_{family}")
    except ImportError:
        return None
    before = sys.modules.get(fast)
    sys.modules[fast] = pil
    try:
        return importlib.import_module(f"transformers.{module}")
    except ImportError:
        return None
    finally:
        if before is None:
            sys.modules.pop(fast, None)
        else:
            sys.modules[fast] = before


PROCESSOR_OF = {
    # modeling_cosmos3_omni.py: "Model arch is identical to Qwen3-VL", and its forward's example
    # loads the processor of Qwen/Qwen3-VL-8B-Instruct (Qwen3VLProcessor)
    "cosmos3_omni": "qwen3_vl",
    # modeling_glm_ocr.py: its forward's example loads the processor of
    # zai-org/GLM-4.1V-9B-Thinking (Glm4vProcessor); its model classes are GLM-4V's
    "glm_ocr": "glm4v",
}
"""Model types that transformers 5.24 maps no processor to, whose own model file names the
checkpoint whose processor they take: the model type of that processor."""


def processor_type(model_type: str) -> str:
    """The model type HF's processor mappings know `model_type` by: itself, else the one its own
    model file names (`PROCESSOR_OF`), else the folder of its model class (an alias such as
    "glmga" shares "glm46v"'s processor)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    if model_type in PROCESSOR_MAPPING_NAMES:
        return model_type
    if model_type in PROCESSOR_OF:
        return PROCESSOR_OF[model_type]
    hf_class = hf_class_of(model_type)
    return inspect.getmodule(hf_class).__name__.split(".")[-2] if hf_class else model_type


def _saved_processor_config(model_dir: Path | None) -> dict | None:
    if model_dir is None:
        return None
    files = [Path(model_dir) / f for f in ("processor_config.json", "preprocessor_config.json")]
    found = [json.loads(f.read_text()) for f in files if f.is_file()]
    return {k: v for d in found for k, v in d.items()} if found else None


BROKEN_PIL = {"fuyu": "its patchify_image calls numpy's transpose with a torch tensor's "
                      "arguments and fails on every image (transformers 5.24)"}
"""HF processor type -> why its PIL image processor cannot be used: its torchvision one is."""


def _pil_image_processor(model_type: str, model_dir: Path):
    from transformers import AutoImageProcessor
    from transformers.models.auto.image_processing_auto import (IMAGE_PROCESSOR_MAPPING_NAMES,
                                                                get_image_processor_class_from_name)
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}
    name = names.get("pil") if isinstance(names, dict) else None
    if name is None:
        from transformers.utils import is_torchvision_available
        if isinstance(names, dict) and names and not is_torchvision_available():
            raise ModelError(f"HF's image processor for {model_type!r} "
                             f"({next(iter(names.values()))}) exists only as a torchvision class: "
                             "install torchvision (the release matching your torch) to train it")
        return AutoImageProcessor.from_pretrained(str(model_dir))
    if model_type in BROKEN_PIL:
        from transformers.utils import is_torchvision_available
        if not is_torchvision_available():
            raise ModelError(f"HF's PIL image processor for {model_type!r} ({name}) is broken: "
                             f"{BROKEN_PIL[model_type]}; its torchvision one needs torchvision, "
                             "which does not import here. Install a torchvision that loads next "
                             "to this torch")
        return get_image_processor_class_from_name(names["torchvision"]).from_pretrained(
            str(model_dir))
    return get_image_processor_class_from_name(name).from_pretrained(str(model_dir))


# ------------------------------------------------------------------------------ positions
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


GRID_KEYS = ("image_grid_thw", "target_sizes")
"""The processor outputs `get_rope_index` lays images out by: Qwen-VL's patch grid (t, h, w) per
image, MiniCPM-V 4.7's (h, w) per crop (a thumbnail and its slices)."""


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
        encoder = GenericVisionEncoder(
            tower=tower, projector=projector, placeholder_id=image_token_id(hf_model.config),
            more_placeholder_ids=indicator_ids(hf_model.config),
            features_fn=inner.get_image_features, family=self)
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
        return {"vision": proc}

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
        for name in ("processor_config.json", "preprocessor_config.json", "chat_template.jinja"):
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
