"""What the simulator needs of a model: parameter counts, training FLOPs per token and per
encoder item (the project's `CostModel`, the one the loader balances with), bytes per parameter,
and activation bytes per token with and without activation checkpointing.

Parameter counts follow the cost model's weights (`ModelDims`): per LLM layer
2h^2 + 2h kv + k h I (q and o, k and v, the MLP's k matrices), the token embedding and an untied
LM head (h V each); per encoder layer 4 h_e^2 + k_e h_e I_e, and a projector h_e x h. Norms and
biases are left out (< 0.1 %).

Activations kept for backward, per token and layer, in bf16 (2 bytes a value), with
FlashAttention (no s x s scores kept): the layer's input, the two norms' outputs, q, k and v,
the attention output and the MLP's input and its k - 1 + 1 intermediate widths:
  2 * (6h + 2 kv + k I) bytes           (Llama-2-7B: 131 kB; Korthikanti et al.'s 34 h: 139 kB)
With full checkpointing a layer keeps only its input (2h bytes a token), and one layer at a time
is recomputed whole in backward. The LM head's logits and their gradient: 4 V bytes a token
(fp32, as HF's loss upcasts), once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds_omni.data.cost import CostModel, EncoderDims, ModelDims
from ds_omni.errors import ModelError

BF16 = 2


@dataclass(frozen=True)
class ModelSpec:
    dims: ModelDims
    cost: CostModel
    """The loader's cost model (FLOPs of forward + backward; frozen encoders forward only)."""
    frozen: tuple[str, ...] = ()
    """Parts that are not trained ("vision", "audio", "llm"): no gradients or optimizer state."""
    bytes_per_param: int = BF16
    """Bytes of a parameter (and of its gradient) in the training precision."""
    encoder_heads: dict[str, int] | None = None
    """Attention heads of each encoder (long-short SP splits an item only over a group whose
    size divides them); None: hidden / 64 each."""

    @classmethod
    def from_dims(cls, dims: ModelDims, frozen: tuple[str, ...] = (),
                  scales: dict[str, float] | None = None) -> "ModelSpec":
        for name, enc in dims.encoders.items():
            enc.frozen = name in frozen
        return cls(dims, CostModel(dims, scales=scales), tuple(frozen))

    @classmethod
    def from_hf_config(cls, hf_config, frozen: tuple[str, ...] = (),
                       scales: dict[str, float] | None = None) -> "ModelSpec":
        """From an HF config: a composite one (text_config + vision/audio configs) or an LLM's."""
        spec = cls.from_dims(ModelDims.from_hf_config(hf_config), frozen, scales)
        heads = {}
        for name in spec.dims.encoders:
            sub = getattr(hf_config, f"{name}_config", None)
            n = getattr(sub, "num_attention_heads", None) or getattr(sub, "num_heads", None) or \
                getattr(sub, "encoder_attention_heads", None)
            if n:
                heads[name] = int(n)
        return dataclasses.replace(spec, encoder_heads=heads or None)

    def heads(self, name: str) -> int:
        e = self._encoder(name)
        return (self.encoder_heads or {}).get(name) or max(1, e.hidden // 64)

    # ------------------------------------------------------------------------- parameters
    @property
    def kv(self) -> int:
        return self.dims.kv_hidden or self.dims.hidden

    def llm_layer_params(self) -> int:
        d = self.dims
        h = d.hidden
        return 2 * h * h + 2 * h * self.kv + d.mlp_matrices * h * d.intermediate

    def llm_params(self) -> int:
        """Decoder layers, token embedding and an untied LM head."""
        d = self.dims
        return d.layers * self.llm_layer_params() + 2 * d.hidden * d.vocab

    def encoder_params(self, name: str) -> int:
        """The encoder's layers and a projector to the LLM's width."""
        e = self._encoder(name)
        layer = 4 * e.hidden ** 2 + e.mlp_matrices * e.hidden * e.intermediate
        return e.layers * layer + e.hidden * self.dims.hidden

    def total_params(self) -> int:
        return self.llm_params() + sum(self.encoder_params(n) for n in self.dims.encoders)

    def trainable_params(self) -> int:
        return ((0 if "llm" in self.frozen else self.llm_params())
                + sum(self.encoder_params(n) for n in self.dims.encoders if n not in self.frozen))

    def _encoder(self, name: str) -> EncoderDims:
        if name not in self.dims.encoders:
            raise ModelError(f"the model has no encoder {name!r}; it has "
                             f"{list(self.dims.encoders)}")
        return self.dims.encoders[name]

    # ------------------------------------------------------------------------------ FLOPs
    def llm_flops(self, tokens) -> float:
        """Training FLOPs of samples of `tokens` positions each (forward + backward)."""
        return float(self.cost.llm_cost(tokens).sum())

    def encoder_flops(self, name: str, lengths) -> float:
        """Training FLOPs of items of encoder `name`, each `lengths` positions."""
        return float(self.cost.encoder_cost(name, lengths).sum())

    def flops_per_token(self) -> float:
        """LLM training FLOPs of one token, without attention (6 x parameters, roughly)."""
        return self.cost.coefficients["llm_lin"]

    # ------------------------------------------------------------------------ activations
    def llm_activation_bytes(self, checkpointing: bool) -> float:
        """Bytes kept per token for backward over all LLM layers."""
        d = self.dims
        if checkpointing:
            return d.layers * BF16 * d.hidden
        return d.layers * BF16 * (6 * d.hidden + 2 * self.kv + d.mlp_matrices * d.intermediate)

    def llm_peak_extra_bytes(self, checkpointing: bool) -> float:
        """Per token, on top of what is kept: the logits and their gradient (fp32), and under
        checkpointing the one layer recomputed whole."""
        d = self.dims
        extra = 4 * d.vocab
        if checkpointing:
            extra += BF16 * (6 * d.hidden + 2 * self.kv + d.mlp_matrices * d.intermediate)
        return extra

    def encoder_activation_bytes(self, name: str, checkpointing: bool) -> float:
        """Bytes kept per encoder position over all its layers (forward only if frozen)."""
        e = self._encoder(name)
        if e.frozen:
            return 0.0
        width = e.hidden if checkpointing else 8 * e.hidden + e.mlp_matrices * e.intermediate
        return e.layers * BF16 * width
