"""Bounds for the plan search (`sim/search.py`): what a plan's step cannot beat, computed
without simulating it, and its model states (exact).

Every rank's clock is at least its compute plus its communication, a collective's members
wait for the last, and every rank ends with the step's gradient synchronisation; so:
- `lower_bound` (no planning): the mean over all GPUs of compute and of the bandwidth part of
  tp / ep / Ulysses traffic, plus the synchronisation;
- `refined_bound` (the loader's assignment, shared with the simulation): per data-parallel
  rank, its own micro-batches' LLM work (and its encoder work where it cannot leave its group)
  and traffic, the busiest rank's (under ZeRO-2/3 each round's busiest: the round's
  collectives make all ranks wait); under a pipeline, per stage its own work after the first
  micro-batch's forward through the stages before it. Latencies, ZeRO's per-round
  collectives, dummy passes, resharding and long-sequence rounds count as 0, so neither bound
  exceeds the simulated step time.
"""

from __future__ import annotations

import numpy as np

from ds_omni.errors import DsOmniError
from ds_omni.sim import comm, memory, model_parallel, pipeline_sim
from ds_omni.sim.cluster import Cluster
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import Step, grad_sync_seconds
from ds_omni.sim.workload import Samples

GIB = 2 ** 30


class Shell:
    """What the simulator's state and gradient-sync arithmetic reads of a step, without the
    loader's planning (`Step.ranks_of` is borrowed: it reads the plan only)."""

    ranks_of = Step.ranks_of

    def __init__(self, cluster: Cluster, model: ModelSpec, samples: Samples, plan: SimPlan,
                 stage_plans: dict | None = None, pplans: dict | None = None):
        self.cluster, self.model, self.samples, self.plan = cluster, model, samples, plan
        self.pplan = resolved_plan(plan, cluster.gpus, pplans)
        if plan.pp > 1:  # the stage boundaries, shared by plans that give the same ones
            key = (plan.pp, self.pplan.dp, plan.micro_batches, plan.encoder_placement,
                   plan.stage_split)
            stage_plans = {} if stage_plans is None else stage_plans
            if key not in stage_plans:
                stage_plans[key] = pipeline_sim.stage_plan(self)
            self.stage_plan = stage_plans[key]


def resolved_plan(plan: SimPlan, gpus: int, pplans: dict | None = None):
    """`plan.parallel_plan(gpus)` (or the error it raises), kept in `pplans` for the plans
    that differ only in what it does not read (ZeRO stage, checkpointing): a search resolves
    thousands, most of them refused by the same rule."""
    if pplans is None:
        return plan.parallel_plan(gpus)
    key = plan.resolution_key()
    if key not in pplans:
        try:
            pplans[key] = plan.parallel_plan(gpus)
        except DsOmniError as e:
            pplans[key] = e
    if isinstance(pplans[key], DsOmniError):
        raise pplans[key]
    return pplans[key]


def states_bytes(shell: Shell) -> tuple[float, str]:
    """(the fullest rank's model-state bytes, their breakdown in words)."""
    m, p, zero = shell.model, shell.pplan, shell.plan.zero_stage
    worst, words = 0.0, ""
    for s in range(p.pp):
        kinds = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
        for shard in model_parallel.state_shards(shell, s, pipeline_sim.held_params(shell, s)):
            st = memory.model_states(shard.params, shard.trainable, shard.group_size, zero,
                                     m.bytes_per_param)
            for k, v in st.as_dict().items():
                kinds[k] += v
        kinds["gathered"] = memory.gathered_bytes(m.llm_layer_params(p.tp, p.ep), zero,
                                                  m.bytes_per_param)
        total = sum(kinds.values())
        if total > worst:
            worst = total
            words = ", ".join(f"{k} {v / GIB:.1f}" for k, v in kinds.items())
    return worst, words


