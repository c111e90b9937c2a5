"""Encoders on their own GPUs (DistTrain-style disaggregation): `plan.encoder_gpus` ranks after
the LLM's encode every item of the step, placed by cost (LPT, `parallelize.joint.assign_items`),
while the LLM's ranks run the LLM alone; the embeddings travel to the LLM's ranks (and their
gradients back) between nodes. Encoding for step k + 1 overlaps the LLM of step k, so a step
takes the longer of the two pools plus the transfers; both meet at the step's end.
"""

from __future__ import annotations

import numpy as np

from ds_omni.parallelize.joint import assign_items
from ds_omni.sim import comm
from ds_omni.sim.timeline import COMM


def run_separate(step) -> None:
    c, m, plan, tl = step.cluster, step.model, step.plan, step.timeline
    world = step.pplan.world_size
    enc_ranks = np.arange(world, c.gpus)
    ids = np.flatnonzero(np.isin(step.samples.item_sample, step.assignment.planned))
    owner = np.asarray(assign_items(step.item_cost[ids].tolist(), len(enc_ranks)), dtype=np.int64)
    load = np.bincount(owner, weights=step.item_cost[ids], minlength=len(enc_ranks))
    positions = np.bincount(owner, weights=step.samples.item_len[ids], minlength=len(enc_ranks))
    tl.run(enc_ranks, "encode_fwd", load * step.encoder_fwd / step.rate)
    tl.run(enc_ranks, "encode_bwd", load * (1 - step.encoder_fwd) / step.rate)
    trained = sum(m.encoder_params(n) for n in m.dims.encoders if n not in m.frozen)
    link = comm.link_of(c, enc_ranks)
    tl.sync(enc_ranks, np.zeros(len(enc_ranks)), "grad_sync",
            comm.all_reduce(trained * m.bytes_per_param, len(enc_ranks), link))
    _transfer(step, ids)
    step.act_peak[enc_ranks] = positions * max(
        (m.encoder_activation_bytes(n, plan.checkpointing) for n in m.dims.encoders), default=0)


def _transfer(step, ids: np.ndarray) -> None:
    """Each LLM rank receives its rows' embeddings and sends their gradients back: 2 x rows x
    hidden x 2 bytes over the inter-node link (the pools sit on different nodes)."""
    p, s = step.pplan, step.samples
    rows = np.zeros(p.world_size)
    for d, rounds in enumerate(step.assignment.rounds):
        got = sum(int(s.item_rows[step.layout.items_of[n]].sum())
                  for r in rounds for n in r.samples.tolist())
        stage0 = step.ranks_of(d, 1, 0)
        rows[stage0] += got / len(stage0)
    nbytes = 2 * rows * step.model.dims.hidden * 2
    link = comm.Link(step.cluster.inter_latency, step.cluster.inter_bw)
    step.a2a_bytes["reshard"] += float(nbytes.sum())
    step.timeline.run(np.arange(p.world_size), "embed_transfer",
                      [comm.p2p(b, link) for b in nbytes], COMM)


def encoder_states_params(step) -> tuple[float, float]:
    m = step.model
    total = sum(m.encoder_params(n) for n in m.dims.encoders)
    return total, sum(m.encoder_params(n) for n in m.dims.encoders if n not in m.frozen)
