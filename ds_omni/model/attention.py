"""Attention over packed variable-length sequences, plugged into HF decoder layers.

A micro-batch is one packed row of samples; `cu_seqlens` delimits them and no sample attends to
another. The kernel is registered in transformers' `AttentionInterface` under `PACKED_ATTENTION`
and set on the LLM backbone's config only, so encoders keep their own attention (unlike a global
monkey-patch, which would also catch a ViT using the same key).

Two paths give the same numbers:
- flash-attn's varlen kernel when it is installed (the `gpu` extra) and `flash_attention_2` is asked;
- SDPA, one causal call per sample: no T x T mask is built, at the cost of one kernel per sample.

Dims: B batch (always 1 when packed), T packed tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_ATTENTION = "ds_omni_packed"
_USE_FLASH = {"value": False}


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def set_kernel(attn_implementation: str) -> None:
    """Choose the kernel behind `PACKED_ATTENTION` ("sdpa", "eager" or "flash_attention_2")."""
    if attn_implementation == "flash_attention_2" and not flash_attn_available():
        from ds_omni.errors import ConfigError
        raise ConfigError("model.attn_implementation is 'flash_attention_2' but flash-attn is not "
                          "installed or no GPU is visible; install the 'gpu' extra on a CUDA machine "
                          "or use 'sdpa' (same numbers)")
    _USE_FLASH["value"] = attn_implementation == "flash_attention_2"


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None, **kwargs):
    """HF attention-interface function. q: [B, H, T, D], k/v: [B, Hkv, T, D] -> out [B, T, H, D]."""
    if cu_seqlens is None:  # called by HF itself (generate, a plain forward): its own SDPA path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    if _USE_FLASH["value"]:
        out = _flash_varlen(query, key, value, cu_seqlens, max_seqlen, scaling, dropout)
    else:
        out = _sdpa_per_sample(query, key, value, cu_seqlens, scaling, dropout)
    return out, None


def _sdpa_per_sample(q, k, v, cu_seqlens, scaling, dropout):
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # [1, H, L, D] per sample, causal inside it
        outs.append(F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True,
            dropout_p=dropout, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]))
    out = torch.cat(outs, dim=2)  # [1, H, T, D]
    return out.transpose(1, 2).contiguous()  # [1, T, H, D]


def _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scaling, dropout):
    from flash_attn import flash_attn_varlen_func
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    # [1, H, T, D] -> [T, H, D]
    q_, k_, v_ = (t[0].transpose(0, 1) for t in (q, k, v))
    out = flash_attn_varlen_func(q_, k_, v_, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout,
                                 softmax_scale=scaling, causal=True)
    return out.unsqueeze(0)  # [1, T, H, D]


def register() -> None:
    """Make `PACKED_ATTENTION` a valid `config._attn_implementation` for HF models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    # HF's own forward (generate, parity references) builds its masks as for SDPA.
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
