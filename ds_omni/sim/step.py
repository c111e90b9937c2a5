"""simulate(cluster, model, workload, plan) -> StepReport: one training step on simulated ranks.

1. The workload's global batch is drawn (seeded) and priced by the loader's cost model.
2. The loader's planning runs per reorder group (`loader_sim`).
3. Without a pipeline, the step is a series of rounds; in each every rank encodes what the encoder
   planners give it (`encode_sim`), embeddings are resharded, the LLM runs forward and backward
   (Ulysses all-to-alls under SP), and under ZeRO-2/3 the ranks meet at the round's collectives.
   With a pipeline, 1F1B over the stages (`pipeline_sim`). Then gradient sync and optimizer.
4. Every phase is an event on a per-rank timeline (`timeline`): step time, critical path, per-rank
   compute / communication / idle, MFU, memory (`memory`), bytes moved.
Compute time is FLOPs / (peak x achievable); forward 1/3 of training FLOPs, backward 2/3, one
forward more under checkpointing. More: docs/simulator.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ds_omni.errors import DataError, ModelError
from ds_omni.parallelize.embedding import encoder_dummies_needed
from ds_omni.sim import comm, gpus, memory, model_parallel, pipeline_sim, ring_sim
from ds_omni.sim.cluster import Cluster
from ds_omni.sim.encode_sim import Row, over_tp, reshard_seconds, round_work, step_costs
from ds_omni.sim.loader_sim import plan_step
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.pool_sim import plan_pool, pool_calls, pool_folded, pool_long
from ds_omni.sim.pool_sim import rows_of as pool_rows_of
from ds_omni.sim.report import StepReport, build_report
from ds_omni.sim.separate import run_separate
from ds_omni.sim.timeline import Timeline
from ds_omni.sim.workload import Samples, WorkloadSpec

PHASES = ("encode_fwd", "encode_sp", "tp_gather", "reshard", "llm_fwd", "llm_sp", "llm_tp",
          "llm_ep", "llm_bwd", "encode_bwd", "encode_tp", "zero", "grad_sync")


class Step:
    """The pieces of one simulated step that every part reads (no process group)."""

    def __init__(self, cluster: Cluster, model: ModelSpec, samples: Samples, plan: SimPlan,
                 cache: dict | None = None):
        self.cluster, self.model, self.samples, self.plan = cluster, model, samples, plan
        self.pplan = plan.parallel_plan(cluster.gpus)
        plan.check_model(model)
        self.rate = cluster.flops_per_s
        self.llm_rate = gpus.cluster_llm_rate(cluster, model, self.pplan.tp,
                                              float(samples.tokens.mean()), plan.tp_splits_norms,
                                              plan.gemm_rows)
        # [N] samples' costs, [M] items', [N] the LLM's, the rows' layout (read-only, shared)
        self.sample_cost, self.item_cost, self.llm_cost, self.layout = step_costs(model, samples,
                                                                                  cache)
        self.encoder_fwd = 1.0 if all(e.frozen for e in model.dims.encoders.values()) else 1 / 3
        self.heads = {n: model.heads(n) for n in model.dims.encoders}
        self.timeline = Timeline(cluster.gpus, PHASES)
        # the TP ranks of a row encode different items (`ParallelPlan.tp_encodes_apart`)
        self.tp_apart = plan.tp_apart(self.pplan)
        # training's rule: under ZeRO-2/3 (and bf16 ZeRO-0) every rank runs every encoder, and
        # where the TP ranks sum encoder gradients (their hooks are collectives)
        self.dummies = self.tp_apart or encoder_dummies_needed(
            {"zero_optimization": {"stage": plan.zero_stage}, "bf16": {"enabled": True}},
            plan.pp > 1)
        self.act_peak = np.zeros(cluster.gpus)  # [W] activation bytes at the busiest round
        # [W] seconds of each rank's first LLM forward and last LLM backward (what
        # `SimPlan.overlap_grad_sync` hides the end of step's collectives behind)
        self.first_fwd, self.last_bwd = np.full(cluster.gpus, np.nan), np.zeros(cluster.gpus)
        self.a2a_bytes = {"reshard": 0.0, "pool_inputs": 0.0, "llm_ulysses": 0.0,
                          "encoder_ulysses": 0.0, "llm_tp": 0.0, "llm_experts": 0.0,
                          "tp_gather": 0.0, "encoder_tp_grads": 0.0}
        self.cache = cache
        self.assignment = loader_plan(self.sample_cost, samples.tokens, self.pplan, plan, cache)

    def llm_ranks(self) -> np.ndarray:
        return np.arange(self.pplan.world_size)

    def ranks_of(self, dp_lo: int, dp_n: int, stage: int = 0) -> np.ndarray:
        """Global ranks of data-parallel ranks [dp_lo, dp_lo + dp_n) of `stage`, all SP (and TP)
        ranks."""
        inner, dp = self.pplan.reader_group_size, self.pplan.dp
        base = stage * dp * inner
        return np.arange(base + dp_lo * inner, base + (dp_lo + dp_n) * inner)


def loader_plan(sample_cost: np.ndarray, tokens: np.ndarray, pplan, plan: SimPlan,
                cache: dict | None = None):
    """The loader's planning of the step (`plan_step`), kept in `cache` (if given) for plans of
    the same data-parallel shape (a search's plans on the same samples)."""
    key = (pplan.dp, pplan.reorder_group, plan.micro_batches, plan.reorder, plan.pack_tokens,
           pplan.max_sequence_sp)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = plan_step(sample_cost, tokens, *key)
    return cache[key]


def simulate(cluster: Cluster, model: ModelSpec, workload: WorkloadSpec | Samples,
             plan: SimPlan, seed: int = 0, cache: dict | None = None) -> StepReport:
    """One step of `plan` on `cluster` for `model` and a global batch of `workload` (a spec
    drawn with `seed`, or given samples: the same samples for every plan compared). `cache`: a
    dict shared by plans simulated on the same samples (the loader's planning is kept there)."""
    check_fits_somewhere(cluster, model)
    samples = workload if isinstance(workload, Samples) else workload.draw(
        plan.global_batch, seed, tuple(model.dims.encoders))
    if len(samples) == 0:
        raise DataError("the workload has no samples; give a global batch of at least one")
    step = Step(cluster, model, samples, plan, cache)
    if plan.pp > 1:
        pipeline_sim.run_pipeline(step)
    else:
        if plan.encoder_mode == "pool" and not plan.encoder_gpus:
            plan_pool(step)
        for k in range(len(step.assignment.rounds[0])):
            run_round(step, k)
    if plan.encoder_gpus:
        run_separate(step)
    end_of_step(step)
    return build_report(step)


def check_fits_somewhere(cluster: Cluster, model: ModelSpec) -> None:
    """The model states alone, ZeRO-3-partitioned over every GPU, must fit one GPU's memory."""
    states = memory.model_states(model.total_params(), model.trainable_params(), cluster.gpus, 3,
                                 model.bytes_per_param)
    if states.total > cluster.hbm_bytes:
        raise ModelError(
            f"the model ({model.total_params() / 1e9:.1f} B parameters, "
            f"{model.trainable_params() / 1e9:.1f} B trained) needs {states.total / 2**30:.1f} "
            f"GiB per GPU for its states even under ZeRO-3 over all {cluster.gpus} GPUs, more "
            f"than their {cluster.hbm_bytes / 2**30:.0f} GiB: no plan fits; use more GPUs, GPUs "
            "with more memory, or freeze parts of the model")


# ----------------------------------------------------------------------------- one round
def round_rows(step: Step, k: int) -> list[Row]:
    """Round k's rows: each data-parallel rank's micro-batch over its SP group, or a block's
    long sequence over the block's ranks (listed once, at the block's first rank)."""
    rows = []
    for d, rounds in enumerate(step.assignment.rounds):
        r = rounds[k]
        if r.block is not None:
            if r.block[0] == d:
                rows.append(Row(step.ranks_of(*r.block), r.samples))
        elif r.samples.size:
            rows.append(Row(step.ranks_of(d, 1), r.samples))
    return rows


@dataclass(frozen=True)
class RoundRows:
    """Round k's rows and what every plan of a search reads of them, in arrays (R rows)."""

    rows: list[Row]
    ranks: np.ndarray  # [sum of sizes] every row's ranks, row by row
    size: np.ndarray  # [R] ranks of each row
    llm: np.ndarray  # [R] LLM training FLOPs of each row
    tokens: np.ndarray  # [R] tokens of each row (int)
    by_size: dict  # rows of one size n (first seen first) -> ([R_n] row ids, [R_n, n] ranks)


def round_rows_of(step: Step, k: int) -> RoundRows:
    """`round_rows` with its sums, kept in the step's cache for the plans whose rows are the
    same (one loader assignment, the same ranks a row spans)."""
    key = ("rows", id(step.assignment), step.pplan.reader_group_size, step.pplan.dp, k)
    if step.cache is not None and key in step.cache:
        return step.cache[key]
    rows = round_rows(step, k)
    size = np.array([len(r.ranks) for r in rows], dtype=np.int64)
    by_size = {}
    for i, n in enumerate(size.tolist()):
        by_size.setdefault(n, []).append(i)
    out = RoundRows(
        rows, np.concatenate([r.ranks for r in rows]) if rows else np.zeros(0, np.int64), size,
        np.array([step.llm_cost[r.samples].sum() for r in rows]),
        np.array([step.samples.tokens[r.samples].sum() for r in rows], dtype=np.int64),
        {n: (np.array(ids), np.stack([rows[i].ranks for i in ids])) for n, ids in by_size.items()})
    if step.cache is not None:
        step.cache[key] = out
    return out


def run_round(step: Step, k: int) -> None:
    """Round k on every LLM rank: encode, reshard, LLM forward / backward, reshard back, encode
    backward, and ZeRO-2/3's collectives of the round."""
    tl, ranks, rate = step.timeline, step.llm_ranks(), step.rate
    rr = round_rows_of(step, k)
    rows = rr.rows
    before = tl.compute[ranks].copy()
    shared = not step.plan.encoder_gpus  # DistTrain: the LLM's ranks encode nothing
    tp = step.pplan.tp  # a row's tp ranks all hold its tokens (its SP rank's share of them)
    work = encoder_work(step, rows if shared else [], k)
    llm = np.zeros(len(ranks))  # [W] LLM training FLOPs of the round
    tokens = np.zeros(len(ranks))  # [W] LLM tokens on each rank
    llm[rr.ranks] = np.repeat(rr.llm / rr.size, rr.size)  # a rank is in one row at most
    tokens[rr.ranks] = np.repeat(rr.tokens / (rr.size // tp), rr.size)
    ep_tokens = tokens / tp  # each TP rank dispatches its 1/tp of the row's tokens (ep x tp)
    llm = model_parallel.ep_balance(step, llm, ep_tokens, tokens)  # each routes all its tokens
    if shared and step.dummies:
        work.flops += dummy_flops(step, work)
    tl.run(ranks, "encode_fwd", work.flops * step.encoder_fwd / rate)
    _encoder_sp(step, work, backward=False)
    model_parallel.run_tp_gather(step, work)
    rows_s, inputs_s = reshard_seconds(step, work)
    _sync_groups(step, work.groups, "reshard", rows_s + inputs_s)
    pool_calls(step, work)
    for backward in (False, True):
        seconds = llm * ((2 + step.plan.checkpointing) if backward else 1) / 3 / step.llm_rate
        tl.run(ranks, "llm_bwd" if backward else "llm_fwd", seconds)
        if step.plan.overlap_grad_sync:
            pipeline_sim.note_pass(step, ranks, seconds, backward)
        _llm_sp(step, rr, backward)
        model_parallel.run_tp(step, rows, backward, rr.tokens,
                              seconds if step.plan.overlap_tp else None)
        model_parallel.run_ep(step, ep_tokens, backward)
    _sync_groups(step, work.groups, "reshard", rows_s)  # the gradients go back; inputs do not
    _encoder_sp(step, work, backward=True)
    tl.run(ranks, "encode_bwd", work.flops * (1 - step.encoder_fwd) / rate)
    if step.tp_apart:
        model_parallel.run_tp_encoder_grads(step)
    if step.cluster.micro_batch_s_per_param:  # every rank runs every round
        tl.run(ranks, "framework", step.cluster.micro_batch_s_per_param
               * pipeline_sim.held_params(step)[0])
    _round_zero(step, ranks, tl.compute[ranks] - before)
    _activations(step, tokens, work.positions)


def encoder_work(step: Step, rows: list[Row], k: int):
    """Round k's encoder placement (`round_work`). It depends only on the rows (the loader's
    assignment and the ranks a row spans, sp x tp), the encoder mode and the world, so plans
    of one search sharing those share it through `cache` (a copy: the caller adds to flops)."""
    mode = step.plan.encoder_mode
    args = (rows, step.layout, len(step.llm_ranks()), mode, step.plan.long_items, step.heads,
            step.model.cost.encoder_names, step.pplan.tp)
    if step.cache is None:
        return round_work(*args)
    key = ("round_work", id(step.assignment), step.pplan.sp, step.pplan.tp, k, mode,
           step.plan.long_items, step.plan.encoder_gpus, bool(rows))
    if key not in step.cache:  # the assignment lives in the same cache: its id stays its own
        folded = _pool_folded(step, rows, k)
        step.cache[key] = round_work(*args) if folded is None else (
            folded if step.pplan.tp == 1 else over_tp(folded, step.pplan.tp))
    work = step.cache[key]
    return dataclasses.replace(work, flops=work.flops.copy())


def _pool_folded(step: Step, rows: list[Row], k: int):
    """The pipeline's folded pool plan of round k (`pool_sim.pool_folded`) where this round's
    pool is the same one (the rows of each data-parallel rank's SP ranks, tp folded away, the
    same long items: `round_work` computes it so), else None. Plans of every tp and pp share it."""
    p, tp = step.pplan, step.pplan.tp
    if step.plan.encoder_mode != "pool" or not rows or pool_long(step) != step.plan.long_items \
            or len(step.llm_ranks()) != p.seq_data_size * tp:
        return None
    pool_rows = pool_rows_of(step, k)
    if len(pool_rows) != len(rows) or not all(
            a.samples is b.samples and np.array_equal(a.ranks[::tp] // tp, b.ranks)
            for a, b in zip(rows, pool_rows)):
        return None
    return pool_folded(step, k)


def dummy_flops(step: Step, work) -> np.ndarray:
    """[W] the dummy passes of the round: each encoder a rank runs no item of runs once on the
    family's dummy input (`CostModel.dummy_cost`)."""
    cm, out = step.model.cost, np.zeros(work.flops.size)
    for name in cm.encoder_names:
        others = [n for n in cm.encoder_names if n != name]
        ran = work.present.get(name, np.zeros(out.size, dtype=bool))
        out[~ran] += cm.dummy_cost(others)  # the cost of `name`'s dummy alone
    return out


def _sync_groups(step: Step, groups: list, phase: str, seconds: np.ndarray) -> None:
    """Each group's members wait for its last one, then spend the group's slowest time."""
    if not groups:
        return
    ranks = np.concatenate(groups)
    gid = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    per_group = np.array([seconds[g].max() for g in groups])
    step.timeline.sync(ranks, gid, phase, per_group[gid])


def _encoder_sp(step: Step, work, backward: bool) -> None:
    """Long-short SP inside the encoders: Ulysses' 4 all-to-alls a layer (q, k, v, output), each
    rank holding its piece; backward sends the gradients the same way (twice the forward).
    Kept in `work.memo` (the bytes as the additions they were, so their sum stays exact)."""
    key = ("encode_sp", backward)
    if key not in work.memo:
        work.memo[key] = _encoder_sp_groups(step, work, backward)
    groups, seconds, added = work.memo[key]
    for nbytes in added:
        step.a2a_bytes["encoder_ulysses"] += nbytes
    if groups:
        _sync_per_group(step, groups, seconds, "encode_sp")


def _encoder_sp_groups(step: Step, work, backward: bool) -> tuple[list, list, list]:
    """(the split items' groups, each one's seconds, the bytes of each item's exchanges)."""
    groups, seconds, added, links = {}, {}, [], {}
    for ranks, positions, enc in work.split_positions:
        e = step.model.dims.encoders[enc]
        per_layer = positions * 4 * e.hidden * 2  # bytes a rank sends in one layer's 4 exchanges
        key = int(ranks[0])  # the round's groups are disjoint: a group's first rank names it
        if key not in links:
            links[key] = comm.link_of(step.cluster, ranks)
        t = e.layers * comm.even_all_to_all(per_layer, len(ranks), links[key],
                                            comm.ULYSSES_CALLS, step.cluster.a2a_call_s)
        groups[key] = ranks
        seconds[key] = seconds.get(key, 0.0) + t * (2 if backward else 1)
        added.append(per_layer * e.layers * len(ranks) * (len(ranks) - 1) / len(ranks) * (
            2 if backward else 1))
    return list(groups.values()), [seconds[k] for k in groups], added


def _sync_per_group(step: Step, groups: list, seconds: list, phase: str) -> None:
    ranks = np.concatenate(groups)
    gid = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    step.timeline.sync(ranks, gid, phase, np.asarray(seconds)[gid])


def llm_sp_seconds(step: Step, tokens_per_rank: np.ndarray, g: int, ranks, backward: bool,
                   tp: int = 1) -> np.ndarray:
    """Ulysses in the LLM: per layer, q, k, v to heads and the output back: (2h + 2kv) values a
    token, bf16; backward as many (each all-to-all's gradient goes back by one all-to-all of
    the same size: DeepSpeed's `_SeqAllToAll.backward`; measured, tests/dist/
    test_sim_a2a_measured.py), plus the recomputed forward's under checkpointing. Under
    tp x sp a TP rank holds heads / tp of them (AutoTP's split), so it sends 1/tp of that.
    `tokens_per_rank` [G]: a rank's tokens in each of G groups of g `ranks` ([G, g]); -> [G]
    seconds (in arrays: the 1,024-GPU search runs ~10^6 of them)."""
    d = step.model.dims
    per_layer = tokens_per_rank * (2 * d.hidden + 2 * step.model.kv) * 2 / tp
    times = (1 + step.plan.checkpointing) if backward else 1
    step.a2a_bytes["llm_ulysses"] += float(np.sum(per_layer)) * d.layers * times * (g - 1)
    link = comm.links_each(step.cluster, np.asarray(ranks).reshape(-1, g))
    return times * d.layers * comm.even_all_to_all_each(per_layer, g, link,
                                                        comm.ULYSSES_CALLS,
                                                        step.cluster.a2a_call_s)


def _llm_sp(step: Step, rr: RoundRows, backward: bool) -> None:
    """Each row's SP group(s) meet at Ulysses' all-to-alls: under tp one SP group per TP rank
    (the row's ranks of one tp coordinate), each with heads / tp; under ring attention one per
    ring rank, then the rings (`ring_sim`)."""
    tp = step.pplan.tp
    ranks, gid, seconds, rings = [], [], [], []
    for n, (ids, stacked) in rr.by_size.items():  # rows of one size together (blocks differ)
        if n <= tp:
            continue
        g = n // tp
        u, c = ring_sim.sequence_split(step, g)  # Ulysses inside, ring across (c = 1: none)
        groups = stacked.reshape(len(ids), g, tp).transpose(0, 2, 1)
        tokens = np.repeat(rr.tokens[ids] / g, tp * c)  # [R tp c]
        t = llm_sp_seconds(step, tokens, u, groups.reshape(-1, u), backward, tp)  # [R tp c]
        first = sum(len(s) for s in seconds)
        ranks.append(groups.reshape(-1))
        gid.append(first + np.repeat(np.arange(t.size), u))
        seconds.append(t)
        rings.append((ids, groups.reshape(-1, g), u, c))
    if ranks:
        seconds = np.concatenate(seconds)
        gid = np.concatenate(gid)
        step.timeline.sync(np.concatenate(ranks), gid, "llm_sp", seconds[gid])
    for ids, groups, u, c in rings:
        ring_sim.run_ring(step, rr, ids, groups, u, c, backward)


def _round_zero(step: Step, ranks: np.ndarray, compute: np.ndarray) -> None:
    """ZeRO-3: the parameters gathered in forward and again in backward, the gradients
    reduce-scattered; ZeRO-2: the reduce-scatter. Over all ranks of the stage, every round:
    the round waits for its busiest rank. Hidden behind the fastest rank's compute if
    `overlap_comm`."""
    stage = step.plan.zero_stage
    if stage < 2:
        return
    m, t = step.model, 0.0
    for shard in model_parallel.state_shards(step, 0, pipeline_sim.held_params(step)):
        link = model_parallel.shard_link(step, shard)
        t += comm.reduce_scatter(shard.trainable * m.bytes_per_param, shard.group_size, link)
        if stage == 3:
            t += 2 * comm.all_gather(shard.params * m.bytes_per_param, shard.group_size, link)
    hidden = float(np.min(compute)) if step.plan.overlap_comm and np.size(compute) else 0.0
    step.timeline.sync(ranks, np.zeros(len(ranks)), "zero", max(0.0, t - hidden))


def _activations(step: Step, tokens: np.ndarray, positions: np.ndarray) -> None:
    m, ckpt, tp = step.model, step.plan.checkpointing, step.pplan.tp
    llm = tokens * (m.llm_activation_bytes(ckpt, tp) + m.llm_peak_extra_bytes(ckpt, tp))
    enc = positions * max((m.encoder_activation_bytes(n, ckpt) for n in m.dims.encoders),
                          default=0.0)
    n = len(tokens)
    step.act_peak[:n] = np.maximum(step.act_peak[:n], llm + enc)


# --------------------------------------------------------------------------- end of step
def end_of_step(step: Step) -> None:
    """The step's gradient synchronisation over each stage's data-parallel x SP ranks:
    ZeRO-0 all-reduces the gradients, ZeRO-1 reduce-scatters them and all-gathers the updated
    parameters, ZeRO-2 all-gathers the parameters (its reduce-scatters ran every round); all
    ranks then meet (the next step's first collective)."""
    p, m, tl = step.pplan, step.model, step.timeline
    stage_ranks = [step.ranks_of(0, p.dp, s) for s in range(p.pp)]
    seconds = np.zeros(step.cluster.gpus)
    for s, ranks in enumerate(stage_ranks):
        reduce, gather = grad_sync_parts(step, s)
        seconds[ranks] = reduce + gather
        if step.plan.overlap_grad_sync:  # the bucketed reduction in the last backward(s), the
            # parameters' all-gather in the next step's first forward(s): `overlap_exposed`
            seconds[ranks] = pipeline_sim.overlap_exposed(
                reduce, gather, step.last_bwd[ranks], np.nan_to_num(step.first_fwd[ranks]),
                step.plan.virtual_stages, p.pp)
    ranks = np.concatenate(stage_ranks)
    tl.sync(ranks, np.repeat(np.arange(p.pp), len(stage_ranks[0])), "grad_sync", seconds[ranks])
    update = np.zeros(step.cluster.gpus)
    for s, stage in enumerate(stage_ranks):
        update[stage] = optimizer_seconds(step, s)
    if update.any():
        tl.run(ranks, "optimizer", update[ranks])
    everyone = np.arange(step.cluster.gpus)
    tl.sync(everyone, np.zeros(everyone.size), "grad_sync", 0.0)


def optimizer_seconds(step, stage: int) -> float:
    """A rank's optimizer step (the parameters it updates: its ZeRO-1+ shard of each group, all
    of them under ZeRO-0) and its fixed per-step work: the cluster's fitted per-parameter and
    per-step seconds (0 on the GPU presets)."""
    c = step.cluster
    if not (c.optimizer_s_per_param or c.step_s):
        return 0.0
    held = pipeline_sim.held_params(step, stage)
    shards = model_parallel.state_shards(step, stage, held)
    updated = sum(sh.trainable / (sh.group_size if step.plan.zero_stage else 1) for sh in shards)
    return updated * c.optimizer_s_per_param + c.step_s


def grad_sync_seconds(step, stage: int) -> float:
    """The end of step's collectives of a rank of `stage`, over each of its ZeRO groups."""
    return sum(grad_sync_parts(step, stage))


def grad_sync_parts(step, stage: int) -> tuple[float, float]:
    """`grad_sync_seconds` as (the reduction, ZeRO-1's parameter all-gather after the update)."""
    m, t, gather = step.model, pipeline_sim.encoder_shard_seconds(step), 0.0
    held = pipeline_sim.held_params(step, stage)
    for shard in model_parallel.state_shards(step, stage, held):
        link, n = model_parallel.shard_link(step, shard), shard.group_size
        g, w = shard.trainable * m.bytes_per_param, shard.params * m.bytes_per_param
        t += {0: comm.all_reduce(g, n, link), 1: comm.reduce_scatter(g, n, link),
              2: comm.all_gather(w, n, link), 3: 0.0}[step.plan.zero_stage]
        gather += comm.all_gather(w, n, link) if step.plan.zero_stage == 1 else 0.0
    return t, gather
