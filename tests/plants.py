"""Planted errors: one small, named change to the code under test each, that an oracle must catch.

    with plants.applied("loss_x2", rank):   # inside a rank (or the one process) under test
        ... train ...

A plant is put in by monkeypatching (never by editing ds_omni): `applied` puts the change in on
entry and takes it out on exit, so one launch can train a planted case among the honest ones.
Each plant names the launch whose oracle must fail on it (`launch`); the suite's tests called
`test_plant_*` (so `pytest -k plant` runs them all) assert, for every plant of their launch, that
the oracle's check FAILS with the plant in (`tests/unit/project/test_plants.py` holds every plant to a
test that runs it).

To add one: a generator function `(rank) -> None` that patches, yields, and undoes, decorated
with `@plant(name, what, launch)`; then a case for it in that launch and its `test_plant_*`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Plant:
    name: str
    what: str  # the change, in words
    launch: str  # the launch (test module) whose oracle must see it
    apply: Callable[[int], contextmanager]  # rank -> a context with the change in place


PLANTS: dict[str, Plant] = {}


def plant(name: str, what: str, launch: str):
    def register(fn: Callable[[int], Iterator[None]]):
        assert name not in PLANTS, f"plant {name!r} registered twice"
        PLANTS[name] = Plant(name, what, launch, contextmanager(fn))
        return fn
    return register


@contextmanager
def applied(name: str | None, rank: int):
    """The plant `name` in place (no plant: nothing changes)."""
    if name is None:
        yield
        return
    with PLANTS[name].apply(rank):
        yield


def for_launch(launch: str) -> list[str]:
    return sorted(n for n, p in PLANTS.items() if p.launch == launch)


def _patched(owner, attr: str, make: Callable) -> Iterator[None]:
    """`owner.attr = make(original)` for the duration."""
    original = getattr(owner, attr)
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


def _on_result(owner, attr: str, change: Callable) -> Iterator[None]:
    """`owner.attr` gives back `change(its result, *its args, **its kwargs)` for the duration:
    the plants that alter what a function (or a method: its args start with self) returns."""
    def make(original):
        def planted(*args, **kwargs):
            return change(original(*args, **kwargs), *args, **kwargs)
        return planted
    yield from _patched(owner, attr, make)


# ------------------------------------------------------------- data parallel (tests/dist/test_parity.py)
@plant("loss_x2", "the loss handed to DeepSpeed's backward is scaled 2x", "dp")
def _loss_x2(rank: int):
    from ds_omni.train import step
    yield from _patched(step, "engine_loss", lambda f: lambda *a: 2 * f(*a))


@plant("drop_sample", "rank 0's first micro-batch of the first step loses its last sample's "
       "targets", "dp")
def _drop_sample(rank: int):
    from ds_omni.data.loader import OmniLoader
    from ds_omni.batch import IGNORE_INDEX

    def drop(batch, loader):
        if rank == 0 and batch.step == 0:
            mb = batch.micro_batches[0]
            assert mb.route.reshard is None, "plant drop_sample on data-parallel runs only"
            mb.targets[:, int(mb.cu_seqlens[-2]):] = IGNORE_INDEX
        return batch
    yield from _on_result(OmniLoader, "next_step", drop)


# ------------------------------------- slow tier, data parallel (tests/dist/test_parity_slow.py)
@plant("per_sample_whole_row", "a per-sample layer run over the whole row (one sample's state "
       "flows into the next)", "dp_slow")
def _per_sample_whole_row(rank: int):
    from ds_omni.model import omni, per_sample

    def whole_row(layer, hidden, kwargs):
        return layer(hidden, **{k: v for k, v in kwargs.items()
                                if k not in (*per_sample._ROW_ONLY, "cu_seqlens")})
    yield from _patched(omni, "run_per_sample", lambda f: whole_row)


# ------------------------ slow tier, sequence parallel (tests/dist/test_sequence_parallel_slow.py)
@plant("deepstack_levels_dropped", "the deepstack levels are never added to the LLM's hidden "
       "states", "sp_slow")
def _deepstack_levels_dropped(rank: int):
    from ds_omni.model import deepstack
    yield from _patched(deepstack.Deepstack, "add", lambda add: lambda self, hidden, level: hidden)


# ------------------------------------------------ sequence parallel (tests/dist/test_sequence_parallel.py)
@plant("reshard_rows_swapped", "rank 0's first shard that receives two or more embedding rows "
       "puts its first and last received row in each other's place (the resharding plan)", "sp2")
def _reshard_rows_swapped(rank: int):
    import dataclasses
    from ds_omni.data import packing
    done = []

    def swap(plans, *args, **kwargs):
        mine = plans[0]
        if rank == 0 and not done and mine.rows_in >= 2:
            where = list(mine.recv_positions)
            where[0], where[-1] = where[-1], where[0]
            plans[0] = dataclasses.replace(mine, recv_positions=where)
            done.append(True)
        return plans
    yield from _on_result(packing, "plan_reshard", swap)


@plant("sp_block_ignored", "the model runs a long sequence's row without its block's Ulysses "
       "group (its sp_block ignored): each rank attends over its own shard only", "sp2")
def _sp_block_ignored(rank: int):
    from ds_omni.parallelize.embedding import EmbeddingRouter
    yield from _patched(EmbeddingRouter, "route",
                        lambda route: lambda router, batch: (router.sp_group, None))


@plant("sp_whole_row", "every SP rank packs and computes the whole row (no shard, no "
       "resharding; attention over a whole row skips Ulysses)", "sp2")
def _sp_whole_row(rank: int):
    from contextlib import ExitStack
    from ds_omni.data import packing
    from ds_omni.model.attention import PackedAttention

    def whole_row(row, items, processors, shard):  # what `pack` makes without a shard
        row.encoder_inputs = {e: processors[e].collate(its) for e, its in items.items()}
        row.items = items
        return row

    def make_call(call):
        def planted(self, q, k, v, cu_seqlens, *rest):
            if q.shape[2] == int(cu_seqlens[-1]):  # [1, H, T, D]: the whole row, no exchange
                return self._local(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   cu_seqlens, *rest)
            return call(self, q, k, v, cu_seqlens, *rest)
        return planted
    with ExitStack() as stack:
        for owner, attr, make in ((packing, "shard_row", lambda f: whole_row),
                                  (PackedAttention, "__call__", make_call)):
            stack.enter_context(contextmanager(_patched)(owner, attr, make))
        yield


@plant("reader_wrong_pixels", "the SP group's reader sends a peer the pixels of the wrong items "
       "(each item it encodes gets the next item of the row's inputs)", "sp2")
def _reader_wrong_pixels(rank: int):
    from ds_omni.data import workers

    def wrong_pixels(shards, samples, processors, shard):
        for mb in shards[1:]:
            plan = mb.route.reshard
            if plan is None:
                continue
            mb.encoder_inputs = {
                e: processors[e].collate([mb.items[e][(k + 1) % len(mb.items[e])] for k in idx])
                for e, idx in plan.encode.items() if idx}
        return shards
    yield from _on_result(workers, "pack_shards", wrong_pixels)


@plant("reader_group_tp_major", "the reader of an sp x tp group hands group rank g the shard "
       "of SP rank g % sp (as if the group were in (tp, sp) order)", "reader_group")
def _reader_group_tp_major(rank: int):
    from ds_omni.data import shared_read

    def planted(own, shards, group_size):
        sp = len(shards) + 1
        return [own if g % sp == 0 else shards[g % sp - 1] for g in range(1, group_size)]
    yield from _patched(shared_read, "peer_shards", lambda f: planted)


@plant("tp_reader_wrong_pixels", "the TP group's reader sends its peer wrong pixels for the "
       "items it encodes (every float encoder input negated)", "tp")
def _tp_reader_wrong_pixels(rank: int):
    import dataclasses
    from ds_omni.data import shared_read

    def negate(inputs: dict) -> dict:
        return {k: -t if t.is_floating_point() else t for k, t in inputs.items()}

    def negated(mb, *args):
        return dataclasses.replace(mb, encoder_inputs={
            e: negate(d) for e, d in mb.encoder_inputs.items()})
    yield from _on_result(shared_read, "peer_view", negated)


# ------------------------------------------------------------------- bf16 (tests/dist/test_bf16.py)
@plant("bf16_encoder_grads_dropped", "under bf16 and \"uniform\" placement the encoders' "
       "gradients, made after the pipeline's last backward, do not reach DeepSpeed's fp32 "
       "gradients (the doubt of issue 26: what BF16_Optimizer does unless ds_omni adds them)",
       "bf16")
def _bf16_encoder_grads_dropped(rank: int):
    from ds_omni.train import step
    yield from _patched(step, "late_grads_to_master",
                        lambda f: lambda optimizer: contextlib.nullcontext())


@plant("bf16_lm_head_in_loss_fn", "the pipeline's LM head and loss made in the engine's "
       "`loss_fn`, after the last stage's output, as before the fix: DeepSpeed's backward "
       "prologue, which fires when the first gradient reaches the module's output, then zeroes "
       "the head's bf16 gradient already made (BF16_Optimizer.clear_lp_grads)", "bf16")
def _bf16_lm_head_in_loss_fn(rank: int):
    from ds_omni.parallelize import pipeline
    from ds_omni.train import step as train_step

    def head_output(self, inputs):  # the last stage's output: the normed hidden and the index
        hidden, _, _, index = inputs
        return self.norm(hidden), index

    def loss_fn(head, normed, index):  # what HeadStage.forward does after the norm
        step = head.step_inputs
        loss_sum = head.loss_sum(normed, step.batches[int(index[0])].targets)
        step.sums.append(loss_sum.detach())
        return loss_sum * step.scale

    def pipeline_step(original):  # the engine is built before a plant goes in: set its loss_fn
        def planted(engine, *args):
            for head in (m for m in engine.module.modules() if isinstance(m, pipeline.HeadStage)):
                engine.module.loss_fn = lambda out, _labels, head=head: loss_fn(head, *out)
            return original(engine, *args)
        return planted

    with contextlib.ExitStack() as stack:
        stack.enter_context(contextmanager(_patched)(pipeline.HeadStage, "forward",
                                                     lambda f: head_output))
        stack.enter_context(contextmanager(_patched)(train_step, "_pipeline_step", pipeline_step))
        yield


# ------------- data parallel: the optimizer, the targets, the encoder pool (tests/dist/test_parity.py)
@plant("weight_decay_dropped", "the DeepSpeed config leaves train.weight_decay out of the "
       "optimizer (weight decay 0)", "dp")
def _weight_decay_dropped(rank: int):
    from ds_omni.train import ds_config

    def no_decay(out, *args):
        out["optimizer"]["params"]["weight_decay"] = 0.0
        return out
    yield from _on_result(ds_config, "derive_ds_config", no_decay)


@plant("lr_schedule_late", "the LR schedule runs one step late (step k at the scheduler's "
       "iteration k - 1: `align_lr_schedule` left out)", "dp")
def _lr_schedule_late(rank: int):
    from ds_omni.train import setup
    yield from _patched(setup, "align_lr_schedule", lambda f: lambda engine: None)


@plant("placeholders_as_targets", "the sample processor trains on image placeholder tokens "
       "(their loss mask set): put in the reference too, which must still see it", "dp")
def _placeholders_as_targets(rank: int):
    from ds_omni.data.processing import SampleProcessor

    def trained(tokenized, processor, segments, items, *args, **kwargs):
        ids, mask, ordered, items_end = tokenized
        placeholder = {t for enc, its in items.items() for k, it in enumerate(its)
                       for t in processor.item_processors[enc].tokens_at(it, k)}
        return ids, [m or t in placeholder for t, m in zip(ids, mask)], ordered, items_end
    yield from _on_result(SampleProcessor, "_tokenize", trained)


@plant("pool_wrong_rank", "the encoder pool files the rows a rank receives under the wrong "
       "sender (the senders' blocks in reverse rank order): rows encoded on one rank land at "
       "the placeholders of items encoded on another", "dp")
def _pool_wrong_rank(rank: int):
    import dataclasses
    from ds_omni.parallelize.encoder_pool import PoolPlan

    def reversed_senders(honest, *args):
        blocks, at = [], 0
        for n in honest.recv_counts:
            blocks.append(honest.recv_positions[at:at + n])
            at += n
        return dataclasses.replace(honest, recv_positions=[
            p for block in reversed(blocks) for p in block])
    yield from _on_result(PoolPlan, "reshard", reversed_senders)


# ------------------------------------------ pipeline, "uniform" placement (tests/dist/pipeline.py)
@plant("skip_encoder_broadcast", "after the optimizer step, stage 0 does not broadcast the "
       "encoder parameters it owns (nor do the others receive them): stage 1's replicas go "
       "stale", "pp")
def _skip_encoder_broadcast(rank: int):
    from ds_omni.parallelize.joint import EncoderShards

    def make(broadcast):
        def planted(shards):
            buckets = shards._buckets
            shards._buckets = lambda: [(o, b) for o, b in buckets() if o != 0]
            try:
                broadcast(shards)
            finally:
                del shards._buckets
        return planted
    yield from _patched(EncoderShards, "broadcast_params", make)


@plant("grad_norm_replicas_twice", "the encoder gradients are summed onto every stage "
       "(all-reduce) instead of their owner alone, and the replicas keep theirs: DeepSpeed's "
       "gradient norm counts the encoder parameters stage 1 owns twice", "pp")
def _grad_norm_replicas_twice(rank: int):
    import torch
    import torch.distributed as dist
    from ds_omni.parallelize import joint

    def planted(shards):
        for _, bucket in shards._buckets():
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # [E]
            dist.all_reduce(flat, group=shards.group)
            joint._unflatten_into(flat, [p.grad for p in bucket])
    yield from _patched(joint.EncoderShards, "reduce_grads", lambda f: planted)


# ------------------------------------------ tp x sp (tests/dist/test_tensor_parallel.py, 4 ranks)
@plant("seq_data_across_tp", "under tp x sp the sequence x data group is every rank of the "
       "stage (across the TP ranks, as without tp) instead of the dp x sp ranks of one TP rank",
       "tp_sp")
def _seq_data_across_tp(rank: int):
    from ds_omni.parallel.plan import ParallelPlan

    def planted(plan):
        return [[r for r in range(plan.world_size) if plan.coords(r).pp_stage == stage]
                for stage in range(plan.pp)]
    yield from _patched(ParallelPlan, "seq_data_group_ranks", lambda f: planted)


# ----------------------------------------------------- tensor parallel (tests/dist/test_tensor_parallel.py)
@plant("tp_bias_twice", "each column-parallel AutoTP layer adds its bias shard twice",
       "tp_slow")
def _tp_bias_twice(rank: int):
    from deepspeed.module_inject.layers import LinearLayer

    def bias_again(out, layer, *args):
        return out if layer.bias is None else out + layer.bias
    yield from _on_result(LinearLayer, "forward", bias_again)


@plant("tp_input_grad_not_summed", "the column-parallel layers' input gradient is not summed "
       "over the TP ranks (each rank keeps its own part)", "tp")
def _tp_input_grad_not_summed(rank: int):
    from deepspeed.module_inject import layers

    def make(backward):
        return staticmethod(lambda ctx, grad_output: (None, grad_output))
    yield from _patched(layers.ColumnParallel, "backward", make)


@plant("tp_encoder_grad_not_summed", "the encoders' parameter gradients are not summed over the "
       "TP ranks (each keeps the part of the items it encoded)", "tp")
def _tp_encoder_grad_not_summed(rank: int):
    from ds_omni.parallelize.tp_encoders import TPEncoders
    yield from _patched(TPEncoders, "sum_grads_over_tp", lambda f: lambda self, encoders: 0)


@plant("tp_gather_grad_summed", "the TP gather's backward sums the embedding rows' gradient over "
       "the TP ranks (it is already whole on each)", "tp_slow")
def _tp_gather_grad_summed(rank: int):
    from ds_omni.parallel.tp_encode import GatherTPRows

    def make(backward):
        # the sum of a gradient that is the same on every TP rank, without the all-reduce (a
        # rank whose rows need no gradient never runs this backward: no collective can be here)
        def planted(ctx, grad):
            return backward(ctx, grad * len(ctx.plan.rank_rows))
        return staticmethod(planted)
    yield from _patched(GatherTPRows, "backward", make)


# ------------------------------------------------ expert parallel (tests/dist/test_expert_parallel.py)
@plant("ep_wrong_rank", "AutoEP's router sends each token's picks to the expert ep ranks over "
       "(expert e -> e + E/ep): an expert's tokens reach the wrong rank", "ep")
def _ep_wrong_rank(rank: int):
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    def other_rank(routed, router, *args, **kwargs):
        from deepspeed.moe.ep_count import count_tokens_per_expert
        scores, picks, _ = routed
        picks = (picks + router.num_experts // 2) % router.num_experts  # ep=2: the other rank's
        return scores, picks, count_tokens_per_expert(picks, router.num_experts)
    yield from _on_result(TokenChoiceTopKRouter, "forward", other_rank)


@plant("aux_loss_dropped", "the MoE auxiliary load-balancing loss is left out of the loss", "ep")
def _aux_loss_dropped(rank: int):
    from ds_omni.model import omni
    yield from _patched(omni, "router_aux_sum", lambda f: lambda *a: 0.0)


@plant("moe_aux_not_reduced_over_sp", "under SP each rank prices its shard of a sample as if "
       "it were the whole sample (the MoE aux loss's statistics are not summed over the row's "
       "group) and adds that aux whole", "ep_sp")
def _moe_aux_not_reduced_over_sp(rank: int):
    import torch.distributed as dist
    from ds_omni.model import moe_aux

    def planted(aux, logits, cu_seqlens, targets, group):
        offset = dist.get_rank(group) * logits[0].shape[0]
        return moe_aux.aux_from_stats(
            aux, moe_aux.shard_stats(aux, logits, cu_seqlens, targets, offset))
    yield from _patched(moe_aux, "sp_aux_sum", lambda f: planted)


# --------------------------------------------------- the step simulator (tests/unit/sim/test_sim_comm.py)
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
    yield from _patched(comm, "all_to_all_pairs", even)


@plant("sim_ep_no_backward", "the simulator's expert-parallel all-to-alls are priced in the "
       "forward pass only (backward's dispatch / combine, and the recompute, forgotten)",
       "sim_ep_a2a_measured")
def _sim_ep_no_backward(rank: int):
    from ds_omni.sim import model_parallel

    def make(run_ep):
        return lambda step, tokens, backward: None if backward else run_ep(step, tokens, backward)
    yield from _patched(model_parallel, "run_ep", make)


# ----------------------------------- the simulator's link calibration (tests/unit/sim/test_calibrate_comm.py)
@plant("comm_fit_no_latency", "the alpha-beta fit sees no latency term (every collective charged "
       "its bytes only)", "calibrate_comm")
def _comm_fit_no_latency(rank: int):
    from ds_omni.sim.calibrate_comm import Timing
    yield from _patched(Timing, "terms", lambda f: lambda self: (0.0, f(self)[1]))

# ------------------------------------------------------ the plan search (tests/unit/sim/test_sim_search.py)
@plant("search_bound_too_tight", "the plan search's lower bound overstated threefold, so it prunes "
       "plans that would have ranked", "sim_search")
def _search_bound_too_tight(rank: int):
    from ds_omni.sim import bounds
    yield from _patched(bounds, "refined_bound", lambda f: lambda *a: 3 * f(*a))



# ------------------------------------------------ the simulator under tp (tests/unit/sim/test_sim_tp.py)
@plant("sim_tp_encodes_everything", "the simulator has every TP rank encode the whole row again "
       "(the split of `plan_tp_encode` ignored)", "sim_tp")
def _sim_tp_encodes_everything(rank: int):
    from ds_omni.sim import encode_sim
    yield from _patched(encode_sim, "_tp_apart", lambda f: lambda rows, layout, world, tp, order:
                        encode_sim._per_tp_rank(rows, layout, world, "replicated", False, {},
                                                order, tp))


@plant("sim_ulysses_backward_x2", "the simulator charges Ulysses' backward twice the forward's "
       "all-to-all bytes (its model before the measured run)", "sim_a2a_measured")
def _sim_ulysses_backward_x2(rank: int):
    from ds_omni.sim import step
    yield from _patched(step, "llm_sp_seconds", lambda f: lambda st, tok, g, ranks, backward,
                        tp=1: f(st, tok, g, ranks, backward, tp)
                        + (f(st, tok, g, ranks, backward, tp) if backward else 0.0))

# ------------------------------------------- the simulator's fast paths (tests/unit/sim/test_sim_fast_paths.py)
@plant("sim_reshard_shard_off_by_one", "the simulator's fast resharding charge counts a row's "
       "rows against shards one token too long (not `plan_reshard`'s ceil(T / g))",
       "sim_fast_paths")
def _sim_reshard_shard_off_by_one(rank: int):
    from ds_omni.sim import encode_sim
    yield from _patched(encode_sim, "_charge", lambda f: lambda placed, shard, *a:
                        f(placed, shard + 1, *a))


@plant("sim_memo_one_direction", "the simulator's memo of a placement prices the encoders' "
       "Ulysses backward as its forward (the direction left out of the memo's key)",
       "sim_fast_paths")
def _sim_memo_one_direction(rank: int):
    from ds_omni.sim import step
    yield from _patched(step, "_encoder_sp_groups", lambda f: lambda st, work, backward:
                        f(st, work, False))


# ------------------------------------------- the simulator's encoder pool (tests/unit/sim/test_sim_pool.py)
@plant("sim_pool_plan_free", "the simulator charges the encoder pool's step planning nothing "
       "(its metadata all-gather and `plan_round` over every rank's items forgotten)", "sim_pool")
def _sim_pool_plan_free(rank: int):
    from ds_omni.sim import step
    yield from _patched(step, "plan_pool", lambda f: lambda st: None)


# ------------------------------------ HF's experts' load at ep=1 (tests/unit/parallelize/test_expert_parallel.py)
@plant("hf_experts_count_first_pick", "HF's expert modules count each token's first pick only "
       "(top-1 of its top-k)", "hf_expert_count")
def _hf_experts_count_first_pick(rank: int):
    from ds_omni.parallelize import expert_parallel
    yield from _patched(expert_parallel, "_count_picks", lambda f: lambda m, args, kwargs: f(
        m, (args[0], args[1][:, :1], *args[2:]), kwargs))


# ------------------------------------------------------ the watchdog (tests/unit/train/test_watchdog.py)
@plant("watchdog_explain_at_once", "after a failed collective, the watchdog names a peer only "
       "from what it had seen when the error came (no fresh read, no second look)", "watchdog")
def _watchdog_explain_at_once(rank: int):
    from ds_omni.train.watchdog import Watchdog
    yield from _patched(Watchdog, "explain", lambda f: lambda self, error: self.diagnose())


# ------------------------------------------------ the loader process (tests/dist/test_loader_process.py)
@plant("loader_process_stale_position", "the loader process sends back, with each step, the "
       "loader's position before that step instead of after it (a resume reads it again)",
       "loader_process")
def _loader_process_stale_position(rank: int):
    from ds_omni.data import loader_serve
    yield from _patched(loader_serve, "serve", lambda f: _stale_serve)


def _stale_serve(*args) -> None:
    """The loader process's loop with the plant in (it runs in a spawned process of its own, so
    the trainer's patch names this function, which the loader process imports)."""
    from ds_omni.data import loader_serve
    loader_serve.sent_position = lambda made: made.before
    loader_serve.serve(*args)


