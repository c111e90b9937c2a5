"""Family adapters; importing this package registers every built-in family."""

from ds_omni.model.families import llava  # noqa: F401
from ds_omni.model.families import llava_next  # noqa: F401
from ds_omni.model.families import qwen2_audio  # noqa: F401
from ds_omni.model.families import qwen2_vl  # noqa: F401
from ds_omni.model.families import composed  # noqa: F401
