"""The one typed source of truth for a ds_omni run.

A run is described by an `OmniConfig` (model, data, parallel plan, training; one module per
section) read strictly from JSON by `load_config` (config/loader.py): unknown keys are an error that
lists them, a value of the wrong type an error that names the field. The DeepSpeed fields that
follow from it (batch sizes, gradient accumulation, scheduler length) are derived in
`ds_omni/train/ds_config.py`, and merged with the user's DeepSpeed JSON; a value the user wrote
that disagrees with the derived one is an error, never a silent override.
"""

from ds_omni.config.data import (DataConfig, ReorderConfig, SchemaConfig, SourceConfig,
                                 VideoConfig, WeightPoint, check_template_spec)
from ds_omni.config.loader import from_dict, load_config
from ds_omni.config.model import LoraConfig, ModelConfig, PartConfig
from ds_omni.config.omni import SCHEMA_VERSION, OmniConfig
from ds_omni.config.parallel import ParallelConfig, StageSplit
from ds_omni.config.train import TrainConfig

__all__ = ["SCHEMA_VERSION", "DataConfig", "LoraConfig", "ModelConfig", "OmniConfig",
           "ParallelConfig", "PartConfig", "ReorderConfig", "SchemaConfig", "SourceConfig",
           "StageSplit", "TrainConfig", "VideoConfig", "WeightPoint", "check_template_spec",
           "from_dict", "load_config"]
