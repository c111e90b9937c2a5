"""AutoEP's MoE layer on this machine, in the simulator's terms: what it costs beyond the dense
MLP of its active width that the cost model prices it as (`Cluster.moe_token_flops`,
`Cluster.expert_half_tokens`; `time_moe_layer`, `fit_moe_layer`).

One process (no process group) times, on `time.process_time` with one thread, forward + backward
of DeepSpeed's real `AutoEPMoELayer` built from HF's Qwen3-MoE block (ep 1: its router, sort,
gathers, permutation, grouped experts, un-permutation and weighted combine; the wire is the
links'), of its grouped experts alone on the layer's own routing, and of a dense SwiGLU MLP of
width top-k x expert width (the same FLOPs), interleaved, at a few token counts. Both terms are
ratios to the dense MLP's rate on the same clock, so the fitted machine's FLOP rate (which
carries the contention of its ranks on shared cores) prices them.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

TOKENS = (256, 1024, 4096)
"""Tokens of a pass the layer is timed at (a micro-batch's on a rank: 0.5-4 rows of 1-2K)."""


def moe_layer(hidden: int, experts: int, top_k: int, expert_intermediate: int):
    """DeepSpeed's `AutoEPMoELayer` (ep 1) in place of HF's Qwen3-MoE block of these sizes, as
    ds_omni's `autoep_section` configures it (HF's router: softmax top-k, renormalised)."""
    import torch
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from ds_omni.parallelize.expert_parallel import autoep_layers, autoep_section
    config = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                            moe_intermediate_size=expert_intermediate, norm_topk_prob=True,
                            num_hidden_layers=1, num_attention_heads=max(1, hidden // 64))
    holder = torch.nn.Module()
    holder.config = config
    torch.manual_seed(0)
    holder.mlp = Qwen3MoeSparseMoeBlock(config)
    for p in holder.mlp.parameters():  # HF initialises in its model's `_init_weights`: a bare
        torch.nn.init.normal_(p, std=config.initializer_range)  # block routes all alike
    section = dict(autoep_section(config, 1), moe_layer_pattern="mlp")
    auto_ep = AutoEP(holder, parse_autoep_config(section))
    auto_ep.replace_moe_layers(auto_ep.ep_parser(), ep_size=1, ep_rank=0)
    return next(iter(autoep_layers(holder).values()))


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def time_moe_layer(hidden: int = 256, experts: int = 4, top_k: int = 2,
                   expert_intermediate: int = 256, tokens=TOKENS, repeats: int = 7) -> dict:
    """Per token count of `tokens`: CPU seconds of a forward + backward of the whole layer
    ("layer"), of its grouped experts on the layer's routing ("experts") and of the dense MLP
    of the same FLOPs ("dense"), each the median of `repeats` (the three interleaved)."""
    import torch
    import torch.nn.functional as F
    from deepspeed.module_inject.auto_ep_layer import permute_by_local_expert
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks train
    try:
        layer = moe_layer(hidden, experts, top_k, expert_intermediate)
        width = top_k * expert_intermediate
        w = [(torch.randn(*shape) * 0.02).requires_grad_()  # gate, up, down
             for shape in ((width, hidden), (width, hidden), (hidden, width))]
        out = {"tokens": list(tokens), "layer": [], "experts": [], "dense": [],
               "shape": [hidden, experts, top_k, expert_intermediate]}
        for n in tokens:
            x = torch.randn(1, n, hidden, requires_grad=True)
            with torch.no_grad():  # the layer's own routing, for its experts alone
                picks = layer.router(x.reshape(n, hidden), layer.expert_bias)[1]
                counts = torch.bincount(picks.reshape(-1), minlength=experts)
                rows = x.reshape(n, hidden)[picks.reshape(-1).argsort(stable=True) // top_k]
                rows, _, aligned, _ = permute_by_local_expert(rows, counts)
            rows.requires_grad_()
            grad = torch.randn(n, hidden)  # a dense gradient (a grouped mm's backward wants one)

            def whole():
                y = layer(x)
                (y[0] if isinstance(y, tuple) else y).reshape(n, hidden).backward(grad)

            def grouped():
                out = layer.experts(rows, aligned)  # [rows padded, h]
                out.backward(torch.ones_like(out))

            def dense():
                h = x.reshape(n, hidden)
                F.linear(F.silu(F.linear(h, w[0])) * F.linear(h, w[1]), w[2]).backward(grad)
            for key, fn in (("layer", whole), ("experts", grouped), ("dense", dense)):
                fn()  # warm
            samples = {k: [] for k in ("layer", "experts", "dense")}
            for _ in range(repeats):
                for key, fn in (("layer", whole), ("experts", grouped), ("dense", dense)):
                    samples[key].append(_seconds(fn, 1))
            for key in samples:
                out[key].append(statistics.median(samples[key]))
        return out
    finally:
        torch.set_num_threads(threads)


def fit_moe_layer(timed: dict) -> dict:
    """The simulator's terms from `time_moe_layer`'s timings: `expert_half_tokens`, the tokens
    an expert needs for its matmuls to reach half the dense MLP's rate (eff(n) = n / (n + n_half)
    at n = tokens x top-k / experts; least squares of t_experts / t_dense - 1 = n_half / n), and
    `moe_token_flops`, the layer's seconds beyond its experts a token-expert assignment in
    FLOPs of the dense MLP's rate (the mean over the token counts)."""
    hidden, experts, top_k, inter = timed["shape"]
    n_tok = np.asarray(timed["tokens"], dtype=np.float64)
    layer, grouped, dense = (np.asarray(timed[k]) for k in ("layer", "experts", "dense"))
    per_expert = n_tok * top_k / experts
    excess = grouped / dense - 1
    half = float(max(0.0, np.sum(excess / per_expert) / np.sum(1 / per_expert ** 2)))
    rate = 3 * 2 * n_tok * 3 * hidden * top_k * inter / dense  # [T] the dense MLP's FLOP/s
    token_flops = (layer - grouped) * rate / (n_tok * top_k)
    return {"expert_half_tokens": half, "moe_token_flops": float(max(0.0, token_flops.mean())),
            "expert_efficiency": (dense / grouped).tolist(), "token_flops": token_flops.tolist(),
            "dense_flops_per_s": rate.tolist()}
