"""Tensor and expert parallelism in the simulator, modelled from their communication volume
(AutoTP and AutoEP split evenly: no planner decides anything here).

TP: a rank runs 1/tp of the decoder layers' FLOPs and per layer all-reduces its activations twice
forward and its input gradients twice backward, or as AutoTP does once a column-parallel matrix
(`backward_calls`), each call paying `Cluster.a2a_call_s`; ZeRO partitions
over the dp x sp ranks of one tp coordinate. Encoders are not split: under `tp_encodes_apart`
each TP rank encodes its share and the rows are all-gathered (`run_tp_gather`), the encoder
gradients summed over TP (`run_tp_encoder_grads`); under tp x sp each TP rank runs Ulysses with
heads / tp. EP: per MoE layer 2 all-to-alls forward and 2 backward (+2 under checkpointing) of
tokens x top-k x h bf16, (ep - 1) / ep to other ranks (uniform routing), after AutoEP's count
exchange; expert FLOPs spread evenly over the group, AutoEP's routing and small-matmul costs on
top (`autoep_flops`); beside tp, the folded layer's TP gathers (`fold_seconds`); expert states
1/ep a rank over the dp / ep ranks holding the same experts. More: docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_omni.sim import comm


@dataclass(frozen=True)
class StateShard:
    """Parameters a rank holds that one ZeRO group partitions and reduces."""

    params: float
    trainable: float
    group_size: int
    """Ranks of the ZeRO group (the partition's divisor, the collectives' size)."""
    groups: list
    """The stage's ZeRO groups of this shard (global rank arrays)."""


