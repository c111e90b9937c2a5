"""Family adapters; importing this package registers every built-in family, and `family_for`
finds the one that handles a model type."""

from ds_omni.errors import ModelError
from ds_omni.model.families import llava  # noqa: F401
from ds_omni.model.families import llava_next  # noqa: F401
from ds_omni.model.families import qwen2_audio  # noqa: F401
from ds_omni.model.families import qwen2_vl  # noqa: F401
from ds_omni.model.families import composed  # noqa: F401
from ds_omni.model.families.registry import FAMILIES
from ds_omni.model.family import Family


def family_for(model_type: str) -> Family:
    """The family adapter that handles HF `model_type`."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    from ds_omni.model.families import generic, hf_processor
    if hf_processor.hf_class_of(model_type) is not None:  # any image-text-to-text model
        return generic.generic_family(model_type)  # a fresh one: it keeps its model's config
    raise ModelError(
        f"unknown model family: model_type {model_type!r} has no ds_omni adapter; supported "
        f"families: {', '.join(_describe(f) for f in FAMILIES.values())}, plus every model type "
        "of transformers' image-text-to-text mapping through the generic adapter (`ds-omni "
        "families` lists which are exact). To train a model of "
        "another family, compose one from parts instead: model.llm (any causal LM, e.g. the "
        "folder of its language model) plus model.vision (a CLIP or SigLIP tower) and/or "
        "model.audio (a Whisper encoder), see docs/models.md; or add an adapter, "
        "one file in ds_omni/model/families/")


def _describe(family: Family) -> str:
    """The family's name as docs/models.md gives it, with the model types it loads where they
    differ."""
    if family.model_types == (family.name,):
        return family.name
    return f"{family.name} (model_type {' or '.join(map(repr, family.model_types))})"
