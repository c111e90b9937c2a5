"""The model section: an HF MLLM directory, or a composition of encoders, projector and LLM, and
what of it is frozen, adapted (LoRA) or recomputed in backward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ds_omni.errors import ConfigError


@dataclass(kw_only=True)
class PartConfig:
    """One HuggingFace model part: loaded from a directory, or built (random init) from a config."""

    pretrained: str | None = None
    """Directory written by `save_pretrained`; weights load through safetensors."""
    config: dict[str, Any] | None = None
    """HF config fields including "model_type", for a randomly initialised part."""

    def __post_init__(self):
        if (self.pretrained is None) == (self.config is None):
            raise ConfigError("a model part needs exactly one of 'pretrained' (a directory) or "
                              f"'config' (HF config fields); got pretrained={self.pretrained!r}, "
                              f"config={'set' if self.config is not None else None}")
        if self.config is not None and "model_type" not in self.config:
            raise ConfigError("a model part's 'config' needs a 'model_type' (e.g. \"llama\", "
                              f"\"clip_vision_model\"); got keys {sorted(self.config)}")


FREEZABLE = ("vision", "audio", "projector", "llm")
CHECKPOINTABLE = ("llm", "vision", "audio")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters through peft on the linear layers of some parts; the rest of the model is
    frozen, except the parts named in `trainable` (ds_omni/model/lora.py)."""

    rank: int = 8
    """r: the adapters' inner dimension."""
    alpha: float = 16.0
    """lora_alpha: the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linear layers that get adapters, by name or name suffix ("q_proj", "mlp.down_proj"), or
    "all-linear" for every linear layer of `parts` (the LM head excepted)."""
    parts: list[str] = field(default_factory=lambda: ["llm"])
    """Parts whose layers get adapters: any of llm, projector, vision, audio."""
    trainable: list[str] = field(default_factory=list)
    """Parts trained in full next to the adapters (e.g. ["projector"]); all others are frozen."""
    export: Literal["merged", "adapter"] = "merged"
    """Final export: "merged" (adapters folded into the weights; plain transformers loads it) or
    "adapter" (the base model with the `trainable` parts, plus adapter/ for PeftModel)."""

    def __post_init__(self):
        if self.rank < 1 or not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora: need rank >= 1, alpha > 0, 0 <= dropout < 1; got "
                              f"{self.rank}, {self.alpha}, {self.dropout}")
        for name in ("parts", "trainable"):
            bad = sorted(set(getattr(self, name)) - set(FREEZABLE))
            if bad:
                raise ConfigError(f"model.lora.{name}: unknown part(s) {bad}; choose from "
                                  f"{list(FREEZABLE)}")
        if not self.parts or not self.target_modules:
            raise ConfigError("model.lora: parts and target_modules must not be empty (defaults: "
                              "[\"llm\"] and [\"all-linear\"])")
        both = sorted(set(self.parts) & set(self.trainable))
        if both:
            raise ConfigError(f"model.lora: {both} in both parts (adapters) and trainable (full "
                              "training); a part gets one or the other")


@dataclass(kw_only=True)
class ModelConfig:
    """The multimodal model: an HF MLLM directory, or a composition of encoders and an LLM."""

    pretrained: str | None = None
    """An HF MLLM directory (LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2-Audio, or a ds_omni export)."""
    llm: PartConfig | None = None
    """Composition: the causal LM backbone (Llama, Qwen2, ...)."""
    vision: PartConfig | None = None
    """Composition: the vision encoder (CLIP or SigLIP vision model)."""
    audio: PartConfig | None = None
    """Composition: the audio encoder (a Whisper encoder)."""
    projector: Literal["mlp2x_gelu", "linear"] = "mlp2x_gelu"
    """Composition: the projector from encoder width to LLM width."""
    image_token: str = "<image>"
    """Composition: the tokenizer token whose embedding slots take image embeddings."""
    audio_token: str = "<audio>"
    """Composition: the tokenizer token whose embedding slots take audio embeddings."""
    tokenizer: str | None = None
    """Tokenizer directory, or "builtin:shapes" for the demo tokenizer; default: the model's."""
    freeze: list[str] = field(default_factory=list)
    """Parts that get no gradient and no optimizer state: any of vision, audio, projector, llm."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype as built; DeepSpeed's bf16 section decides the training precision."""
    attn_implementation: Literal["auto", "varlen", "sdpa", "flash_attention_2", "eager"] = "auto"
    """LLM attention over packed rows: auto (torch varlen flash on CUDA, else SDPA per sample),
    varlen, flash_attention_2, sdpa or eager (same numbers). More: docs/gpus.md."""
    activation_checkpointing: bool | list[Literal["llm", "encoders", "vision", "audio"]] = False
    """Recompute layers in backward to save activation memory (about a third more compute): true,
    or a list of "llm", "encoders", "vision", "audio". More: docs/gpus.md."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model directory. Off unless you trust the directory."""
    seed: int = 0
    """Seed for random initialisation of parts built from configs (and of LoRA adapters)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (peft) instead of the whole model; see `LoraConfig`."""

    def __post_init__(self):
        if (self.pretrained is None) == (self.llm is None):
            raise ConfigError("model: set exactly one of 'pretrained' (an HF MLLM directory) or 'llm' "
                              "(compose a model from an LLM and encoders)")
        if self.pretrained is not None and (self.vision or self.audio):
            raise ConfigError("model: 'vision'/'audio' compose a new model; with 'pretrained' the "
                              "encoders come from the directory. Remove one of them.")
        bad = sorted(set(self.freeze) - set(FREEZABLE))
        if bad:
            raise ConfigError(f"model.freeze: unknown part(s) {bad}; choose from {list(FREEZABLE)}")
        if self.lora and self.freeze:
            raise ConfigError(f"model.freeze={self.freeze} with model.lora: under LoRA every part "
                              "outside model.lora.trainable is frozen already; remove model.freeze")

    def frozen_parts(self) -> list[str]:
        """Parts without gradients: `freeze`, or under LoRA those with neither adapters nor
        full training."""
        if self.lora is None:
            return list(self.freeze)
        return [p for p in FREEZABLE if p not in self.lora.parts + self.lora.trainable]

    def checkpointed_parts(self) -> set[str]:
        """The parts whose layers `activation_checkpointing` recomputes: of llm, vision, audio."""
        asked = self.activation_checkpointing
        if isinstance(asked, bool):
            return set(CHECKPOINTABLE) if asked else set()
        parts = set(asked) - {"encoders"}
        return parts | ({"vision", "audio"} if "encoders" in asked else set())
