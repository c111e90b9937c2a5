"""Tiny recipes for the coverage sweep (`ds_omni.coverage.sweep`): per model type, a random HF
config (hidden 32, one to three LLM layers, tiny towers) and a processor built from parts, no hub.

A recipe returns (config, processor). The sweep saves both, loads them through the real loading
path and compares against HF; `NOT_EXACT` names the types tried and found not exact, with why,
`NO_RECIPE` the types left without a recipe, with why. One module per kind of model:
  llava     one tower + projector, each image a run of its image token: LLaVA-likes, Pixtral, ...
  patch_grids  towers over patch grids with a merger, multi-axis rope: Qwen-VL, GLM-4V, ...
  tiles     images cut into fixed-size tiles: InternVL, Idefics3 / SmolVLM, the OCR models
  refused   the types no recipe covers that the generic adapter is not exact for, with why
  windows   sliding-window layers and bidirectional blocks
  scaled    numbers applied outside the HF modules (multipliers, soft-capping, suppressed tokens)
  layers    LLM layers that are not attention, per-token layer inputs
  torchvision_images  more types whose HF image processor is a torchvision class only
"""

from ds_omni.coverage.recipes import (  # noqa: F401  (register)
    layers, llava, patch_grids, refused, scaled, tiles, windows)
from ds_omni.coverage.recipes import torchvision_only  # noqa: F401  (register)
from ds_omni.coverage.recipes.common import (  # noqa: F401
    NO_RECIPE, NOT_EXACT, RECIPES, config_for, demo_tokenizer, lenient_processor,
    processor_class_for)
from ds_omni.coverage.recipes import torchvision_images  # noqa: F401  (register)
