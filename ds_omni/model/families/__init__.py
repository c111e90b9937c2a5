"""Family adapters; importing this package registers every built-in family."""

from ds_omni.model.families import llava  # noqa: F401
