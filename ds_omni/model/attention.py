"""Attention over packed variable-length sequences, plugged into HF decoder layers.

A micro-batch is one packed row; `cu_seqlens` delimits its samples and none attends to another.
`packed_attention` is registered in transformers' `AttentionInterface` (`PACKED_ATTENTION`) and set
on the LLM backbone's config only, so encoders keep their own attention; the `PackedAttention`
object passed with each call (one per model) picks the kernel and the SP group. Three kernels give
the same numbers (`choose_kernel` picks for "auto"): torch's varlen kernel (CUDA), flash-attn's
varlen kernel, or SDPA once per sample. Sliding windows and bidirectional blocks (Gemma 3's image
tokens, PaliGemma's prefix) are applied as HF does; rows with blocks run on SDPA. Under Ulysses SP
DeepSpeed's `DistributedAttention` trades the token split for a head split and the kernel runs on
the whole row with the global `cu_seqlens`; KV heads are repeated until the ranks split them.
Under parallel.cp that kernel is the ring over the cp rank's tokens (`ring_attention`). More:
docs/models.md; docs/parallelism.md, "Sequence parallelism", "Ring attention".
Dims: B batch (1 packed), T packed tokens, S of one SP shard, H query heads, Hkv KV heads, D.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math

import torch
import torch.nn.functional as F

from ds_omni.model.ring_attention import ring_attention
from ds_omni.parallel.evidence import SPCounts
from ds_omni.parallel.ring import RingGroup

PACKED_ATTENTION = "ds_omni_packed"
KERNELS = ("auto", "varlen", "sdpa", "eager", "flash_attention_2")
log = logging.getLogger(__name__)
_logged: set[str] = set()


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def torch_varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def choose_kernel(asked: str, *, varlen: bool, flash_attn: bool) -> str:
    """The kernel that runs for `asked`, given what this machine has (pure, for tests)."""
    from ds_omni.errors import ConfigError
    if asked == "auto":
        return "varlen" if varlen else "sdpa"
    if asked == "varlen" and not varlen:
        raise ConfigError("model.attn_implementation is 'varlen' but torch's varlen kernel needs "
                          f"CUDA and torch >= 2.10 (this process: torch {torch.__version__}, CUDA "
                          f"{'available' if torch.cuda.is_available() else 'not available'}); "
                          "use 'auto' (falls back to SDPA, same numbers)")
    if asked == "flash_attention_2" and not flash_attn:
        raise ConfigError("model.attn_implementation is 'flash_attention_2' but flash-attn is "
                          "not installed or no GPU is visible; install the 'gpu' extra on a CUDA "
                          "machine or use 'auto' (same numbers)")
    return "sdpa" if asked == "eager" else asked


def resolve_kernel(asked: str) -> str:
    """The kernel `asked` runs on this machine; a clear error if it cannot run here (start-up
    calls this before any process group exists, so a bad choice fails on every rank at once)."""
    return choose_kernel(asked, varlen=asked in ("auto", "varlen") and torch_varlen_available(),
                         flash_attn=asked == "flash_attention_2" and flash_attn_available())


class PackedAttention:
    """The packed-row attention of one model: its kernel, and its SP group when sequence-parallel.

    `counts`: where its Ulysses calls are counted (the model's `SPCounts`, shared by all of its
    attentions); None: counts of its own."""

    def __init__(self, kernel: str = "sdpa", sp_group=None, counts: SPCounts | None = None,
                 ring: "RingGroup | None" = None):
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
        self.kernel = resolve_kernel(kernel)
        self.asked = kernel
        if self.kernel not in _logged:
            _logged.add(self.kernel)
            log.info("ds_omni: packed attention kernel %r (asked %r)", self.kernel, kernel)
        self.sp_group = sp_group
        self.counts = counts if counts is not None else SPCounts()
        self.ring = ring  # parallel.cp: this rank's ring (`ds_omni.model.ring_attention`)
        self.row_index: torch.Tensor | None = None  # [cp, C] of the row at hand (`for_row`)
        self._ulysses = None
        if sp_group is not None:
            from deepspeed.sequence.layer import DistributedAttention
            # batch-first layout [B, S, H, D]: scatter heads (dim 2), gather the sequence (dim 1)
            self._ulysses = DistributedAttention(self._local, sp_group, scatter_idx=2, gather_idx=1)
            self.sp = torch.distributed.get_world_size(sp_group)

    def for_row(self, index) -> "PackedAttention":
        """This attention for one ring row: `index` [cp, C] the row positions of every cp rank's
        tokens (`Route.row_index`), which the ring masks by."""
        bound = copy.copy(self)
        bound.row_index = torch.as_tensor(index)
        return bound

    def boundaries(self, cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`cu_seqlens` where this kernel reads it: on the device (int32) for the varlen kernels,
        moved once per micro-batch rather than once per layer; on the host for per-sample SDPA,
        which slices by its values (reading them from a GPU would wait for the device)."""
        if self.kernel in ("varlen", "flash_attention_2") and self.ring is None:
            return cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
        return cu_seqlens

    def __call__(self, q, k, v, cu_seqlens, max_seqlen, scaling, dropout, window=None,
                 blocks=None):
        """q [1, H, S, D], k/v [1, Hkv, S, D] (S = T without SP) -> out [1, S, H, D].

        `window`: the layer's sliding window (None: full); `blocks` [m, 2]: bidirectional spans of
        the whole row (None: none). Both are over the whole row, which Ulysses gathers per head.
        """
        ring = {}
        if self.ring is not None:
            if self.row_index is None:
                raise ValueError("a row under parallel.cp reached ring attention without its "
                                 "zigzag index (Route.row_index): the loader and the model "
                                 "disagree on parallel.cp")
            ring = {"ring_index": self.row_index}
        if self._ulysses is None:
            return self._local(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, window, blocks,
                               heads_first=True, **ring)
        self.counts.ulysses_calls += 1
        k, v = (repeat_kv_for_sp(t, q.shape[1], self.sp) for t in (k, v))
        # [1, H, S, D] -> [1, S, H, D]; DistributedAttention: -> [1, T, H/sp, D] -> kernel -> back
        # (under cp: T is this cp rank's C tokens)
        return self._ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None,
                             cu_seqlens, max_seqlen, scaling, dropout, window, blocks, **ring)

    def _local(self, q, k, v, cu_seqlens, max_seqlen, scaling, dropout, window=None,
               blocks=None, heads_first: bool = False, ring_index=None):
        """q [1, T, h, D], k/v [1, T, hkv, D] over the whole row -> [1, T, h, D]; `heads_first`:
        q, k, v come as the layer makes them ([1, h, T, D]), which is what SDPA takes (no
        transposes there and back, nor their backward nodes). `ring_index`: under parallel.cp,
        T is this cp rank's tokens and the ring runs (`ring_attention`)."""
        if ring_index is not None:
            if heads_first:
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [1, h, C, D] -> [1, C, h, D]
            return ring_attention(q, k, v, ring_index, self.ring, cu_seqlens, scaling, dropout,
                                  window, blocks, self.counts)
        kernel = self.kernel
        if blocks is not None and len(blocks) and kernel != "sdpa":
            kernel = self._blocks_fallback()
        if kernel == "sdpa":
            if not heads_first:
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [1, T, h, D] -> [1, h, T, D]
            return _sdpa_per_sample(q, k, v, cu_seqlens, scaling, dropout, window, blocks)
        if heads_first:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [1, h, T, D] -> [1, T, h, D]
        if kernel == "flash_attention_2":
            return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, window)
        return _torch_varlen(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, window)

    def _blocks_fallback(self) -> str:
        """The kernel for a row with bidirectional blocks: SDPA when "auto" chose a varlen kernel
        (logged once), else an error naming the fix."""
        if self.asked != "auto":
            raise ValueError(
                f"model.attn_implementation is {self.asked!r}, but this model's image tokens (or "
                "prompt prefix) attend to each other both ways, a mask the varlen kernels cannot "
                "express; use 'auto' or 'sdpa' (per-sample SDPA with the model's own mask)")
        if "blocks" not in _logged:
            _logged.add("blocks")
            log.info("ds_omni: rows with bidirectional image blocks run on per-sample SDPA (the "
                     "%r kernel has no such mask)", self.kernel)
        return "sdpa"


