"""Decoder layers whose token mixing is not plain attention, run once per sample of a packed row.

A recurrence, a convolution over time or an indexer knows nothing of `cu_seqlens`: over a packed
row its state would flow from one sample into the next. Such a layer runs here once per sample,
each piece with its own position embeddings, ids and bidirectional spans (what HF hands it for one
unpadded sequence), and the outputs are joined; attention layers stay on the packed kernel.
`PER_SAMPLE`, `AS_ATTENTION` and `NOT_SUPPORTED` key on the config's `layer_types`; an indexed
(top-k sparse) layer (`WITH_MASK`) runs its sample on SDPA with the mask narrowed to the top-k
pick. The cost is one call a sample; the gain is exactness without knowing the layer's internals
(HF's CPU fallbacks take no `cu_seqlens`). Under Ulysses SP a rank holds no whole sample, so these
layers are refused (`sp_problem`). More: docs/models.md, "Which model types train exactly".

Dims: T tokens of the row, L tokens of one sample, D hidden size, d rotary dim.
"""

from __future__ import annotations

import torch
from torch import nn

from ds_omni.errors import ModelError
from ds_omni.model.attention import sample_blocks

PER_SAMPLE = {
    "linear_attention": "a gated delta net (Qwen3.5, MiniCPM-V 4.6): a causal convolution over "
                        "time and a recurrent state",
    "conv": "a gated short convolution over time (LFM)",
    "indexed_attention": "a DeepSeek-V3.2-style indexer that picks each query's top-k keys among "
                         "all earlier tokens, and attention masked to that pick",
}
"""Layer type (as `config.layer_types` names it) -> what in it mixes tokens across a sample."""
WITH_MASK = ("indexed_attention",)
"""Per-sample types whose layer reads HF's causal mask (the indexer masks its scores with it and
adds its top-k pick to it): each sample gets the boolean causal mask HF builds for one unpadded
sequence, and the attention inside runs on SDPA with the mask the layer hands it (so the top-k
pick holds at any sample length, not only below k, where it is plain causal attention)."""
AS_ATTENTION = {
    "full_attention": "causal attention",
    "sliding_attention": "causal attention in a sliding window",
    "reference_sliding_attention": "causal attention while training: its window applies to "
                                   "decoded tokens only, past a prefill that is kept whole, and a "
                                   "training forward is all prefill (no cache)",
}
"""Layer types that run on the packed kernel over the whole row."""
NOT_SUPPORTED = {
    "hybrid": "Inkling's layers also take relative-distance and convolution masks that its "
              "model's forward builds (Inkling 2's also block states: attention over the outputs "
              "of earlier blocks); the backbone hands a layer only the hidden states of the one "
              "before",
    "hybrid_sliding": "as 'hybrid', with a sliding window",
}
"""Layer types no backbone path runs, with why."""
ROW_BOUNDS = "ds_omni_row_bounds"
"""`Backbone.layer_kwargs`' key for the row's `cu_seqlens` as a host list (the kernel's copy may
sit on the device)."""
PER_TOKEN = ("moe_mm_token_type_ids",)
"""Per-token layer inputs [1, T] (`Family.layer_inputs`), cut to each sample like the positions."""
_ROW_ONLY = ("cu_seqlens", "max_seqlen", "ds_omni_blocks", ROW_BOUNDS)
"""Per-row keyword arguments of `Backbone.layer_kwargs` that a per-sample call replaces."""


def layer_types_problem(layer_types) -> str | None:
    """Why an LLM with these `config.layer_types` cannot run on the backbone, or None."""
    unknown = sorted(set(layer_types or ()) - set(PER_SAMPLE) - set(AS_ATTENTION))
    if not unknown:
        return None
    why = "; ".join(f"{t}: {NOT_SUPPORTED[t]}" for t in unknown if t in NOT_SUPPORTED)
    return (f"its LLM has layers of types {unknown}, which the generic backbone does not run "
            f"({why or 'unknown to it'}); it runs {sorted(AS_ATTENTION)} on the packed kernel and "
            f"{sorted(PER_SAMPLE)} once per sample")


def per_sample_types(config) -> list[str]:
    """The layer types of an LLM config that run per sample (sorted; [] for plain attention)."""
    return sorted(set(getattr(config, "layer_types", None) or ()) & set(PER_SAMPLE))


