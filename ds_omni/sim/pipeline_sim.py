"""A pipelined step on simulated ranks: DeepSpeed's 1F1B schedule over the stages, each stage
priced from the boundaries training computes (`parallel.stages.stage_plan_for`, split by
"cost", "parameters" or "layers"), encoder work where the placement puts it: all on stage 0
("stage0", Megatron-LM), or spread over the stages before the schedule by the joint pipeline's
planner (`parallelize.joint.assign_items`, "uniform"), the rows then sent to stage 0.

1F1B: stage s runs min(P - s - 1, M) forwards, then alternates one forward and one backward,
then the remaining backwards; a forward waits for the stage before (activations, p2p), a
backward for the stage after (gradients); interleaved (`SimPlan.virtual_stages` v): the same
over P v model chunks, Megatron's order. Every pipeline has the same op order.

Under tp and ep each rank of a stage is a column, with TP's all-reduces and EP's all-to-alls
after each of its passes (`stage_parallel`); under the encoder pool: `pool_sim`.

Dims: P stages, M micro-batches, D pipelines (dp x sp), L decoder layers.
"""

from __future__ import annotations

import functools

import numpy as np

from ds_omni.parallel.stages import stage_plan_for
from ds_omni.parallelize.joint import assign_items
from ds_omni.sim import bubble_sim, comm, pool_sim, stage_parallel
from ds_omni.sim.timeline import COMM

# the placements with encoders on every stage ("bubbles": `bubble_sim`; "auto" resolves to one)
JOINT = ("uniform", "bubbles")


def stage_plan(step):
    """The stage boundaries of the plan, as `ds_omni.parallelize.pipeline.stage_plan` computes
    them: for a typical micro-batch (its mean samples, each of the plan's `stage_tokens` tokens,
    as training's config gives them; without one the step's mean sample)."""
    m, p = step.model, step.plan
    per_micro = max(1, round(len(step.samples) / (step.pplan.dp * p.micro_batches)))
    tokens = p.stage_tokens or max(1, int(step.samples.tokens.mean()))
    d = m.dims
    layer_params = [d.hidden * d.vocab] + [m.llm_layer_params()] * d.layers + [d.hidden * d.vocab]
    encoder_params = sum(m.encoder_params(n) for n in d.encoders if n not in m.frozen)
    return stage_plan_for(m.cost, step.pplan.pp, p.encoder_placement, per_micro, tokens,
                          split=p.stage_split, layer_params=layer_params,
                          encoder_params=encoder_params)


def stage_params(step, s: int) -> tuple[float, float]:
    """(parameters, trained parameters) a rank of stage s holds: its decoder layers, the
    embedding on the first stage, the head on the last; the encoders on stage 0 ("stage0") or
    on every stage (the joint pipeline's replicas, each trainable encoder parameter trained,
    its optimizer state held, by one owner stage: `parallelize.joint.EncoderShards`, balanced
    by size, so 1/P of them a stage)."""
    m, d = step.model, step.model.dims
    sp = step.stage_plan
    llm = len(sp.decoder_layers(s)) * m.llm_layer_params() + d.hidden * d.vocab * (
        (s == 0) + (s == step.pplan.pp - 1))
    enc = {n: m.encoder_params(n) for n in d.encoders}
    if step.plan.encoder_placement == "stage0" and s > 0:
        enc = {}
    owned = 1 / step.pplan.pp if step.plan.encoder_placement in JOINT else 1
    trained = ((0 if "llm" in m.frozen else llm)
               + owned * sum(v for n, v in enc.items() if n not in m.frozen))
    return llm + sum(enc.values()), trained


def encoder_shard_seconds(step) -> float:
    """The joint pipeline's two collectives a step over one pipeline's P ranks
    (`EncoderShards`): the trainable encoders' gradients reduced onto their owners and the
    updated parameters broadcast back, priced as a reduce-scatter and an all-gather of them
    (each rank sends and receives (P - 1) / P of the bytes each way). 0 without them."""
    m, P = step.model, step.pplan.pp
    if step.plan.encoder_placement not in JOINT or P < 2:
        return 0.0
    nbytes = sum(m.encoder_params(n) for n in m.dims.encoders if n not in m.frozen) \
        * m.bytes_per_param
    link = comm.link_of(step.cluster, [step.ranks_of(0, 1, s)[0] for s in range(P)])
    return comm.reduce_scatter(nbytes, P, link) + comm.all_gather(nbytes, P, link)