def repeat_kv_for_sp(kv: torch.Tensor, num_heads: int, sp: int) -> torch.Tensor:
    """[1, Hkv, S, D] -> [1, Hkv * r, S, D], the fewest copies r so that sp ranks split KV heads
    evenly (Hkv * r = lcm(Hkv, sp)); each query head keeps its KV head, since H is a multiple of
    both. Gradients of the copies add up in backward."""
    hkv = kv.shape[1]
    r = sp // math.gcd(hkv, sp)
    if r == 1:
        return kv
    assert num_heads % (hkv * r) == 0, (num_heads, hkv, sp)  # checked at start-up
    return kv.repeat_interleave(r, dim=1)


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                     ds_omni_attention: PackedAttention | None = None,
                     ds_omni_blocks: torch.Tensor | None = None, **kwargs):
    """HF attention-interface function. q: [B, H, S, D], k/v: [B, Hkv, S, D] -> out [B, S, H, D].

    The layer passes its own `sliding_window` (None on full-attention layers); the backbone passes
    the row's bidirectional blocks as `ds_omni_blocks` ([m, 2], or None); a layer run per sample
    (`ds_omni.model.per_sample`) gets its sample's boundaries as `ds_omni_cu_seqlens`."""
    if cu_seqlens is None and kwargs.get("ds_omni_cu_seqlens") is not None:
        cu_seqlens, max_seqlen = kwargs.pop("ds_omni_cu_seqlens"), kwargs.pop("ds_omni_max_seqlen")
        if attention_mask is not None:  # one sample whose layer reads a mask: HF's SDPA with it
            return sdpa_with_top_k(module, query, key, value, attention_mask, scaling, dropout,
                                   kwargs)
    if cu_seqlens is None:  # called by HF itself (generate, a plain forward): its own SDPA path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    check_softcap(kwargs.get("softcap"))
    kernel = ds_omni_attention or PackedAttention()
    return kernel(query, key, value, cu_seqlens, max_seqlen, scaling, dropout,
                  kwargs.get("sliding_window"), ds_omni_blocks), None


