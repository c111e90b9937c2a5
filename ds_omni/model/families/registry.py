"""The built-in family adapters by name: each module of `families/` registers its own on import
(`family_for`, in the package, looks a model type up among them)."""

from __future__ import annotations

from ds_omni.model.family import Family

FAMILIES: dict[str, Family] = {}
"""Family name -> adapter, in the order they registered."""


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family