def lower_bound(shell: Shell, totals: dict) -> float:
    """Seconds the step cannot beat: every rank's clock is at least its compute plus its
    communication, so the step is at least their mean over ranks, plus the end-of-step
    synchronisation every rank waits for. Compute: the LLM's FLOPs (one forward more under
    checkpointing) and the encoders' over all GPUs (x tp unless the TP ranks encode apart:
    under tp x sp or the pool every TP rank repeats its SP rank's / pool's items);
    communication: only the bandwidth part of tp's all-reduces, ep's and Ulysses' all-to-alls
    (a ring all-reduce moves 2 (p - 1) / p of its buffer a rank); ZeRO's per-round collectives,
    the TP row gathers and encoder-gradient sums, and all latencies count as 0. Budget mode may
    defer samples: no bound (0)."""
    c, m, plan, p = shell.cluster, shell.model, shell.plan, shell.pplan
    if plan.reorder == "budget":
        return 0.0
    w, d, ckpt = c.gpus, m.dims, plan.checkpointing
    flops = totals["llm"] * (3 + ckpt) / 3 + totals["encoders"] * (1 if tp_apart(shell) else p.tp)
    seconds = flops / w / c.flops_per_s
    tokens = totals["tokens"]
    if p.tp > 1:  # a rank holds its row's tokens (/ sp): total / (dp sp) a rank on average,
        # in the layers of its stage (1 / pp of them on average)
        link = comm.link_of(c, shell.ranks_of(0, 1)[:p.tp])
        calls = (2 * d.layers * (1 + 1 + ckpt) - _folded(shell) * (1 + ckpt)) / p.pp
        seconds += calls * 2 * (p.tp - 1) / p.tp * tokens / p.seq_data_size * d.hidden * 2 / \
            link.bandwidth / p.pp  # under pp a rank's stage runs L / pp layers on average
    if p.ep > 1:
        link = comm.link_of(c, range(p.ep))
        calls = 2 * m.moe.layers * (1 + 1 + ckpt)
        seconds += calls * (p.ep - 1) / p.ep * tokens / w * m.moe.top_k * d.hidden * 2 / \
            link.bandwidth
    u = plan.sp  # Ulysses' degree: a ring's (cp) steps may all hide behind attention
    if u > 1:  # under tp: tokens / (dp sp cp) a rank, heads / tp: tokens / W
        link = comm.link_of(c, shell.ranks_of(0, 1)[::p.tp][:u])
        seconds += d.layers * (1 + 1 + ckpt) * (u - 1) / u * tokens / w * \
            (2 * d.hidden + 2 * m.kv) * 2 / link.bandwidth
    if p.pp == 1:  # under pp only stage 0's ranks sum them (0: a bound still)
        seconds += plan.micro_batches * tp_grads_seconds(shell)
    return seconds + min(grad_sync_seconds(shell, s) for s in range(p.pp))


def tp_grads_seconds(shell) -> float:
    """Under `tp_apart`, the bandwidth part of a micro-batch's encoder-gradient all-reduce over
    TP (every rank, every round): 2 (tp - 1) / tp of the bf16 gradients, no more than the ring
    or the tree the step charges."""
    if not tp_apart(shell):
        return 0.0
    m, tp = shell.model, shell.pplan.tp
    nbytes = sum(m.encoder_params(n) for n in m.dims.encoders if n not in m.frozen) * \
        m.bytes_per_param
    bw = comm.link_of(shell.cluster, shell.ranks_of(0, 1)[:tp]).bandwidth
    return 2 * (tp - 1) / tp * nbytes / bw


def tp_apart(shell) -> bool:
    """The TP ranks of a row encode different items (`ParallelPlan.tp_encodes_apart`)."""
    return shell.plan.tp_apart(shell.pplan)


def totals_of(model: ModelSpec, samples: Samples) -> dict:
    """The samples' LLM and encoder FLOPs and tokens, in all and per sample [N]."""
    terms = model.cost.term_costs(samples.tokens, samples.item_sample, samples.item_encoder,
                                  samples.item_len)  # [N, T]
    per = {"llm": terms[:, :2].sum(axis=1), "enc": terms[:, 2:].sum(axis=1),
           "tokens": samples.tokens.astype(np.float64), "cost": terms.sum(axis=1)}
    return {"llm": float(per["llm"].sum()), "encoders": float(per["enc"].sum()),
            "tokens": float(per["tokens"].sum()), "per_sample": per}


def refined_bound(shell: Shell, assignment, totals: dict) -> float:
    """The bound from the loader's assignment (see the module's docstring); at least
    `lower_bound`'s. `totals["memo"]` keeps each assignment's per-micro-batch sums."""
    c, m, plan, p = shell.cluster, shell.model, shell.plan, shell.pplan
    coarse = lower_bound(shell, totals)
    if plan.reorder == "budget":
        return coarse
    memo = totals.setdefault("memo", {})
    if id(assignment) not in memo:  # plans of one data-parallel shape share it
        memo[id(assignment)] = (assignment, _micro_arrays(assignment, totals["per_sample"],
                                                          plan.micro_batches))
    llm, enc, tok = memo[id(assignment)][1]  # [D, M] each
    rate, f = c.flops_per_s, (3 + plan.checkpointing) / 3
    if p.ep > 1:  # a rank's experts' share of the FLOPs may move within its EP group
        llm = llm - tok * m.expert_flops_per_token()
    sync = min(grad_sync_seconds(shell, s) for s in range(p.pp))
    if p.pp > 1:
        return max(coarse, _pipeline_bound(shell, llm, enc) + sync)
    inner = p.reader_group_size
    # a member's encoder work: its SP rank's share, or under tp alone its TP rank's (a mean
    # over the TP ranks, no more than the busiest's)
    own_enc = 0.0 if plan.encoder_mode == "pool" else enc / (p.tp if tp_apart(shell) else p.sp)
    v = (llm * f / inner + own_enc) / rate + _traffic(shell, tok) + tp_grads_seconds(shell)
    per_round = v.max(axis=0).sum() if plan.zero_stage >= 2 else v.sum(axis=1).max()
    return max(coarse, float(per_round) + sync)


