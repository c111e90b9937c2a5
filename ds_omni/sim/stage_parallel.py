"""Tensor and expert parallelism inside pipeline stages, and experts beside tensor parallelism:
the composed backbone (issue 37) on simulated ranks.

Under pp the 1F1B schedule (`pipeline_sim`) runs one column per rank of a stage (dp x sp x tp):
a TP rank runs 1/tp of its stage's decoder FLOPs and after each micro-batch's pass all-reduces
the activations twice a layer of its stage (forward; backward twice more, and the recompute's
under checkpointing) on the stage's critical path; the encoders of stage 0 run as without pp (each
TP rank repeats its SP rank's items, or under `tp_encodes_apart` encodes 1/tp of them and sums the
encoder gradients over TP). EP: an MoE layer's two all-to-alls each way over groups of ep
consecutive ranks of a stage (dp x sp x tp: beside tp the experts are spread over dp x tp,
Megatron's expert-data-parallel layout), each TP rank dispatching its 1/tp of the row's tokens,
uniform routing, a group waiting for its busiest member. States: the non-expert decoder
parameters / tp, ZeRO-partitioned over the stage's dp x sp ranks of one TP coordinate; the
stage's experts / ep over the ranks holding the same ones. More: docs/simulator.md.
"""

from __future__ import annotations

import numpy as np

from ds_omni.sim import comm
from ds_omni.sim.model_parallel import (autoep_flops, backward_calls, encoder_grads_seconds,
                                         split_exchange)
from ds_omni.sim.model_parallel import stage_layers as layers_of
from ds_omni.sim.timeline import COMM


# ----------------------------------------------------------------------------- the schedule
def per_rank(step, llm: np.ndarray, tokens: np.ndarray, enc: np.ndarray):
    """[M, D] per pipeline (an SP rank's share) -> [M, D tp] per rank of a stage: LLM FLOPs
    / tp with the experts' spread over each EP group, tokens (every TP rank holds its SP rank's),
    encoder FLOPs (/ tp where the TP ranks encode apart)."""
    p = step.pplan
    tp = p.tp
    llm, tokens, enc = (np.repeat(x, tp, axis=1) for x in (llm, tokens, enc))
    llm = llm / tp
    if step.tp_apart:
        enc = enc / tp
    if p.ep > 1:  # [M, D tp]: each TP rank dispatches 1/tp of the tokens it routes
        llm = autoep_flops(step, llm, tokens / tp, tokens)
    return llm, tokens, enc


def stage_collectives(step, ranks: np.ndarray, s: int, tokens: np.ndarray, backward: bool,
                      compute=0.0, tp=None):
    """After a micro-batch's pass through stage s (`ranks` [D tp], `tokens` [D tp] a rank's,
    `compute` its seconds): its TP all-reduces (`tp`: their seconds and bytes, from
    `tp_stage_seconds`; less `compute` under `SimPlan.overlap_tp`), its EP all-to-alls.
    Returns the last events' ids, or None."""
    last = None
    if step.pplan.tp > 1:
        seconds, moved = tp
        step.a2a_bytes["llm_tp"] += moved
        if step.plan.overlap_tp:
            seconds = np.maximum(0.0, seconds - compute)
        last = step.timeline.run(ranks, "llm_tp", seconds, COMM)
    if step.pplan.ep > 1 and step.model.moe is not None:
        last = ep_stage_sync(step, ranks, s, tokens / step.pplan.tp, backward)
    if backward and s == 0 and step.tp_apart and step.plan.encoder_placement == "stage0":
        last = encoder_grads(step, ranks)
    return last


def tp_stage_seconds(step, s: int, tokens: np.ndarray, backward: bool, share: float = 1.0):
    """([M, n] seconds of a TP group's all-reduces in one pass of `share` of stage s's layers
    (a model chunk's under the interleaved schedule) over each row of `tokens` [M, n], [M] the
    bytes each pass moves)."""
    p, d = step.pplan, step.model.dims
    layers = layers_of(step, s) * share
    calls = 2 * layers * step.plan.checkpointing + backward_calls(step, layers) if backward \
        else 2 * layers
    nbytes = tokens * d.hidden * step.model.bytes_per_param
    moved = [calls * 2 * (p.tp - 1) / p.tp * float(row.sum()) for row in nbytes]
    link = comm.link_of(step.cluster, step.ranks_of(0, 1)[:p.tp])
    return calls * (comm.all_reduce_each(nbytes, p.tp, link) + step.cluster.a2a_call_s), moved


def ep_groups_of(ranks: np.ndarray, ep: int) -> np.ndarray:
    """[n / ep, ep] a stage's EP groups: ep consecutive ranks of its dp x sp x tp."""
    return np.asarray(ranks).reshape(-1, ep)


def ep_stage_sync(step, ranks: np.ndarray, s: int, tokens: np.ndarray, backward: bool):
    """Each EP group of stage s meets at its MoE layers' all-to-alls (dispatch and combine,
    tokens x top-k x h bf16 a rank), sized by its busiest member's `tokens` [n]."""
    m, p = step.model, step.pplan
    moe_layers = m.moe.layers * layers_of(step, s) / m.dims.layers
    calls = 2 * moe_layers * ((1 + step.plan.checkpointing) if backward else 1)
    groups = ep_groups_of(ranks, p.ep)
    busiest = tokens.reshape(-1, p.ep).max(axis=1)  # [n / ep]
    per_rank = busiest * m.moe.top_k * m.dims.hidden * 2
    link = comm.links_each(step.cluster, groups)
    seconds = calls * comm.even_all_to_all_each(per_rank, p.ep, link)
    seconds = np.where(per_rank > 0, seconds + split_exchange(step, moe_layers, backward, link),
                       0.0)
    step.a2a_bytes["llm_experts"] += float(tokens.sum()) * calls * m.moe.top_k * \
        m.dims.hidden * 2 * (p.ep - 1) / p.ep
    gid = np.repeat(np.arange(len(groups)), p.ep)
    return step.timeline.sync(groups.ravel(), gid, "llm_ep", seconds[gid])


def encoder_grads(step, ranks: np.ndarray):
    """Under `tp_encodes_apart` on stage 0: the TP ranks sum their trainable encoder and
    projector gradients each micro-batch (`encoder_grads_seconds`)."""
    m, tp = step.model, step.pplan.tp
    nbytes = sum(m.encoder_params(n) for n in m.dims.encoders if n not in m.frozen) * \
        m.bytes_per_param
    if not nbytes:
        return None
    link = comm.link_of(step.cluster, ranks[:tp])
    step.a2a_bytes["encoder_tp_grads"] += len(ranks) * 2 * (tp - 1) / tp * nbytes
    gid = np.arange(len(ranks)) // tp
    return step.timeline.sync(ranks, gid, "encode_tp", encoder_grads_seconds(step, nbytes, link))
