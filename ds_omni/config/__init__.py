"""The one typed source of truth for a ds_omni run (being split by section)."""

from ds_omni.config.data import (CHECKPOINTABLE, FREEZABLE, SCHEMA_VERSION, TEMPLATE_KEYWORDS,
                                 DataConfig, LoraConfig, ModelConfig, OmniConfig, ParallelConfig,
                                 PartConfig, ReorderConfig, SchemaConfig, SourceConfig, StageSplit,
                                 TrainConfig, VideoConfig, WeightPoint, check_template_spec,
                                 from_dict, load_config)
