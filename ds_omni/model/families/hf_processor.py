"""HF's processor as the generic adapter cuts images with it (`generic.GenericFamily`).

Each image is processed alone by the model's own HF processor (`GenericItemProcessor.process`):
its pixel inputs become the item's, and the tokens the processor writes for it become the item's
tokens in the text. What a processor writes around several images that no image alone shows (text
appended after a sample, a tail adjacent images share, a per-sample image number) is read off
probe calls (`probe_layout`, `image_id_tokens`) so a sample's tokens are HF's for all its images.
Also here: which processor a model type takes (`processor_type`, `PROCESSOR_OF`), how it is
loaded from a model folder without hub access or torchvision where possible
(`load_hf_processor`), and the transformers classes behind a model type (`hf_class_of`).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.data.media import load_image
from ds_omni.errors import ModelError

log = logging.getLogger(__name__)

EXTRA_TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids")
"""Per-token processor outputs: rebuilt from the token ids per sample, never carried per item."""


WRITES_IMAGE_TOKEN = {"fuyu": "<0x04>"}
"""HF model folder -> the text its processor appends to a sample with an image, for a processor
that writes the image token before the sample's text itself (Fuyu's `prepare_inputs_layout`,
one image per text): an image is written as "" there, and the appended text (Fuyu's
beginning-of-answer token, which belongs after the prompt) is not part of the image's tokens."""
CALL_OPTIONS = {"return_legacy_image_output": False}
"""Processor call options, where its `__call__` takes them: the current output layout where a
processor still defaults to a legacy one (Fuyu's `image_patches`, which `get_image_features`
does not take)."""


INDICATOR_SLOTS = "indicator_slots"
"""A per-item input of ds_omni's own (HF's model never sees it), for a model with visual indicator
tokens: for each token the item's rows replace, in text order, -1 for an image token, else the
index of the indicator it is (`indicator_ids`)."""


GRID_KEYS = ("image_grid_thw", "target_sizes")
"""The processor outputs `get_rope_index` lays images out by: Qwen-VL's patch grid (t, h, w) per
image, MiniCPM-V 4.7's (h, w) per crop (a thumbnail and its slices)."""


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


def hf_folder(hf_class) -> str:
    """The transformers model folder of `hf_class` ("gemma3" for ShieldGemma 2's class too)."""
    return inspect.getmodule(hf_class).__name__.split(".")[-2]


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
        tok = getattr(self.hf_processor, "tokenizer", None)

        def ids(n: int) -> list[int]:
            out = processor_call(self.hf_processor, [self.marker * n + LAYOUT_PROBE], [blank] * n)
            ids = out["input_ids"][0].tolist()
            return ids[1:] if self.bos_id is not None and ids[:1] == [self.bos_id] else ids

        try:
            probe = tok(LAYOUT_PROBE, add_special_tokens=False)["input_ids"]
            layout = probe_layout(ids(1), ids(2), probe, lambda t: self.numbered(t, 1))
        except Exception as e:  # noqa: BLE001  (a processor that takes one image a text, ...)
            log.warning("HF's %s did not take the layout probe (%s: %s): each image keeps the "
                        "tokens it writes for that image alone", type(self.hf_processor).__name__,
                        type(e).__name__, e)
            return
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