def sdpa_with_top_k(module, query, key, value, mask, scaling, dropout, kwargs: dict):
    """HF's SDPA on one sample (q [1, H, L, D]) with the layer's boolean `mask` [1, 1, L, L];
    a DeepSeek-V3.2-style layer's top-k pick (`indices` [1, L, k], which HF turns into a mask on
    its eager and SDPA paths only and hands other kernels as is) narrowed into it as HF does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    indices = kwargs.pop("indices", None)
    if indices is not None:
        unpicked = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device)[None]
        unpicked = unpicked.scatter(-1, indices.long(), False).unsqueeze(1)  # [1, 1, L, L]
        mask = mask & ~unpicked
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def check_softcap(softcap: float | None) -> None:
    """Gemma 2's attention-logit softcapping is not in any packed kernel: an error, not other
    numbers."""
    if softcap is not None:
        raise ValueError(
            f"this model's attention layers soft-cap their logits (softcap {softcap}, Gemma 2 "
            "style); ds_omni's packed kernels have no softcapping, so they would train other "
            "numbers than the model's own. Use a model without attn_logit_softcapping")


def sample_mask(length: int, window: int | None = None,
                blocks: list[tuple[int, int]] = ()) -> torch.Tensor | None:
    """[L, L] bool (True: q may attend to k) of one sample, as HF's masks compose it:
    (causal OR same block) AND (k > q - window); None when that is plain causal (the caller
    then runs SDPA's mask-free causal path). `blocks`: (start, end) spans inside the sample."""
    banded = window is not None and window < length
    if not banded and not blocks:
        return None
    q = torch.arange(length)[:, None]  # [L, 1]
    k = torch.arange(length)[None, :]  # [1, L]
    allowed = k <= q  # [L, L]
    for start, end in blocks:
        allowed[start:end, start:end] = True
    if banded:
        allowed &= k > q - window
    return allowed


def sample_blocks(spans: list[list[int]], start: int, end: int) -> list[tuple[int, int]]:
    """The row's bidirectional `spans` ((start, end) pairs) inside sample [start, end), made
    relative to its first token."""
    return [(max(a, start) - start, min(b, end) - start) for a, b in spans
            if a < end and b > start]


def _sdpa_per_sample(q, k, v, cu_seqlens, scaling, dropout, window=None, blocks=None):
    """q [1, h, T, D], k/v [1, hkv, T, D] in, [1, T, h, D] out; one SDPA call per sample: causal,
    or with the sample's mask (`sample_mask`) where a window or a block makes it other than causal.

    The row is cut with one `split` (its backward is one concatenation; a slice per sample would
    make each backward write a zero [1, h, T, D] gradient and add them up) and the outputs are
    concatenated in the [1, T, h, D] layout (no copy to make it contiguous): the same numbers,
    about a tenth less time than slicing. Bounds past the tokens at hand are clipped to them,
    as slicing clipped them: a row shard that arrives with its whole row's bounds (a plan that
    skipped its Ulysses group) computes other numbers, for the parity tests to catch
    (`tests/plants/sequence_parallel.py`: sp_block_ignored), rather than a shape error."""
    tokens = q.shape[2]
    bounds = [min(b, tokens) for b in cu_seqlens.tolist()]
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    # [1, h, T, D] -> a [1, h, L, D] view per sample
    q_parts, k_parts, v_parts = (t.split(lengths, dim=2) for t in (q, k, v))
    spans = blocks.tolist() if blocks is not None else []  # [m, 2] read once, not per sample
    gqa = k.shape[1] != q.shape[1]
    outs = []
    for start, end, qi, ki, vi in zip(bounds[:-1], bounds[1:], q_parts, k_parts, v_parts):
        mask = sample_mask(end - start, window, sample_blocks(spans, start, end))  # [L, L]
        out = F.scaled_dot_product_attention(  # [1, h, L, D]
            qi, ki, vi, is_causal=mask is None,
            attn_mask=None if mask is None else mask.to(q.device), dropout_p=dropout,
            scale=scaling, enable_gqa=gqa)
        outs.append(out.transpose(1, 2))  # [1, L, h, D]
    return torch.cat(outs, dim=1)  # [1, T, h, D]


def _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, window=None):
    from flash_attn import flash_attn_varlen_func
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max_seqlen, max_seqlen,  # [T, h, D]
                                 dropout_p=dropout, softmax_scale=scaling, causal=True,
                                 window_size=(window - 1, 0) if window else (-1, -1))
    return out.unsqueeze(0)  # [1, T, h, D]


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, window=None):
    """torch's FlashAttention-2 varlen kernel: [1, T, h, D] in and out; causal per sample."""
    from torch.nn.attention.varlen import varlen_attn
    if dropout:
        raise ValueError("torch's varlen kernel has no dropout; use attn_implementation 'sdpa'")
    kwargs, repeat, q_scale = varlen_call(_varlen_params(), q.shape[2], k.shape[2], scaling,
                                          q.shape[-1], window)
    if repeat > 1:  # [1, T, hkv, D] -> [1, T, h, D]: each query head keeps its KV head
        k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
    if q_scale != 1.0:
        q = q * q_scale
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q[0], k[0], v[0], cu, cu, max_seqlen, max_seqlen, **kwargs)  # [T, h, D]
    return out.unsqueeze(0)