@plant("early_reply_dropped", "a request made while the reply to a \"next\" sent early is "
       "pending drops that reply, also where the request leaves the loader where it is (a "
       "state_dict for a checkpoint): the step made for it is lost", "early_reply")
def _early_reply_dropped(rank: int):
    from ds_omni.data.loader_process import LoaderProcess
    yield from _patched(LoaderProcess, "_ask", lambda f: lambda self, op, *args, moves=False:
                        f(self, op, *args, moves=True))


# --------------------------------- the simulator's compute calibration (tests/unit/train/test_calibrate_rate.py)
@plant("rate_fit_no_overhead", "the FLOP/s fit leaves out the fixed cost of a micro-batch (all of "
       "its seconds charged to FLOPs)", "calibrate_rate")
def _rate_fit_no_overhead(rank: int):
    import numpy as np
    from ds_omni.train import calibrate

    def make(nnls):
        return lambda a, y: np.array([nnls(a[:, :1], y)[0], 0.0])
    yield from _patched(calibrate, "nnls", make)


# ------------------------------------- the loader process's hand-over (tests/unit/data/test_handover.py)
@plant("handover_no_copy_out", "the trainer's tensors view the loader process's shared-memory "
       "slot instead of a copy of it: the next step's hand-over overwrites a step still held",
       "handover")
def _handover_no_copy_out(rank: int):
    from ds_omni.data import handover
    yield from _patched(handover.Receiver, "_copy_out",
                        lambda f: lambda self, written, end: self.shm.buf[:end])
