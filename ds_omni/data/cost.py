"""Workload cost of a sample from its metadata only: token count, encoder items and their lengths.

The cost is modelled training FLOPs of the LLM and of each encoder, optionally rescaled per term by
`CostModel.calibrate` from measured seconds. Attention makes it quadratic in the sequence length,
so a 32k-token sample costs hundreds of 100-token captions, which is why balancing counts cost,
not tokens.

Dims: N samples, M encoder items (images, audio clips) over all samples, T cost terms
(2 for the LLM + 2 per encoder), K timed measurements (micro-batches or steps) in calibration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ds_omni.errors import ModelError

TRAIN_FACTOR = 3.0
"""Training FLOPs / forward FLOPs: the backward pass costs about twice the forward."""

# LLM families whose MLP is a plain up/down projection (2 matrices); all others are taken as gated
# (SwiGLU / GeGLU: gate, up, down = 3 matrices), which covers Llama, Qwen, Mistral, Gemma.
_PLAIN_MLP_LLMS = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "gpt_bigcode", "phi",
                   "starcoder2", "mpt"}
# Encoders with a gated MLP; CLIP, SigLIP, Whisper and the Qwen2-VL ViT are plain.
_GATED_ENCODERS = {"qwen2_5_vl_vision", "qwen2_5_omni_vision_encoder"}


# ----------------------------------------------------------------------------------- dims
@dataclass(kw_only=True)
class EncoderDims:
    """Size of one transformer encoder (a ViT, a Whisper encoder)."""

    hidden: int
    """Width of the encoder's residual stream."""
    layers: int
    """Transformer blocks."""
    intermediate: int
    """MLP inner width."""
    mlp_matrices: int = 2
    """Weight matrices of one MLP: 2 for plain (fc1, fc2), 3 for gated (gate, up, down)."""
    frozen: bool = False
    """A frozen encoder runs forward only (nothing before it needs its input gradient)."""
    dummy_len: int = 0
    """Length of the dummy input the encoder runs on a micro-batch without its items (so ZeRO-3
    never hangs): Whisper's whole window, else one image; 0 if unknown."""


@dataclass(kw_only=True)
class ModelDims:
    """Sizes the cost model needs: the LLM backbone and every encoder, by name."""

    hidden: int
    """LLM hidden size."""
    layers: int
    """LLM decoder layers."""
    intermediate: int
    """LLM MLP inner width."""
    vocab: int
    """Vocabulary size (the LM head costs 2 * hidden * vocab FLOPs per token)."""
    kv_hidden: int | None = None
    """Width of K and V together per head group (num_key_value_heads * head_dim); None: hidden."""
    mlp_matrices: int = 3
    """Weight matrices of one LLM MLP: 3 for gated (Llama, Qwen), 2 for plain (GPT-2)."""
    encoders: dict[str, EncoderDims] = field(default_factory=dict)
    """Encoder name ("vision", "audio", ...) -> its size."""

    def __post_init__(self):
        for name in ("hidden", "layers", "intermediate", "vocab"):
            if getattr(self, name) < 1:
                raise ModelError(f"ModelDims.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "ModelDims":
        """Read an HF config: composite (text_config + vision_config / audio_config) or a causal LM."""
        text = getattr(hf_config, "text_config", None) or hf_config
        encoders = {}
        for attr in getattr(hf_config, "sub_configs", None) or {}:  # e.g. vision_config, audio_config
            sub = getattr(hf_config, attr, None)
            if attr != "text_config" and sub is not None:
                encoders[attr.removesuffix("_config")] = _encoder_dims(sub, attr)
        return cls(**_llm_fields(text), encoders=encoders)


def _first(cfg: Any, names: tuple[str, ...], what: str):
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    raise ModelError(f"cannot read the {what} of a {type(cfg).__name__} (model_type "
                     f"{getattr(cfg, 'model_type', '?')!r}): it has none of {list(names)}; build "
                     "ModelDims by hand for this model")


def _llm_fields(cfg: Any) -> dict:
    hidden = int(_first(cfg, ("hidden_size", "d_model", "n_embd"), "LLM hidden size"))
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if heads else None)
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    plain = getattr(cfg, "model_type", "") in _PLAIN_MLP_LLMS
    layers = _first(cfg, ("num_hidden_layers", "n_layer"), "LLM depth")
    return {"hidden": hidden, "layers": int(layers), "intermediate": int(inter),
            "vocab": int(_first(cfg, ("vocab_size",), "vocabulary size")),
            "kv_hidden": int(kv_heads * head_dim) if kv_heads and head_dim else None,
            "mlp_matrices": 2 if plain else 3}