def state_shards(step, stage: int, held: tuple[float, float]) -> list[StateShard]:
    """The ZeRO groups of a rank of `stage` holding `held` (params, trained) parameters:
    one over the stage's dp x sp ranks; under tp one per tp rank with the layers / tp; under
    ep the experts / ep over the ranks holding the same ones, the rest over all."""
    p, m = step.pplan, step.model
    if (p.pp > 1 and (p.tp > 1 or p.ep > 1)) or (p.tp > 1 and p.ep > 1):
        return composed_shards(step, stage, held)
    ranks = step.ranks_of(0, p.dp, stage)
    llm_trained = "llm" not in m.frozen
    if p.tp > 1:
        cut = m.llm_params() - m.llm_params(tp=p.tp) + vocab_cut(step, stage)  # tp's split
        groups = [ranks[t::p.tp] for t in range(p.tp)]
        return [StateShard(held[0] - cut, held[1] - cut * llm_trained, p.seq_data_size, groups)]
    if p.ep > 1:
        experts = m.expert_params()
        groups = [ranks[e::p.ep] for e in range(p.ep)]  # ranks holding the same experts
        rest = StateShard(held[0] - experts, held[1] - experts * llm_trained, p.seq_data_size,
                          [ranks])
        return [rest, StateShard(experts / p.ep, experts / p.ep * llm_trained,
                                 p.seq_data_size // p.ep, groups)]
    return [StateShard(held[0], held[1], p.seq_data_size, [ranks])]


def vocab_cut(step, stage: int) -> float:
    """Embedding and LM head parameters tp takes off a rank of `stage` under
    `SimPlan.vocab_parallel` (the embedding on the first stage, the head on the last)."""
    p, d = step.pplan, step.model.dims
    if not step.plan.vocab_parallel or p.tp == 1:
        return 0.0
    held = d.hidden * d.vocab * ((stage == 0) + (stage == p.pp - 1))
    return held * (1 - 1 / p.tp)


def stage_layers(step, s: int) -> int:
    """Decoder layers of stage s (all of them without a pipeline)."""
    if step.pplan.pp == 1:
        return step.model.dims.layers
    return len(step.stage_plan.decoder_layers(s))


def composed_shards(step, stage: int, held: tuple[float, float]) -> list[StateShard]:
    """Under pp > 1 with tp or ep, or ep beside tp: the non-expert decoder parameters of the
    stage / tp, ZeRO-partitioned over its dp x sp ranks of one TP coordinate; the stage's
    experts / ep over the ranks holding the same ones (one of each EP group of ep consecutive
    ranks of its dp x sp x tp: beside tp, Megatron's expert-data-parallel layout)."""
    p, m = step.pplan, step.model
    ranks = step.ranks_of(0, p.dp, stage)
    trained = "llm" not in m.frozen
    share = stage_layers(step, stage) / m.dims.layers  # the stage's part of the decoder
    experts = m.expert_params() * share if p.ep > 1 else 0.0
    dense = m.dims.layers * m.llm_layer_params() * share - experts  # split by tp
    cut = dense * (1 - 1 / p.tp) + vocab_cut(step, stage)
    rest = StateShard(held[0] - cut - experts, held[1] - (cut + experts) * trained,
                      p.seq_data_size, [ranks[t::p.tp] for t in range(p.tp)])
    if p.ep == 1:
        return [rest]
    holders = len(ranks) // p.ep  # ranks holding the same experts: one of each EP group
    return [rest, StateShard(experts / p.ep, experts / p.ep * trained, holders,
                             [ranks[e::p.ep] for e in range(p.ep)])]


def shard_link(step, shard: StateShard) -> comm.Link:
    """The slowest link of the shard's groups (they run at once)."""
    links = [comm.link_of(step.cluster, g) for g in shard.groups]
    return min(links, key=lambda link: link.bandwidth)


# ------------------------------------------------------------------------ tensor parallel
def tp_seconds(step, tokens: float, backward: bool) -> float:
    """Seconds of a TP group's all-reduces in one pass over `tokens` (each of its ranks holds
    all of them): 2 a layer forward, 2 backward (+2 recomputing under checkpointing)."""
    p, d = step.pplan, step.model.dims
    calls = 2 * d.layers * ((1 + step.plan.checkpointing) if backward else 1)
    nbytes = tokens * d.hidden * step.model.bytes_per_param
    link = comm.link_of(step.cluster, step.ranks_of(0, 1)[:p.tp])
    step.a2a_bytes["llm_tp"] += calls * 2 * (p.tp - 1) * nbytes  # a ring all-reduce moves 2 (p - 1) / p n a rank
    return calls * comm.all_reduce(nbytes, p.tp, link)


# AutoTP's column-parallel layers of HF's decoder families: q, k and v apart (LLaMA, Qwen,
# Mistral; Megatron fuses them into one)
ATTENTION_COLUMNS = 3


def backward_calls(step, layers: float, folded: float = 0.0) -> float:
    """All-reduces of a TP group in one backward over `layers` decoder layers (`folded` of them
    MoE layers under folded AutoEP): AutoTP's column-parallel layers (`LinearLayer`) each
    all-reduce their input gradient, q, k, v and the MLP's matrices but the last
    (`ATTENTION_COLUMNS + mlp_matrices - 1` a dense layer, the attention's + 1 a folded one)
    under `SimPlan.autotp_calls`; else fused ones, once for attention and once for the MLP."""
    if not step.plan.autotp_calls:
        return 2.0 * layers
    mlp = step.model.dims.mlp_matrices - 1
    return layers * (ATTENTION_COLUMNS + mlp) - folded * (mlp - 1)


def run_tp(step, rows, backward: bool, row_tokens: np.ndarray | None = None,
           hide: np.ndarray | None = None) -> None:
    """Each TP group of a row meets at its all-reduces (phase "llm_tp"); under sp each TP group
    (one per SP rank) holds the row's tokens / sp, in a per-sequence block / its data ranks. `row_tokens` [R]: the rows' tokens, if
    known (`step.RoundRows`)."""
    tp = step.pplan.tp
    if tp < 2 or not rows:
        return
    p, d = step.pplan, step.model.dims
    ranks = np.concatenate([r.ranks for r in rows])  # each row's sp TP groups, in rank order
    if row_tokens is None:
        row_tokens = np.array([step.samples.tokens[r.samples].sum() for r in rows])
    groups = np.array([len(r.ranks) // tp for r in rows])  # sp, or a per-sequence block's
    per_row = row_tokens.astype(np.float64) / groups
    tokens = np.repeat(per_row, groups)  # [G] a TP group's tokens (its SP rank's share)
    folded = p.ep > 1 and step.model.moe is not None  # folded AutoEP: no MLP all-reduce
    forward = 2 * d.layers - (step.model.moe.layers if folded else 0)
    calls = backward_calls(step, d.layers, step.model.moe.layers if folded else 0) + \
        step.plan.checkpointing * forward if backward else forward
    nbytes = tokens * d.hidden * step.model.bytes_per_param
    step.a2a_bytes["llm_tp"] += calls * 2 * (tp - 1) * float(nbytes.sum())  # as `tp_seconds`
    link = comm.links_each(step.cluster, ranks.reshape(-1, tp))
    seconds = calls * (comm.all_reduce_each(nbytes, tp, link) + step.cluster.a2a_call_s)  # [G]
    if folded:
        seconds = seconds + fold_seconds(step, tokens, link, backward)
    if hide is not None:  # `SimPlan.overlap_tp`: [W] the pass's compute hides them
        seconds = np.maximum(0.0, seconds - hide[ranks].reshape(-1, tp).min(axis=1))
    gid = np.arange(ranks.size) // tp
    step.timeline.sync(ranks, gid, "llm_tp", seconds[gid])


def fold_seconds(step, tokens: np.ndarray, link, backward: bool) -> np.ndarray:
    """[G] seconds of a TP group's collectives in folded AutoEP's MoE layers (ep beside tp,
    `deepspeed.moe.ep_tp_dispatch`) in a pass over `tokens` [G] (a TP rank's), where a dense
    layer's MLP all-reduces: forward, the restore's 4 all-gathers of a rank's tokens x top-k /
    tp assignments over TP (outputs, token indices, top-k slots, weights), each after one of
    its row counts; backward, an all-reduce per TP rank of the outputs' and of the weights'
    gradient rows, and the router's gradient (E x h) all-reduced over TP (the input gradient's
    average over TP stands for the MLP's all-reduce), plus the forward's again where
    recomputed. bf16 rows as everywhere (int64 indices)."""
    m, tp = step.model, step.pplan.tp
    h, k = m.dims.hidden, m.moe.top_k
    rows = tokens * k / tp  # [G] a rank's assignments (the gathers pad to the largest: even)

    def gather(nbytes):  # a ring all-gather of `nbytes` a rank
        return (tp - 1) * (link.latency + nbytes / link.bandwidth)
    fwd = 4 * gather(8.0) + gather(rows * h * 2) + 2 * gather(rows * 8) + gather(rows * 2)
    out = fwd * (step.plan.checkpointing if backward else 1)
    if backward:
        out = out + tp * (comm.all_reduce_each(rows * h * 2, tp, link)
                          + comm.all_reduce_each(rows * 2, tp, link)) + \
            comm.all_reduce_each(np.full(rows.shape, m.moe.experts * h * m.bytes_per_param),
                                 tp, link)
    return m.moe.layers * np.where(tokens > 0, out, 0.0)


def _sync(step, groups: list, seconds: list, phase: str) -> None:
    ranks = np.concatenate(groups)
    gid = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    step.timeline.sync(ranks, gid, phase, np.asarray(seconds)[gid])


def run_tp_gather(step, work) -> None:
    """The round's all-gathers of embedding rows over TP (`GatherTPRows`: one uneven
    all-to-all a row with items, forward only; phase "tp_gather"), priced by `comm`."""
    if not work.tp_gathers:
        return
    if "tp_gather" not in work.memo:  # the placement's alone: plans sharing it share these
        src, dst, nbytes = (np.array(x, dtype=np.float64) for x in zip(*work.tp_gathers))
        per_rank = comm.all_to_all_pairs(src.astype(np.int64), dst.astype(np.int64), nbytes,
                                         step.cluster)
        work.memo["tp_gather"] = (float(nbytes.sum()),
                                  [float(per_rank[g].max()) for g in work.tp_groups])
    moved, seconds = work.memo["tp_gather"]
    step.a2a_bytes["tp_gather"] += moved
    _sync(step, work.tp_groups, seconds, "tp_gather")


def run_tp_encoder_grads(step) -> None:
    """Under `tp_encodes_apart`: every micro-batch, every TP group all-reduces (sums) its
    trainable encoder and projector gradients (`encoder_grads_seconds`; every rank runs every
    encoder, dummies included). Phase "encode_tp"."""
    m, tp = step.model, step.pplan.tp
    nbytes = sum(m.encoder_params(n) for n in m.dims.encoders if n not in m.frozen) * \
        m.bytes_per_param
    if not nbytes:
        return
    groups = list(step.llm_ranks().reshape(-1, tp))
    link = comm.link_of(step.cluster, groups[0])
    step.a2a_bytes["encoder_tp_grads"] += len(groups) * tp * 2 * (tp - 1) / tp * nbytes
    _sync(step, groups, [encoder_grads_seconds(step, nbytes, link)] * len(groups), "encode_tp")


def encoder_grads_seconds(step, nbytes: float, link) -> float:
    """Seconds of a TP group's sum of `nbytes` of encoder gradients: under `SimPlan.autotp_calls`
    one all-reduce a trainable parameter tensor (`tp_encoders.sum_grads_over_tp` hooks each;
    `ModelSpec.encoder_tensors`), the bytes split over them, else one call; each call pays the
    collective's latencies and `Cluster.a2a_call_s`."""
    m = step.model
    calls = sum(m.encoder_tensors(n) for n in m.dims.encoders if n not in m.frozen) \
        if step.plan.autotp_calls else 1
    one = comm.all_reduce(nbytes / calls, step.pplan.tp, link)
    return calls * (one + step.cluster.a2a_call_s)


# ------------------------------------------------------------------------ expert parallel
def ep_groups(step) -> np.ndarray:
    """[dp / ep, ep] the expert-parallel groups' ranks (sp = tp = pp = 1: rank = dp rank)."""
    return np.arange(step.pplan.world_size).reshape(-1, step.pplan.ep)


def ep_balance(step, llm: np.ndarray, tokens: np.ndarray,
               routed: np.ndarray | None = None) -> np.ndarray:
    """[W] LLM FLOPs of each rank with its tokens' expert FLOPs spread evenly over its EP group
    (the experts of a group serve all its tokens), as AutoEP's layers run them
    (`autoep_flops`); `routed`: the tokens each rank routes (default `tokens`)."""
    if step.pplan.ep < 2:
        return llm
    return autoep_flops(step, llm, tokens, tokens if routed is None else routed)


def autoep_flops(step, llm: np.ndarray, dispatched: np.ndarray,
                 routed: np.ndarray) -> np.ndarray:
    """[..., W] the LLM FLOPs `llm` of a pass's ranks (W: EP groups of ep consecutive ranks)
    with the expert FLOPs of the tokens each dispatches (`dispatched`) spread evenly over its
    group, at n / (n + `Cluster.expert_half_tokens`) of the rate (n: an expert's tokens of the
    pass), plus `Cluster.moe_token_flops` a token-expert assignment of the tokens each rank
    routes (`routed`: beside tp, folded AutoEP routes the row's all on every TP rank)."""
    m, c, ep = step.model, step.cluster, step.pplan.ep
    experts = dispatched * m.expert_flops_per_token()
    grouped = dispatched.shape[:-1] + (dispatched.shape[-1] // ep, ep)  # [..., W / ep, ep]
    shared = experts.reshape(grouped).mean(axis=-1, keepdims=True)
    if c.expert_half_tokens:
        n = dispatched.reshape(grouped).sum(axis=-1, keepdims=True) * m.moe.top_k / \
            m.moe.experts  # an expert's tokens of the pass
        shared = shared * (1 + c.expert_half_tokens / np.maximum(n, 1e-9))
    spread = np.broadcast_to(shared, grouped).reshape(dispatched.shape)
    return llm - experts + spread + routed * m.moe.top_k * m.moe.layers * c.moe_token_flops


def ep_seconds(step, tokens: float, backward: bool) -> float:
    """Seconds of one rank's MoE all-to-alls in a pass over `tokens` of its tokens: per MoE
    layer dispatch and combine, tokens x top-k x h bf16 each, split evenly over the ep ranks."""
    m, p = step.model, step.pplan
    calls = 2 * m.moe.layers * ((1 + step.plan.checkpointing) if backward else 1)
    nbytes = tokens * m.moe.top_k * m.dims.hidden * 2
    link = comm.link_of(step.cluster, ep_groups(step)[0])
    if nbytes <= 0:
        return 0.0
    return calls * comm.even_all_to_all(nbytes, p.ep, link) + \
        split_exchange(step, m.moe.layers, backward, link)


COUNT_BYTES = 4  # AutoEP's per-expert token counts are int32


def split_exchange(step, moe_layers: float, backward: bool, link) -> float:
    """Seconds of AutoEP's split-size exchange in a pass of `moe_layers` MoE layers: before each
    layer's dispatch (forward, and the recompute's under checkpointing) the EP group
    all-to-alls its per-expert token counts (E int32 a rank, `compute_split_plan`) to size the
    uneven all-to-alls: one more latency-bound all-to-all a layer."""
    calls = moe_layers * (int(step.plan.checkpointing) if backward else 1)
    return calls * comm.even_all_to_all(step.model.moe.experts * COUNT_BYTES, step.pplan.ep, link)


def run_ep(step, tokens: np.ndarray, backward: bool) -> None:
    """Each EP group meets at its all-to-alls; a group waits for its busiest rank's tokens
    (phase "llm_ep")."""
    if step.pplan.ep < 2:
        return
    m, p = step.model, step.pplan
    groups = ep_groups(step)
    busiest = tokens[groups].max(axis=1)  # [dp / ep]
    seconds = np.array([ep_seconds(step, float(t), backward) for t in busiest])
    calls = 2 * m.moe.layers * ((1 + step.plan.checkpointing) if backward else 1)
    step.a2a_bytes["llm_experts"] += float(
        tokens.sum()) * calls * m.moe.top_k * m.dims.hidden * 2 * (p.ep - 1) / p.ep
    gid = np.repeat(np.arange(len(groups)), p.ep)
    step.timeline.sync(groups.ravel(), gid, "llm_ep", seconds[gid])