def mark(layers: nn.ModuleList, config) -> None:
    """Tag each decoder layer whose config type runs per sample (`runs_per_sample` reads it)."""
    types = getattr(config, "layer_types", None) or ()
    for layer, kind in zip(layers, types):
        if kind in PER_SAMPLE:
            layer.ds_omni_per_sample = kind


def runs_per_sample(layer: nn.Module) -> bool:
    return getattr(layer, "ds_omni_per_sample", None) is not None


def sp_problem(types: list[str]) -> str | None:
    """Why an LLM with layers of these per-sample `types` cannot run sequence-parallel, or None."""
    if not types:
        return None
    return (f"this LLM has layers of types {types} ({'; '.join(PER_SAMPLE[t] for t in types)}), "
            "which run once per whole sample, while sequence parallelism leaves each rank a shard "
            "of the row; set parallel.sp and parallel.max_sequence_sp to 1 (data parallelism, "
            "ZeRO and the pipeline engine run such models)")


def run_per_sample(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """hidden [1, T, D] -> [1, T, D]: `layer` called once per sample of the row (module
    docstring)."""
    attention = kwargs.get("ds_omni_attention")
    if attention is not None and attention.sp_group is not None:
        raise ModelError(f"a decoder layer of type {layer.ds_omni_per_sample!r} cannot run on a "
                         "sequence shard: " + sp_problem([layer.ds_omni_per_sample]))
    bounds = kwargs.get(ROW_BOUNDS) or kwargs["cu_seqlens"].tolist()
    if bounds[-1] != hidden.shape[1]:
        raise ModelError(f"the row's samples end at {bounds[-1]} but the hidden states hold "
                         f"{hidden.shape[1]} tokens; a per-sample layer needs the whole row")
    rest = {k: v for k, v in kwargs.items() if k not in _ROW_ONLY}
    blocks = kwargs.get("ds_omni_blocks")
    spans = blocks.tolist() if blocks is not None else []  # [m, 2] row positions
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        one = torch.tensor([0, b - a])  # the sample's own boundaries, where the kernel reads them
        one = attention.boundaries(one, hidden.device) if attention is not None else one
        inside = sample_blocks(spans, a, b)  # the sample's bidirectional spans, made relative
        rest["ds_omni_blocks"] = torch.tensor(inside) if inside else None
        if layer.ds_omni_per_sample in WITH_MASK:
            rest["attention_mask"] = causal_mask(b - a, hidden.device)
        out = layer(hidden[:, a:b], **sample_kwargs(rest, a, b, hidden.shape[1]),
                    ds_omni_cu_seqlens=one, ds_omni_max_seqlen=b - a)
        # (hidden, top-k indices): Mistral Large 4's layers also return their pick, which only a
        # "shared" indexer layer would read (`generic.config_problem` refuses those)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return torch.cat(outs, dim=1)  # L_i x [1, L_i, D] -> [1, T, D]


def sample_kwargs(kwargs: dict, start: int, end: int, total: int) -> dict:
    """The layer's keyword arguments for the sample [start, end) of a row of `total` tokens: the
    position embeddings (cos, sin) [1, T, d] and position ids [1, T] cut to it. (The sample's own
    boundaries travel as `ds_omni_cu_seqlens`, not `cu_seqlens`: a layer may take a `cu_seqlens`
    of its own, as HF's gated delta rule does, for kernels of another layout.)"""
    out = dict(kwargs)
    cos_sin = kwargs.get("position_embeddings")
    if cos_sin is not None:
        out["position_embeddings"] = tuple(_cut(t, start, end, total, dim=-2) for t in cos_sin)
    for name in ("position_ids", *PER_TOKEN):
        if kwargs.get(name) is not None:
            out[name] = _cut(kwargs[name], start, end, total, dim=-1)
    return out


def _cut(t: torch.Tensor, start: int, end: int, total: int, dim: int) -> torch.Tensor:
    if t.shape[dim] != total:
        raise ModelError(f"a per-sample layer's input has {t.shape[dim]} positions on dim {dim} "
                         f"where the row has {total} tokens; its family passes it in a layout "
                         "ds_omni does not cut")
    return t.narrow(dim, start, end - start)


def causal_mask(length: int, device) -> torch.Tensor:
    """[1, 1, L, L] bool, True where a query may see a key: HF's SDPA causal mask of one unpadded
    sequence (`create_causal_mask` without the causal skip)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