def encoder_params(step) -> float:
    """Parameters of all the encoders (what a joint-pipeline stage's replica holds)."""
    return float(sum(step.model.encoder_params(n) for n in step.model.dims.encoders))


def held_params(step, s: int = 0) -> tuple[float, float]:
    """(parameters, trained parameters) an LLM rank of stage s holds: under a pipeline its
    stage's; with encoders on their own GPUs the LLM's; else the whole model."""
    m = step.model
    if step.pplan.pp > 1:
        return stage_params(step, s)
    if step.plan.encoder_gpus:
        return m.llm_params(), 0 if "llm" in m.frozen else m.llm_params()
    return m.total_params(), m.trainable_params()


def _micro_arrays(step):
    """Per micro-batch and pipeline: LLM FLOPs [M, D], tokens [M, D], encoder FLOPs [M, D], all
    per rank (an SP group splits its row's work evenly). Kept in the step's cache for the plans
    of one loader assignment and sp (a search's pipelines differ there in ZeRO, encoders,
    placement, checkpointing: read-only arrays)."""
    key = ("pipe_micro", id(step.assignment), step.pplan.sp, step.pplan.seq_data_size,
           step.plan.encoder_mode, pool_sim.pool_long(step))
    if step.cache is None:
        return _micro_arrays_of(step)
    if key not in step.cache:  # the assignment lives in the same cache: its id stays its own
        step.cache[key] = _micro_arrays_of(step)
    return step.cache[key]


def _micro_arrays_of(step):
    p = step.pplan
    pool = step.plan.encoder_mode == "pool"
    llm, tokens = (np.repeat(x.T, p.sp, axis=1) / p.sp for x in _row_sums(step))
    if pool:  # each round's items over the pool's ranks
        enc = pool_sim.pool_loads(step)
    else:  # a row's own items (the pool's are its plan's)
        enc = np.repeat(_row_items(step).T, p.sp, axis=1) / p.sp
    return llm, tokens, enc


def _row_sums(step):
    """[D, M] each data-parallel rank's LLM FLOPs and tokens of each round, kept per assignment
    (the plans of every sp, mode and placement on it share them)."""
    rounds, M = step.assignment.rounds, step.plan.micro_batches

    def make():
        return (np.array([[step.llm_cost[rs[m].samples].sum() for m in range(M)] for rs in rounds]),
                np.array([[step.samples.tokens[rs[m].samples].sum() for m in range(M)]
                          for rs in rounds]))
    return pool_sim.kept(step, ("pipe_sums", id(step.assignment), M), make)


def _row_items(step):
    """[D, M] the encoder FLOPs of each data-parallel rank's own items of each round, kept per
    assignment."""
    items_of, M = step.layout.items_of, step.plan.micro_batches

    def make():
        return np.array([[step.item_cost[np.concatenate(
            [items_of[n] for n in rs[m].samples.tolist()] or [np.zeros(0, np.int64)])].sum()
            for m in range(M)] for rs in step.assignment.rounds])
    return pool_sim.kept(step, ("pipe_row_items", id(step.assignment), M), make)


@functools.lru_cache(maxsize=256)
def _orders(P: int, M: int, v: int = 1) -> list[list[tuple]]:
    """Each stage's op order: ("F" | "B", micro-batch[, model chunk]). v = 1: 1F1B; v > 1:
    Megatron's interleaved 1F1B (`_interleaved`). Kept per shape: read-only."""
    if v > 1:
        return [_interleaved(P, M, v, s) for s in range(P)]
    out = []
    for s in range(P):
        warm = min(P - s - 1, M)
        ops = [("F", m) for m in range(warm)]
        for m in range(M - warm):
            ops += [("F", warm + m), ("B", m)]
        out.append(ops + [("B", m) for m in range(M - warm, M)])
    return out


def _warmup(P: int, M: int, v: int, s: int) -> int:
    """Forwards stage s runs before its first backward (Megatron's schedules: 1F1B's P - s - 1;
    interleaved 2 (P - s - 1) + (v - 1) P, all of them when M = P), capped at its M v."""
    if v == 1:
        return min(P - s - 1, M)
    return M * v if M == P else min(2 * (P - s - 1) + (v - 1) * P, M * v)


