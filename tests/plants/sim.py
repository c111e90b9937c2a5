"""Planted errors of the simulator (tests/unit/sim/, tests/dist/test_sim_*_measured.py)."""

from tests.plants.registry import patched, plant


# --------------------------------------------- the step simulator (tests/unit/sim/test_sim_comm.py)
@plant("a2a_even_splits", "the simulator prices an all-to-all as if every message carried the "
       "mean bytes (uneven splits ignored)", "sim")
def _a2a_even_splits(rank: int):
    import numpy as np
    from ds_omni.sim import comm

    def even(original):
        def pairs(src, dst, nbytes, cluster):
            nbytes = np.asarray(nbytes, dtype=np.float64)
            return original(src, dst, np.full(nbytes.shape, nbytes.mean() if nbytes.size else 0.0),
                            cluster)
        return pairs
    yield from patched(comm, "all_to_all_pairs", even)


@plant("sim_ep_no_backward", "the simulator's expert-parallel all-to-alls are priced in the "
       "forward pass only (backward's dispatch / combine, and the recompute, forgotten)",
       "sim_ep_a2a_measured")
def _sim_ep_no_backward(rank: int):
    from ds_omni.sim import model_parallel

    def make(run_ep):
        return lambda step, tokens, backward: None if backward else run_ep(step, tokens, backward)
    yield from patched(model_parallel, "run_ep", make)


# ------------------ the pipeline engine's costs (tests/unit/sim/test_sim_pipe_engine.py)
@plant("sim_pipe_bytes_one_side", "the simulated pipeline engine prices the bytes of one side "
       "a pass (a middle stage's sends forgotten)", "sim_pipe_engine")
def _sim_pipe_bytes_one_side(rank: int):
    from ds_omni.sim import pipeline_sim

    def make(engine_seconds):
        def planted(c, act, P, v):
            ends = engine_seconds(c, act, 2, v)  # two stages: one side each
            return [ends[0]] * P
        return planted
    yield from patched(pipeline_sim, "_engine_seconds", make)


# ----------------------- "bubbles" beside sp and tp (tests/unit/sim/test_sim_bubbles.py)
@plant("sim_bubbles_first_column", "the simulated bubbles schedule plans a row's items on its "
       "first SP shard's first TP rank alone (the other ranks of stage 0 encode nothing)",
       "sim_bubbles")
def _sim_bubbles_first_column(rank: int):
    from contextlib import contextmanager
    from ds_omni.sim import bubble_sim

    def make(shard_items):
        def planted(ops, rounds):
            shards = shard_items(ops, rounds)
            pairs = sorted(((i, m) for got, micro in shards for i, m in zip(got, micro)),
                           key=lambda im: im[1])
            first = ([i for i, _ in pairs], [m for _, m in pairs])
            return [first] + [([], [])] * (len(shards) - 1)
        return planted

    def make_pipeline(pipeline):
        return lambda ops, cols, *args: pipeline(ops, cols[:1], *args)
    with contextmanager(patched)(bubble_sim.BubbleOps, "_shard_items", make):
        yield from patched(bubble_sim.BubbleOps, "_pipeline", make_pipeline)


# ------------------------- the simulator's link calibration (tests/unit/sim/test_calibrate_comm.py)
@plant("comm_fit_no_latency", "the alpha-beta fit sees no latency term (every collective charged "
       "its bytes only)", "calibrate_comm")
def _comm_fit_no_latency(rank: int):
    from ds_omni.sim.calibrate_comm import Timing
    yield from patched(Timing, "terms", lambda f: lambda self: (0.0, f(self)[1]))


# ---------------------------------------------- the plan search (tests/unit/sim/test_sim_search.py)
@plant("search_bound_too_tight", "the plan search's lower bound overstated threefold, so it prunes "
       "plans that would have ranked", "sim_search")
def _search_bound_too_tight(rank: int):
    from ds_omni.sim import bounds
    yield from patched(bounds, "refined_bound", lambda f: lambda *a: 3 * f(*a))