def varlen_call(params: frozenset[str], q_heads: int, kv_heads: int, scaling: float | None,
                head_dim: int, window: int | None = None) -> tuple[dict, int, float]:
    """How to call the installed `varlen_attn`, whose keywords changed between torch releases
    (2.10: `is_causal` only; later: `window_size`, `scale`, `enable_gqa`): its keyword arguments,
    how many times to repeat KV heads (when it takes no `enable_gqa`), and a factor for q (when it
    takes no `scale` and `scaling` is not its default 1/sqrt(D)). A sliding `window` (HF's: the
    query and window - 1 keys before it) is `window_size=(window - 1, 0)`."""
    if window and "window_size" not in params:
        raise ValueError(f"this torch's varlen kernel ({torch.__version__}) has no window_size, "
                         f"so it cannot run a sliding-window layer (window {window}); use "
                         "attn_implementation 'sdpa' (same numbers) or torch >= 2.11")
    if "window_size" in params:
        kwargs: dict = {"window_size": (window - 1 if window else -1, 0)}
    else:
        kwargs = {"is_causal": True}
    repeat = 1
    if kv_heads != q_heads:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = q_heads // kv_heads
    q_scale = 1.0
    if scaling is not None:
        if "scale" in params:
            kwargs["scale"] = scaling
        elif not math.isclose(scaling * math.sqrt(head_dim), 1.0, rel_tol=1e-9):
            q_scale = scaling * math.sqrt(head_dim)
    return kwargs, repeat, q_scale


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn
    return frozenset(inspect.signature(varlen_attn).parameters)


def register() -> None:
    """Make `PACKED_ATTENTION` a valid `config._attn_implementation` for HF models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    # HF's own forward (generate, parity references) builds its masks as for SDPA.
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
