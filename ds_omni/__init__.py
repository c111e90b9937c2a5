"""ds_omni: train multimodal LLMs on DeepSpeed."""

__version__ = "0.1.0"