# ------------------------------------------- the simulator under tp (tests/unit/sim/test_sim_tp.py)
@plant("sim_tp_encodes_everything", "the simulator has every TP rank encode the whole row again "
       "(the split of `plan_tp_encode` ignored)", "sim_tp")
def _sim_tp_encodes_everything(rank: int):
    from ds_omni.sim import encode_sim
    yield from patched(encode_sim, "_tp_apart", lambda f: lambda rows, layout, world, tp, order:
                       encode_sim._per_tp_rank(rows, layout, world, "replicated", False, {},
                                               order, tp))


@plant("sim_ulysses_backward_x2", "the simulator charges Ulysses' backward twice the forward's "
       "all-to-all bytes (its model before the measured run)", "sim_a2a_measured")
def _sim_ulysses_backward_x2(rank: int):
    from ds_omni.sim import step
    yield from patched(step, "llm_sp_seconds", lambda f: lambda st, tok, g, ranks, backward,
                       tp=1: f(st, tok, g, ranks, backward, tp)
                       + (f(st, tok, g, ranks, backward, tp) if backward else 0.0))


# ------------------------------- the simulator's fast paths (tests/unit/sim/test_sim_fast_paths.py)
@plant("sim_reshard_shard_off_by_one", "the simulator's fast resharding charge counts a row's "
       "rows against shards one token too long (not `plan_reshard`'s ceil(T / g))",
       "sim_fast_paths")
def _sim_reshard_shard_off_by_one(rank: int):
    from ds_omni.sim import encode_sim
    yield from patched(encode_sim, "_charge", lambda f: lambda placed, shard, *a:
                       f(placed, shard + 1, *a))


@plant("sim_memo_one_direction", "the simulator's memo of a placement prices the encoders' "
       "Ulysses backward as its forward (the direction left out of the memo's key)",
       "sim_fast_paths")
def _sim_memo_one_direction(rank: int):
    from ds_omni.sim import step
    yield from patched(step, "_encoder_sp_groups", lambda f: lambda st, work, backward:
                       f(st, work, False))


# ----------------------------------- the simulator's encoder pool (tests/unit/sim/test_sim_pool.py)
@plant("sim_pool_plan_free", "the simulator charges the encoder pool's step planning nothing "
       "(its metadata all-gather and `plan_round` over every rank's items forgotten)", "sim_pool")
def _sim_pool_plan_free(rank: int):
    from ds_omni.sim import step
    yield from patched(step, "plan_pool", lambda f: lambda st: None)


@plant("sim_pool_tp_copies_unpriced", "the simulator prices the pool's exchanges under pp and tp "
       "from TP rank 0's messages alone (the copies on the other TP ranks forgotten)",
       "sim_pool_folded")
def _sim_pool_tp_copies_unpriced(rank: int):
    from ds_omni.sim import encode_sim
    yield from patched(encode_sim, "exchanges", lambda original: (
        lambda c, work, tp=1: original(c, work, 1)))


# ------------------------------------------ ring attention in the simulator (test_sim_cp.py)
@plant("sim_ring_not_overlapped", "the simulator adds every ring step's key/value transfer to the "
       "step instead of overlapping it with the block's attention", "sim_cp")
def _sim_ring_not_overlapped(rank: int):
    from ds_omni.sim import ring_sim
    yield from patched(ring_sim, "ring_layer_seconds", lambda f: lambda transfer, block, c, *a, **k:
                       f(transfer, 0.0 * block, c, *a, **k))


@plant("sim_ring_as_ulysses", "the simulator runs a row's sp x cp ranks as one Ulysses group (the "
       "ring and its kv transfers ignored)", "sim_cp")
def _sim_ring_as_ulysses(rank: int):
    from ds_omni.sim import ring_sim
    yield from patched(ring_sim, "sequence_split", lambda f: lambda step, g: (g, 1))