def _encoder_dims(cfg: Any, attr: str) -> EncoderDims:
    # Qwen2-VL's vision `hidden_size` is its output (LLM) width; `embed_dim` is the ViT's own width.
    hidden = int(_first(cfg, ("embed_dim", "d_model", "hidden_size"), f"{attr} width"))
    layers = int(_first(cfg, ("depth", "encoder_layers", "num_hidden_layers"), f"{attr} depth"))
    inter = (getattr(cfg, "encoder_ffn_dim", None) or getattr(cfg, "intermediate_size", None)
             or int(hidden * _first(cfg, ("mlp_ratio",), f"{attr} MLP width")))
    gated = getattr(cfg, "model_type", "") in _GATED_ENCODERS
    return EncoderDims(hidden=hidden, layers=layers, intermediate=int(inter),
                       mlp_matrices=3 if gated else 2, dummy_len=_dummy_len(cfg))


def _dummy_len(cfg: Any) -> int:
    """The encoder sequence of the families' `dummy_inputs` (ds_omni.model.families)."""
    if getattr(cfg, "max_source_positions", None):  # Whisper: a silent full window
        return int(cfg.max_source_positions)
    if getattr(cfg, "spatial_merge_size", None):  # Qwen2-VL: one merge block of patches
        return int(cfg.spatial_merge_size) ** 2
    if getattr(cfg, "image_size", None) and getattr(cfg, "patch_size", None):  # a ViT: one image
        cls = str(getattr(cfg, "model_type", "")).startswith("clip")
        return (int(cfg.image_size) // int(cfg.patch_size)) ** 2 + cls
    return 0


# ----------------------------------------------------------------------------------- model
class CostModel:
    """Training cost of samples: LLM a*s^2 + b*s per sample, encoder c*p^2 + d*p per item.

    Per layer and token, the forward pass of a linear layer costs 2 FLOPs per weight; attention
    scores (Q K^T) and values (A V) cost 2 * hidden * s each per token, halved for causal masks.
    So with h hidden, L layers, I MLP width, V vocab, kv the K/V width and k MLP matrices:
      LLM:     a = f * L * 2h            (causal: 2 * 2h * s^2 / 2 per layer)
               b = f * (L * 2 * (2h^2 + 2h*kv + k*h*I) + 2h*V)
      encoder: c = f_e * L_e * 4h_e      (non-causal attention over the item's own p positions)
               d = f_e * L_e * 2 * (4h_e^2 + k_e*h_e*I_e)
    with f = 3 (forward + backward; `train_factor`) and f_e = 1 for a frozen encoder. Ignored:
    norms, rotary, softmax, projector and patch-merger FLOPs (< 2% for 7B-class models).
    `scales` multiplies each term (see `terms`); `calibrate` fits them to measured seconds.
    """

    def __init__(self, dims: ModelDims, *, train_factor: float = TRAIN_FACTOR,
                 scales: dict[str, float] | None = None):
        self.dims = dims
        self.train_factor = train_factor
        self.encoder_names: list[str] = list(dims.encoders)
        self.terms: list[str] = ["llm_quad", "llm_lin"] + [
            f"{e}_{k}" for e in self.encoder_names for k in ("quad", "lin")]
        unknown = sorted(set(scales or {}) - set(self.terms))
        if unknown:
            raise ValueError(f"unknown cost term(s) {unknown}; this model has {self.terms}")
        self.scales = {t: 1.0 for t in self.terms} | dict(scales or {})
        self._flops = self._flop_coefficients()  # [T] FLOPs per unit of each term's feature

    def _flop_coefficients(self) -> np.ndarray:
        d, f = self.dims, self.train_factor
        kv = d.kv_hidden or d.hidden
        coef = [f * d.layers * 2 * d.hidden,
                f * (d.layers * 2 * (2 * d.hidden ** 2 + 2 * d.hidden * kv
                                     + d.mlp_matrices * d.hidden * d.intermediate)
                     + 2 * d.hidden * d.vocab)]
        for name in self.encoder_names:
            e = d.encoders[name]
            fe = 1.0 if e.frozen else f
            per_token = 4 * e.hidden ** 2 + e.mlp_matrices * e.hidden * e.intermediate  # weights
            coef += [fe * e.layers * 4 * e.hidden, fe * e.layers * 2 * per_token]
        return np.asarray(coef, dtype=np.float64)

    @property
    def coefficients(self) -> dict[str, float]:
        """Term -> cost per unit of its feature (s^2, s, p^2 or p), scales applied."""
        return {t: float(c * self.scales[t]) for t, c in zip(self.terms, self._flops)}

    def with_scales(self, scales: dict[str, float]) -> "CostModel":
        """A copy with these per-term scale factors (others keep theirs)."""
        return CostModel(self.dims, train_factor=self.train_factor, scales=self.scales | scales)

    # ------------------------------------------------------------------------------ costs
    def llm_cost(self, tokens: np.ndarray) -> np.ndarray:
        """[N] LLM cost of samples of `tokens` [N] positions (text + image/audio tokens)."""
        s = np.asarray(tokens, dtype=np.float64)
        c = self.coefficients
        return c["llm_quad"] * s * s + c["llm_lin"] * s

    def encoder_cost(self, name: str, lengths: np.ndarray) -> np.ndarray:
        """[M] cost of items of encoder `name`, each `lengths` [M] patches/frames long."""
        if name not in self.dims.encoders:
            raise ValueError(f"no encoder {name!r} in the cost model; it has {self.encoder_names}")
        p = np.asarray(lengths, dtype=np.float64)
        c = self.coefficients
        return c[f"{name}_quad"] * p * p + c[f"{name}_lin"] * p

    def dummy_cost(self, present) -> float:
        """Cost of the dummy passes of one micro-batch whose items use only the encoders named in
        `present`: each other encoder still runs once (`EncoderDims.dummy_len`). Not a cost of
        any sample: grouped reordering balances samples; this counts in a rank's modelled cost."""
        absent = [name for name in self.encoder_names if name not in set(present)]
        return float(sum(self.encoder_cost(name, np.array([self.dims.encoders[name].dummy_len]))[0]
                         for name in absent))

    def sample_costs(self, tokens: np.ndarray, item_sample: np.ndarray | None = None,
                     item_encoder: np.ndarray | None = None,
                     item_len: np.ndarray | None = None) -> np.ndarray:
        """[N] cost of whole samples: tokens [N]; items: owning sample [M], encoder [M], length [M]."""
        return self.term_costs(tokens, item_sample, item_encoder, item_len).sum(axis=1)

    def term_costs(self, tokens: np.ndarray, item_sample: np.ndarray | None = None,
                   item_encoder: np.ndarray | None = None,
                   item_len: np.ndarray | None = None) -> np.ndarray:
        """[N, T] cost of each sample split by term (columns in `self.terms` order)."""
        feats = self._features(tokens, item_sample, item_encoder, item_len)  # [N, T]
        return feats * (self._flops * np.array([self.scales[t] for t in self.terms]))

    def _features(self, tokens, item_sample, item_encoder, item_len) -> np.ndarray:
        s = np.asarray(tokens, dtype=np.float64)
        n = s.shape[0]
        out = np.zeros((n, len(self.terms)))  # [N, T] raw features: s^2, s, then p^2, p per encoder
        out[:, 0], out[:, 1] = s * s, s
        if item_sample is None or len(item_sample) == 0:
            return out
        owner = np.asarray(item_sample, dtype=np.int64)
        if owner.min() < 0 or owner.max() >= n:
            raise ValueError(f"item_sample must index the {n} samples; got values in "
                             f"[{owner.min()}, {owner.max()}]")
        enc = self.encoder_index(item_encoder)
        p = np.asarray(item_len, dtype=np.float64)
        for e in range(len(self.encoder_names)):
            mask = enc == e
            out[:, 2 + 2 * e] = np.bincount(owner[mask], weights=p[mask] ** 2, minlength=n)
            out[:, 3 + 2 * e] = np.bincount(owner[mask], weights=p[mask], minlength=n)
        return out

    def encoder_index(self, item_encoder: np.ndarray) -> np.ndarray:
        """[M] encoder indices (into `encoder_names`) from names or indices."""
        enc = np.asarray(item_encoder)
        if enc.dtype.kind in "US":
            lookup = {name: i for i, name in enumerate(self.encoder_names)}
            bad = sorted(set(enc.tolist()) - set(lookup))
            if bad:
                raise ValueError(f"unknown encoder name(s) {bad}; the model has {self.encoder_names}")
            return np.array([lookup[x] for x in enc.tolist()], dtype=np.int64)
        enc = enc.astype(np.int64)
        if enc.size and (enc.min() < 0 or enc.max() >= len(self.encoder_names)):
            raise ValueError(f"encoder indices must be in [0, {len(self.encoder_names)}), got "
                             f"[{enc.min()}, {enc.max()}]")
        return enc

    # ------------------------------------------------------------------------ calibration
    def calibrate(self, tokens: np.ndarray, item_sample: np.ndarray | None,
                  item_encoder: np.ndarray | None, item_len: np.ndarray | None,
                  seconds: np.ndarray, sample_step: np.ndarray | None = None) -> "CostModel":
        """A model whose cost is in seconds: per-term scales fit by non-negative least squares.

        Measurement k took `seconds[k]` [K] and ran the samples with `sample_step[n] == k` (default:
        each sample is its own measurement). A term no measurement exercises (say, audio in a
        text+image profile) gets the median of the fitted FLOPs->seconds factors.
        """
        terms = self.term_costs(tokens, item_sample, item_encoder, item_len)  # [N, T]
        y = np.asarray(seconds, dtype=np.float64)
        group = np.arange(len(terms)) if sample_step is None else np.asarray(sample_step)
        if group.shape[0] != terms.shape[0] or group.max(initial=-1) >= len(y):
            raise ValueError(f"sample_step must give each of the {len(terms)} samples a measurement "
                             f"index < len(seconds) = {len(y)}")
        a = np.stack([np.bincount(group, weights=terms[:, t], minlength=len(y))
                      for t in range(terms.shape[1])], axis=1)  # [K, T]
        seen = a.max(axis=0) > 0
        if not seen.any():
            raise ValueError("calibrate() got no work to fit: every measurement has zero cost")
        norm = np.linalg.norm(a[:, seen], axis=0)
        w = np.full(len(self.terms), np.nan)
        w[seen] = nnls(a[:, seen] / norm, y) / norm
        w[~seen] = np.median(w[seen])
        return self.with_scales({t: self.scales[t] * float(w[i]) for i, t in enumerate(self.terms)})


def nnls(a: np.ndarray, y: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """x >= 0 minimising |a x - y| (Lawson-Hanson active set); a [K, T], y [K] -> x [T]."""
    k, t = a.shape
    x = np.zeros(t)
    passive = np.zeros(t, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(k, t)
    for _ in range(max_iter or 3 * t + 10):
        grad = a.T @ (y - a @ x)  # [T]
        if passive.all() or grad[~passive].max(initial=-np.inf) <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(t)
            if passive.any():
                z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            denom = x[neg] - z[neg]
            step = np.min(np.where(denom > 0, x[neg] / np.where(denom > 0, denom, 1), 0.0))
            x = x + step * (z - x)
            passive &= x > tol
    return x
