"""The demo's pictures are legible (issue 27): a small shape spans several patches, and a large
one has about twice its area, so shape and size can be read by the demo's 8-px-patch tower."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from ds_omni.data.demo import BACKGROUNDS, IMAGE_SIZE, builtin_dir, shapes_rows

PATCH = 8  # examples/tiny_llava.json's vision patch_size


def _mask(row: dict) -> np.ndarray:
    """Pixels that are not the background, as a bool [32, 32] array."""
    pixels = np.asarray(Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB"))
    background = row["conversations"][1]["value"].split()[-2]
    return (pixels != np.array(BACKGROUNDS[background])).any(-1)


def test_every_small_shape_spans_at_least_three_patches_and_large_ones_twice_the_area():
    areas = {"small": [], "large": []}
    for row in shapes_rows(200, seed=5):
        mask = _mask(row)  # [32, 32]
        # [4, 4]: how many of each patch's pixels the shape covers (a triangle's tip may reach a
        # fourth patch by a pixel or two)
        per_patch = mask.reshape(IMAGE_SIZE // PATCH, PATCH, IMAGE_SIZE // PATCH, PATCH).sum((1, 3))
        size = row["conversations"][1]["value"].split()[1]
        assert (per_patch >= 4).sum() >= 3, (row["conversations"][1]["value"], per_patch)
        areas[size].append(mask.sum())
    # the old radii (4 / 7 px) drew small shapes of 36-62 px: this fails on them
    assert min(areas["small"]) >= 50 and np.mean(areas["large"]) >= 2 * np.mean(areas["small"])


def test_builtin_assets_are_versioned_so_old_pictures_are_not_reused():
    assert builtin_dir("builtin:shapes", "dataset").name == "shapes-dataset-v3"