def _interleaved(P: int, M: int, v: int, s: int) -> list[tuple[str, int, int]]:
    """Stage s's ops under the interleaved schedule (M a multiple of P): its k-th forward runs
    chunk (k mod P v) // P on micro-batch (k // P v) P + k mod P, its backwards the chunks the
    other way round; warm-up forwards, then one forward and one backward, then the rest."""
    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k % (P * v)) // P
        return kind, (k // (P * v)) * P + k % P, chunk if kind == "F" else v - 1 - chunk
    total, warm = M * v, _warmup(P, M, v, s)
    ops = [op("F", k) for k in range(warm)]
    for k in range(total - warm):
        ops += [op("F", warm + k), op("B", k)]
    return ops + [op("B", k) for k in range(total - warm, total)]


def run_pipeline(step) -> None:
    """The whole step's schedule on every LLM rank of `step` (its `timeline`)."""
    bubble_sim.resolve_auto(step, stage_plan)  # "auto": the placement training would choose
    p, plan = step.pplan, step.plan
    P, M, v = p.pp, plan.micro_batches, plan.virtual_stages
    step.stage_plan = stage_plan(step)
    frac = stage_fractions(step)  # [P] each stage's share of a micro-batch's LLM work
    llm, tokens, enc = _micro_arrays(step)
    if p.tp > 1 or p.ep > 1:  # one column a rank of a stage (dp x sp x tp)
        llm, tokens, enc = stage_parallel.per_rank(step, llm, tokens, enc)
    ranks = [step.ranks_of(0, p.dp, s) for s in range(P)]  # [P][D tp]
    uniform = plan.encoder_placement in JOINT
    if plan.encoder_mode == "pool":  # its planning and exchanges, before the schedule
        pool_sim.pool_exchanges(step, ranks, list(range(P)) if uniform else [0])
    passes = _Passes(step, ranks, frac, llm, tokens, enc, uniform)
    bubbles = bubble_sim.BubbleOps(step, ranks) if plan.encoder_placement == "bubbles" else None
    if uniform and bubbles is None:
        _uniform_encode(step, ranks, backward=False)
    events, pointer = {}, [0] * P
    orders = _orders(P, M, v) if bubbles is None else bubbles.orders(_orders(P, M))
    while any(pointer[s] < len(orders[s]) for s in range(P)):
        moved = False
        for s in range(P):
            if pointer[s] == len(orders[s]):
                continue
            kind, m = orders[s][pointer[s]][:2]
            if kind not in ("F", "B"):  # the bubbles' encoder ops (`bubble_sim`)
                ran = bubbles.run(s, kind, m, events)
                pointer[s], moved = pointer[s] + ran, moved or bool(ran)
                continue
            chunk = orders[s][pointer[s]][2] if v > 1 else 0
            if _run_op(step, passes, events, s, kind, m, chunk):
                pointer[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the pipeline schedule deadlocked at {pointer} (a bug)")
    if uniform and bubbles is None:
        _uniform_encode(step, ranks, backward=True)
    _pipeline_memory(step, tokens, frac)


class _Passes:
    """A pipeline's passes, priced for all M micro-batches at once per (kind, stage): [M, n]
    seconds, row m micro-batch m's, element by element the arithmetic of one micro-batch's,
    and the bytes each pass adds; a model chunk's share of the stage under the interleaved
    schedule (v chunks). `_run_op` reads `p2p`, `compute`, `ulysses`, `tp` by (kind, s) and
    `encode` by kind (stage 0's)."""

    def __init__(self, step, ranks, frac, llm, tokens, enc, uniform: bool):
        p, P, fwd_e, v = step.pplan, step.pplan.pp, step.encoder_fwd, step.plan.virtual_stages
        self.ranks, self.tokens, self.uniform = ranks, tokens, uniform
        act = tokens * step.model.dims.hidden * 2  # [M, D] bytes sent between stages
        # per micro-batch, each stage's weights read and gradients accumulated (the joint
        # pipeline's encoder replicas run once a step, and pay their share there)
        overhead = np.array([step.cluster.micro_batch_s_per_param * (
            stage_params(step, s)[0] - uniform * encoder_params(step)) for s in range(P)]) / v
        frac = frac / v
        engine = _engine_seconds(step.cluster, act, P, v)  # [P] of [M, D tp]
        self.p2p, self.compute, self.ulysses, self.tp, self.encode = {}, {}, {}, {}, {}
        for kind in ("F", "B"):
            share = 1 / 3 if kind == "F" else (2 + step.plan.checkpointing) / 3
            here = enc * (fwd_e if kind == "F" else 1 - fwd_e)
            self.encode[kind] = (here / step.rate, here.any(axis=1))  # "stage0": stage 0's
            for s in range(P):
                other = s - 1 if kind == "F" else s + 1  # activations in, or their gradients
                if v > 1 or 0 <= other < P:  # interleaved: the last stage feeds the first
                    self.p2p[kind, s] = _p2p_seconds(step, ranks[other % P][0], ranks[s][0], act)
                self.compute[kind, s] = llm * frac[s] * share / step.llm_rate + \
                    overhead[s] * share + engine[s]
                if p.sp > 1:
                    seconds, moved = _ulysses(step, tokens, kind == "B", s, frac[s])
                    self.ulysses[kind, s] = seconds, [b / v for b in moved]
                if p.tp > 1:
                    self.tp[kind, s] = stage_parallel.tp_stage_seconds(step, s, tokens,
                                                                       kind == "B", 1 / v)


def _engine_seconds(c, act: np.ndarray, P: int, v: int) -> list:
    """[P] of [M, D tp]: what the pipeline engine adds to each pass of stage s on its CPU: one
    pass (`Cluster.pipe_pass_s`) and the bytes it receives and sends (`p2p_byte_s`; a forward
    receives from the stage before and sends to the one after, a backward the other way; a
    middle stage or the interleaved schedule's chunks both, the ends one)."""
    sides = [(s > 0 or v > 1) + (s < P - 1 or v > 1) for s in range(P)]
    return [c.pipe_pass_s + c.p2p_byte_s * n * act for n in sides]


def _run_op(step, passes: _Passes, events: dict, s: int, kind: str, m: int, chunk: int) -> bool:
    """Stage s runs its pass `kind` of micro-batch m through its model chunk `chunk` (virtual
    stage chunk x P + s) once the virtual stage before (forward) or after (backward) has sent
    it its activations or gradients; False while it has not."""
    P, plan, tl = step.pplan.pp, step.plan, step.timeline
    vs, last = chunk * P + s, P * plan.virtual_stages - 1
    dep = ("F", vs - 1, m) if kind == "F" and vs > 0 else (
        ("B", vs + 1, m) if kind == "B" and vs < last else None)
    if dep is not None and dep not in events:
        return False
    ranks = passes.ranks[s]
    if dep is not None:
        tl.run(ranks, "p2p", passes.p2p[kind, s][m], COMM, after=events[dep])
    if not passes.uniform and vs == 0:
        enc_s, has = passes.encode[kind]
        if has[m]:
            tl.run(ranks, "encode_fwd" if kind == "F" else "encode_bwd", enc_s[m])
    seconds = passes.compute[kind, s][m]
    events[(kind, vs, m)] = tl.run(ranks, "llm_fwd" if kind == "F" else "llm_bwd", seconds)
    if plan.overlap_grad_sync:
        note_pass(step, ranks, seconds, kind == "B")
    if step.pplan.sp > 1:  # Ulysses inside the stage's layers (the SP ranks' work is even)
        sp_s, moved = passes.ulysses[kind, s]
        step.a2a_bytes["llm_ulysses"] += moved[m]
        events[(kind, vs, m)] = tl.run(ranks, "llm_sp", sp_s[m], COMM)
    tp = passes.tp[kind, s] if step.pplan.tp > 1 else None
    done = stage_parallel.stage_collectives(step, ranks, s, passes.tokens[m], kind == "B",
                                            seconds, None if tp is None else (tp[0][m], tp[1][m]))
    if done is not None:  # tp's all-reduces, ep's all-to-alls inside the stage
        events[(kind, vs, m)] = done
    return True


def _p2p_seconds(step, src: int, dst: int, act: np.ndarray) -> np.ndarray:
    """[D tp] seconds of a stage's receive of `act` bytes a rank from rank `src`'s stage: whole
    from each TP rank, or 1/tp of them under Megatron's sequence parallelism (a rank holds its
    slice of the sequence between layers) and scatter/gather (the slices then all-gathered over
    the TP group's link)."""
    link = comm.link_of(step.cluster, [src, dst])
    tp, plan = step.pplan.tp, step.plan
    if tp == 1 or not (plan.p2p_scatter or plan.tp_splits_norms):
        return comm.p2p_each(act, link)
    wire = comm.p2p_each(act / tp, link)
    if plan.tp_splits_norms:
        return wire
    inside = comm.link_of(step.cluster, step.ranks_of(0, 1)[:tp])
    return wire + (tp - 1) * (inside.latency + act / tp / inside.bandwidth)


def note_pass(step, ranks, seconds, backward: bool) -> None:
    """Keep the ranks' first LLM forward and latest LLM backward seconds (`Step.first_fwd`,
    `Step.last_bwd`: what `SimPlan.overlap_grad_sync` hides the step's end behind)."""
    if backward:
        step.last_bwd[ranks] = seconds
    else:
        first = np.isnan(step.first_fwd[ranks])
        step.first_fwd[ranks] = np.where(first, seconds, step.first_fwd[ranks])


def overlap_exposed(reduce_s: float, gather_s: float, last_bwd: np.ndarray,
                    first_fwd: np.ndarray, v: int, P: int) -> float:
    """Seconds of a stage's gradient reduction (`reduce_s`) and ZeRO-1 parameter gather
    (`gather_s`) that `SimPlan.overlap_grad_sync` leaves exposed on its slowest rank, the
    ranks' chunk passes lasting `last_bwd` / `first_fwd` [n]. Model chunk c's gradients (1/v)
    reduce from the start of its last backward, which c P backwards follow (the interleaved
    cool-down), a chunk after another; its parameters (1/v) gather before its first forward
    ends, after c P forwards. v = 1: behind the last backward and the first forward."""
    end = np.full(np.shape(last_bwd), -np.inf)
    for c in reversed(range(v)):
        end = np.maximum(end, -(c * P + 1) * last_bwd) + reduce_s / v
    if gather_s > 0:
        end = end + np.max([(c + 1) * gather_s / v - (c * P + 1) * first_fwd
                            for c in range(v)], axis=0)
    return max(0.0, float(np.max(end)))


def stage_fractions(step) -> np.ndarray:
    """[P] each stage's share of the LLM's work: its predicted time over the stages' sum, or
    its share of the decoder layers where the cost model prices the LLM at zero (a cost model
    fitted without LLM work): never 0 / 0."""
    times = np.asarray(step.stage_plan.layer_time, dtype=np.float64)
    total = times.sum()
    if total > 0 and np.isfinite(total):
        return times / total
    layers = np.array([len(step.stage_plan.decoder_layers(s)) for s in range(times.size)], float)
    return layers / max(1.0, layers.sum())


def _ulysses(step, tokens: np.ndarray, backward: bool, s: int, frac: float):
    """([M, D] seconds of all the LLM's Ulysses all-to-alls of each micro-batch (`tokens`
    [M, D] per rank) over the SP group, x `frac` (stage s's share), and [M] the bytes each sends:
    per layer (2h + 2kv) bf16 values a token, split over the g ranks (`comm.even_all_to_all`);
    backward as many, plus the recompute under checkpointing. The bytes are stage s's layers'."""
    d, g, tp = step.model.dims, step.pplan.sp, step.pplan.tp
    link = comm.link_of(step.cluster, step.ranks_of(0, 1)[::tp])  # under tp: heads / tp
    per_layer = tokens * (2 * d.hidden + 2 * step.model.kv) * 2 / tp  # [M, D tp] a rank sends
    times = (1 + step.plan.checkpointing) if backward else 1
    layers = len(step.stage_plan.decoder_layers(s))  # the bytes of stage s's layers
    moved = [float(row.sum()) * layers * times * (g - 1) / g for row in per_layer]
    one = comm.even_all_to_all_each(per_layer, g, link, comm.ULYSSES_CALLS,
                                    step.cluster.a2a_call_s)  # [M, D]
    return times * d.layers * one * frac, moved


def _uniform_encode(step, ranks, backward: bool) -> None:
    """The joint pipeline: each pipeline's items of the step over its stages (LPT by cost), the
    rows then gathered to stage 0 (its gradients sent back after the schedule)."""
    p, rate, fwd = step.pplan, step.rate, step.encoder_fwd
    load, rows = _uniform_items(step)
    # the replica's weights read (forward) and gradients written (backward) once a step on a
    # stage with items: one pass over all of the step's items, not one a micro-batch
    weights = step.cluster.micro_batch_s_per_param * encoder_params(step)
    for s in range(p.pp):
        share = (1 - fwd) if backward else fwd
        step.timeline.run(ranks[s], "encode_bwd" if backward else "encode_fwd",
                          load[s] * share / rate + (load[s] > 0) * weights * share)
        if s > 0:
            link = comm.link_of(step.cluster, [ranks[s][0], ranks[0][0]])
            nbytes = rows[s] * step.model.dims.hidden * 2
            step.timeline.run(ranks[s], "p2p", comm.p2p_each(nbytes, link), COMM)


def _uniform_items(step) -> tuple[np.ndarray, np.ndarray]:
    """[P, D tp] encoder FLOPs and rows of each rank of each stage under the joint pipeline,
    kept in the step's cache for the plans of one assignment and shape (read-only)."""
    p = step.pplan
    key = ("pipe_items", id(step.assignment), p.pp, p.sp, p.tp, p.seq_data_size,
           bool(step.tp_apart), step.plan.encoder_mode)
    if step.cache is not None and key in step.cache:
        return step.cache[key]
    load = np.zeros((p.pp, p.seq_data_size))  # [P, D] encoder FLOPs per rank
    rows = np.zeros((p.pp, p.seq_data_size))  # [P, D] rows each stage sends to stage 0
    for cols, ids, share in _pipelines_items(step):
        costs = step.item_cost[ids].tolist()
        stages = assign_items(costs, p.pp)
        here, sent = [0.0] * p.pp, [0.0] * p.pp  # plain floats, added as the columns were
        for c, n, s in zip(costs, step.samples.item_rows[ids].tolist(), stages):
            here[s] += c / share
            sent[s] += n / share
        load.T[cols], rows.T[cols] = here, sent  # each stage's sum on its columns (one or sp)
    if p.tp > 1:  # every TP rank of a pipeline: its items (1/tp of them where they encode apart)
        apart = p.tp if step.tp_apart else 1
        load, rows = np.repeat(load, p.tp, axis=1) / apart, np.repeat(rows, p.tp, axis=1) / apart
    if step.cache is not None:
        step.cache[key] = (load, rows)
    return load, rows


def _pipelines_items(step) -> list[tuple]:
    """(its columns of a stage, [n] the ids of the items it encodes a step, the columns' count)
    of each pipeline of the joint pipeline: a data-parallel rank's SP ranks and its rows' items
    (each SP rank a share), or under the pool each pool rank and the items the pool gives it."""
    p = step.pplan
    if step.plan.encoder_mode == "pool":
        return [(c, ids, 1) for c, ids in enumerate(pool_sim.pool_owned(step))]
    items_of, out = step.layout.items_of, []
    for d, rounds in enumerate(step.assignment.rounds):
        ids = np.concatenate([items_of[n] for r in rounds for n in r.samples.tolist()]
                             or [np.zeros(0, np.int64)])
        out.append((slice(d * p.sp, (d + 1) * p.sp), ids, p.sp))
    return out


def _pipeline_memory(step, tokens: np.ndarray, frac: np.ndarray) -> None:
    """Stage s keeps the activations of its warm-up's micro-batches and one more in flight
    (1F1B: min(P - s, M); interleaved: as many model chunks, each 1/v of its layers)."""
    m, ckpt, P, M = step.model, step.plan.checkpointing, step.pplan.pp, step.plan.micro_batches
    tp, v = step.pplan.tp, step.plan.virtual_stages
    biggest = tokens.max(axis=0)  # [D tp]
    for s in range(P):
        layers = len(step.stage_plan.decoder_layers(s)) / m.dims.layers
        chunks = min(_warmup(P, M, v, s) + 1, M * v) / v  # 1F1B: min(P - s, M)
        kept = chunks * biggest * m.llm_activation_bytes(ckpt, tp) * layers
        extra = biggest * m.llm_peak_extra_bytes(ckpt, tp) if s == P - 1 else 0.0
        r = step.ranks_of(0, step.pplan.dp, s)
        step.act_peak[r] = np.maximum(step.act_peak[r], kept + extra)