def _micro_arrays(assignment, per_sample: dict, micro: int):
    """[D, M] LLM FLOPs, encoder FLOPs and tokens of each data-parallel rank's micro-batches
    (one weighted bincount over all cells: a sum per cell was most of a bound's time)."""
    rounds = assignment.rounds
    cells, picks = [], []
    for d, rs in enumerate(rounds):
        for k in range(micro):
            r = rs[k]
            if r.block is None and r.samples.size:
                cells.append(d * micro + k)
                picks.append(r.samples)
    size = len(rounds) * micro
    if not picks:
        return [np.zeros((len(rounds), micro)) for _ in range(3)]
    idx = np.concatenate(picks)  # [n] the cells' samples
    cell = np.repeat(np.asarray(cells), [p.size for p in picks])  # [n] each one's cell
    return [np.bincount(cell, weights=per_sample[key][idx], minlength=size).reshape(
        len(rounds), micro) for key in ("llm", "enc", "tokens")]


def _folded(shell: Shell) -> int:
    """MoE layers whose forward all-reduce over TP folded AutoEP replaces by its gathers (ep
    beside tp, `model_parallel.fold_seconds`: their bandwidth counts as 0 here)."""
    m = shell.model
    return m.moe.layers if shell.pplan.ep > 1 and shell.pplan.tp > 1 and m.moe else 0


def _traffic(shell: Shell, tokens: np.ndarray) -> np.ndarray:
    """Seconds of a member's tp / ep / Ulysses bandwidth for rows of `tokens` (any shape)."""
    c, m, plan, p = shell.cluster, shell.model, shell.plan, shell.pplan
    d, ckpt, out = m.dims, plan.checkpointing, np.zeros_like(tokens)
    if p.tp > 1:  # a TP group holds the row's tokens / sp
        bw = comm.link_of(c, shell.ranks_of(0, 1)[:p.tp]).bandwidth
        out = out + (2 * d.layers * (2 + ckpt) - _folded(shell) * (1 + ckpt)) * 2 * \
            (p.tp - 1) / p.tp * tokens / p.sp * d.hidden * 2 / bw
    if p.ep > 1:
        bw = comm.link_of(c, range(p.ep)).bandwidth
        out = out + 2 * m.moe.layers * (2 + ckpt) * (p.ep - 1) / p.ep * tokens * m.moe.top_k * \
            d.hidden * 2 / bw
    u = plan.sp  # each TP rank's Ulysses group, heads / tp (the ring's time may hide)
    if u > 1:
        bw = comm.link_of(c, shell.ranks_of(0, 1)[::p.tp][:u]).bandwidth
        out = out + d.layers * (2 + ckpt) * (u - 1) / u * tokens / p.sp * \
            (2 * d.hidden + 2 * m.kv) * 2 / p.tp / bw
    return out


def _pipeline_bound(shell: Shell, llm: np.ndarray, enc: np.ndarray) -> float:
    """1F1B: stage s cannot start before micro-batch 0's forward has run through the stages
    before it, and then runs all its own work: max over pipelines and stages (stage 0's items
    its own but under the pool, which may move them: none counted)."""
    p, plan, rate = shell.pplan, shell.plan, shell.cluster.flops_per_s
    times = np.asarray(shell.stage_plan.layer_time)
    frac = times / times.sum()  # [P]
    f = (3 + plan.checkpointing) / 3
    inner = p.reader_group_size  # a row's sp x tp ranks split its LLM FLOPs (not its items)
    total = llm.sum(axis=1) / inner  # [D] a member's LLM FLOPs of the step
    best = 0.0
    for s in range(p.pp):
        fill = llm[:, 0] / inner * frac[:s].sum() / 3  # [D]
        own = total * frac[s] * f + (enc.sum(axis=1) / (p.tp if tp_apart(shell) else p.sp)
                                     if s == 0 and plan.encoder_mode != "pool" and
                                     plan.encoder_placement == "stage0" else 0.0)
        best = max(best, float(((fill + own) / rate).max()))
    return best
