"""What the simulator needs of a model: parameter counts, training FLOPs per token and per encoder
item (the loader's `CostModel`), bytes per parameter, and activation bytes per token.

Parameters follow `ModelDims`: per LLM layer 2h^2 + 2h kv + k h I, embedding and untied head h V
each, per encoder layer 4 h_e^2 + k_e h_e I_e, a projector h_e x h (norms and biases < 0.1 %).
Activations kept per token and layer in bf16 with FlashAttention: 2 * (6h + 2 kv + k I) bytes
(Llama-2-7B: 131 kB; Korthikanti et al.'s 34 h: 139 kB); under full checkpointing a layer keeps
its input (2h) and one layer at a time is recomputed; the logits and their gradient 4 V bytes a
token, once. TP splits q, k, v, the attention output and the MLP widths:
2 * (4h + (2h + 2 kv + k I) / tp). An MoE LLM (`MoESpec`) keeps every expert's weights and prices
the active width (top-k experts plus a shared one). More: docs/simulator.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds_omni.data.cost import CostModel, EncoderDims, ModelDims
from ds_omni.errors import ModelError

BF16 = 2


@dataclass(frozen=True)
class MoESpec:
    """The LLM's mixture-of-experts blocks, as the text config gives them."""

    experts: int
    """E: experts of one MoE block (`num_experts`, Mixtral's `num_local_experts`)."""
    top_k: int
    """Experts a token is routed to (`num_experts_per_tok`)."""
    expert_intermediate: int
    """MLP width of one expert (`moe_intermediate_size`; Mixtral: `intermediate_size`)."""
    layers: int
    """Decoder layers with an MoE block (the others keep a dense MLP)."""
    dense_intermediate: int
    """MLP width of the dense layers (`intermediate_size`)."""
    shared_intermediate: int = 0
    """Width of a shared expert every token runs (Qwen2-MoE), 0: none."""

    @classmethod
    def from_text_config(cls, text) -> "MoESpec | None":
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
        top_k = getattr(text, "num_experts_per_tok", None)
        if not experts or not top_k:
            return None
        n = int(text.num_hidden_layers)
        step = int(getattr(text, "decoder_sparse_step", 1) or 1)
        dense_only = set(getattr(text, "mlp_only_layers", None) or ())
        layers = sum(1 for i in range(n) if i not in dense_only and (i + 1) % step == 0)
        width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
        return cls(experts=int(experts), top_k=int(top_k), expert_intermediate=int(width),
                   layers=layers, dense_intermediate=int(text.intermediate_size),
                   shared_intermediate=int(getattr(text, "shared_expert_intermediate_size", 0)
                                           or 0))

    def active_intermediate(self, layers: int) -> float:
        """The MLP width a token runs through, averaged over the model's `layers` layers."""
        moe = self.top_k * self.expert_intermediate + self.shared_intermediate
        return (self.layers * moe + (layers - self.layers) * self.dense_intermediate) / layers


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
    llm_heads: int | None = None
    """The LLM's query heads (sp and tp must divide them); None: not checked."""
    llm_kv_heads: int | None = None
    moe: MoESpec | None = None
    """The LLM's MoE blocks; None: a dense LLM. `dims.intermediate` is then the active width."""
    text_config: object = None
    """The LLM's HF config where the spec was read from one: training's own tp / ep checks
    (`check_tensor_parallel`, `autoep_section`) run on it."""

    @classmethod
    def from_dims(cls, dims: ModelDims, frozen: tuple[str, ...] = (),
                  scales: dict[str, float] | None = None, heads: int | None = None,
                  kv_heads: int | None = None, moe: MoESpec | None = None) -> "ModelSpec":
        """`heads`, `kv_heads`: the LLM's; `moe`: its MoE blocks (the cost model then prices
        the active width; `dims.intermediate` is replaced by it)."""
        for name, enc in dims.encoders.items():
            enc.frozen = name in frozen
        if moe is not None:
            dims = dataclasses.replace(dims, intermediate=moe.active_intermediate(dims.layers))
        return cls(dims, CostModel(dims, scales=scales), tuple(frozen), llm_heads=heads,
                   llm_kv_heads=kv_heads, moe=moe)

    @classmethod
    def from_hf_config(cls, hf_config, frozen: tuple[str, ...] = (),
                       scales: dict[str, float] | None = None) -> "ModelSpec":
        """From an HF config: a composite one (text_config + vision/audio configs) or an LLM's."""
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = getattr(text, "num_attention_heads", None)
        spec = cls.from_dims(ModelDims.from_hf_config(hf_config), frozen, scales, heads,
                             getattr(text, "num_key_value_heads", None) or heads,
                             MoESpec.from_text_config(text))
        heads = {}
        for name in spec.dims.encoders:
            sub = getattr(hf_config, f"{name}_config", None)
            n = getattr(sub, "num_attention_heads", None) or getattr(sub, "num_heads", None) or \
                getattr(sub, "encoder_attention_heads", None)
            if n:
                heads[name] = int(n)
        return dataclasses.replace(spec, encoder_heads=heads or None, text_config=text)

    def heads(self, name: str) -> int:
        e = self._encoder(name)
        return (self.encoder_heads or {}).get(name) or max(1, e.hidden // 64)

    # ------------------------------------------------------------------------- parameters
    @property
    def kv(self) -> int:
        return self.dims.kv_hidden or self.dims.hidden

    def llm_layer_params(self, tp: int = 1, ep: int = 1) -> float:
        """One decoder layer's parameters (an MoE model's mean layer) on one rank: tp splits
        them all, ep the experts."""
        d = self.dims
        h = d.hidden
        attention = 2 * h * h + 2 * h * self.kv
        if self.moe is None:
            return (attention + d.mlp_matrices * h * d.intermediate) / tp
        e = self.moe
        dense = (d.layers - e.layers) * d.mlp_matrices * h * e.dense_intermediate
        shared = e.layers * (d.mlp_matrices * h * e.shared_intermediate + h * e.experts)  # + router
        return (attention + (dense + shared + self.expert_params() / ep) / d.layers) / tp

    def expert_params(self) -> float:
        """Every MoE layer's experts (what ep splits); 0 for a dense LLM."""
        if self.moe is None:
            return 0.0
        e = self.moe
        return e.layers * e.experts * self.dims.mlp_matrices * self.dims.hidden * \
            e.expert_intermediate

    def expert_flops_per_token(self) -> float:
        """Training FLOPs of a token's routed experts (top-k of them), all MoE layers."""
        if self.moe is None:
            return 0.0
        e = self.moe
        return self.cost.train_factor * e.layers * 2 * e.top_k * self.dims.mlp_matrices * \
            self.dims.hidden * e.expert_intermediate * self.cost.scales["llm_lin"]

    def llm_params(self, tp: int = 1, ep: int = 1) -> float:
        """Decoder layers (split by tp, experts by ep), token embedding and an untied LM head
        (whole on every rank)."""
        d = self.dims
        return d.layers * self.llm_layer_params(tp, ep) + 2 * d.hidden * d.vocab

    def encoder_params(self, name: str) -> int:
        """The encoder's layers and a projector to the LLM's width."""
        e = self._encoder(name)
        layer = 4 * e.hidden ** 2 + e.mlp_matrices * e.hidden * e.intermediate
        return e.layers * layer + e.hidden * self.dims.hidden

    def encoder_tensors(self, name: str) -> int:
        """Parameter tensors of the encoder and its projector, as HF's ViT towers hold them: a
        layer's 4 attention and `mlp_matrices` MLP weights with biases and 2 norms; the
        embeddings (3), the tower's 2 norms and a 2-layer projector (4 + 4)."""
        e = self._encoder(name)
        return e.layers * (2 * (4 + e.mlp_matrices) + 4) + 11

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
    def _layer_activation_values(self, tp: int) -> float:
        """Values kept per token in one layer without checkpointing (tp splits its widths)."""
        d = self.dims
        return 4 * d.hidden + (2 * d.hidden + 2 * self.kv + d.mlp_matrices * d.intermediate) / tp

    def llm_activation_bytes(self, checkpointing: bool, tp: int = 1) -> float:
        """Bytes kept per token for backward over all LLM layers (on one of tp ranks)."""
        d = self.dims
        if checkpointing:
            return d.layers * BF16 * d.hidden
        return d.layers * BF16 * self._layer_activation_values(tp)

    def llm_peak_extra_bytes(self, checkpointing: bool, tp: int = 1) -> float:
        """Per token, on top of what is kept: the logits and their gradient (fp32), and under
        checkpointing the one layer recomputed whole."""
        extra = 4 * self.dims.vocab
        if checkpointing:
            extra += BF16 * self._layer_activation_values(tp)
        return extra

    def encoder_activation_bytes(self, name: str, checkpointing: bool) -> float:
        """Bytes kept per encoder position over all its layers (forward only if frozen)."""
        e = self._encoder(name)
        if e.frozen:
            return 0.0
        width = e.hidden if checkpointing else 8 * e.hidden + e.mlp_matrices * e.intermediate
        return e.layers * BF16 * width
