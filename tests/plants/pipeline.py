"""Planted errors of the pipeline cases of the parity launch (tests/dist/pipeline.py)."""

from tests.plants.registry import patched, plant


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
    yield from patched(EncoderShards, "broadcast_params", make)


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
    yield from patched(joint.EncoderShards, "reduce_grads", lambda f: planted)


# ----------------------- pp x tp, pp x sp (tests/dist/test_pipeline_composed.py, 4 ranks: pp2)
@plant("pp_tp_grad_not_summed", "stage 0's column-parallel AutoTP layers do not sum their input "
       "gradient over the TP ranks (each keeps its own part); stage 1's do", "pp_composed")
def _pp_tp_grad_not_summed(rank: int):
    if rank >= 2:  # stage 1 of the 4-rank pp2 x tp2 launch: honest
        yield
        return
    from deepspeed.module_inject import layers
    yield from patched(layers.ColumnParallel, "backward",
                       lambda f: staticmethod(lambda ctx, grad_output: (None, grad_output)))


@plant("pp_sp_wrong_peer", "each SP shard of stage 0 sends its activations to the other SP "
       "shard of stage 1 (and gets its gradients back from it)", "pp_composed")
def _pp_sp_wrong_peer(rank: int):
    from deepspeed.runtime.pipe import p2p

    class Shifted:
        """The engine's grid, whose peer on another stage is one data-axis place on: stage s
        sends to data rank d + (t - s) of stage t, which receives from d (pp2 x sp2, dp=1: the
        other SP shard)."""

        def __init__(self, grid):
            self.grid = grid

        def __getattr__(self, attr):
            return getattr(self.grid, attr)

        def stage_to_global(self, stage_id, **kwargs):
            grid = self.grid
            me = grid._topo.get_coord(grid.global_rank)
            data = (me.data + stage_id - me.pipe) % grid.data_parallel_size
            return grid._topo.get_rank(**{**me._asdict(), "pipe": stage_id, "data": data})

    def make(init):
        def planted(grid):
            init(grid)
            p2p._grid = Shifted(grid)
        return planted
    yield from patched(p2p, "init_process_groups", make)


# ------------------------- deepstack levels over the stages (tests/dist/test_pipeline_deepstack.py)
@plant("pp_deepstack_level_dropped", "stage 1 receives deepstack level 0 as zeros (the level "
       "dropped at the stage boundary; the others arrive)", "pp_deepstack")
def _pp_deepstack_level_dropped(rank: int):
    if rank == 0:  # stage 0 of the 2-rank pp2 launch: honest
        yield
        return
    import torch
    from ds_omni.parallelize.pipeline_deepstack import DeepstackCarry

    def make(split):
        def planted(self, layer, carry):
            deep, rest = split(self, layer, carry)
            if deep is None:
                return deep, rest
            keep = torch.ones(deep.levels.shape[1], 1, dtype=deep.levels.dtype)
            keep[0] = 0
            return deep._replace(levels=deep.levels * keep.to(deep.levels.device)), rest
        return planted
    yield from patched(DeepstackCarry, "split", make)

# ------------------------------------ pipeline, "bubbles" placement (tests/dist/pipeline.py)
@plant("bubble_rows_late", "stage 0 receives each micro-batch's encoder rows after the forward "
       "that needed them (an item encoded after its micro-batch needed it): the forward reads "
       "rows not there yet", "pp")
def _bubble_rows_late(rank: int):
    from deepspeed.runtime.pipe import schedule
    from ds_omni.parallelize import bubble_schedule

    def make(steps):
        def planted(self):
            late = []
            for cmds in steps(self):
                out = []
                for cmd in cmds:
                    if isinstance(cmd, bubble_schedule.RecvRows):
                        late.append(cmd)
                        continue
                    out.append(cmd)
                    if isinstance(cmd, schedule.ForwardPass):
                        out += late
                        late = []
                yield out
        return planted
    yield from patched(bubble_schedule.BubbleSchedule, "steps", make)


@plant("bubble_backward_skipped", "the encoder backward of the items placed in the cool-down's "
       "idle slots is skipped (their gradients still received): those items never train the "
       "encoders", "pp")
def _bubble_backward_skipped(rank: int):
    from ds_omni.parallelize import bubble_schedule

    def make(backward):
        def planted(enc, items, clock):
            hidden = [i for i in items if enc.plan.hidden_backward[i]]
            backward(enc, [i for i in items if i not in hidden], clock)
            for i in hidden:  # received, then dropped
                if enc.stage != 0:
                    buf = bubble_schedule.torch.empty_like(enc.outputs[i])
                    bubble_schedule.dist.irecv(buf, enc._peer(0), group=enc.group).wait()
            enc.backwarded.update(hidden)
        return planted
    yield from patched(bubble_schedule.BubbleEncoding, "backward", make)


# ---------------- pp x tp, pp x sp under "bubbles" (tests/dist/test_pipeline_composed.py, slow)
def _bubble_rows_rank0_only(rank: int):
    """Stage 0's second rank (global rank 1 of the 4-rank pp2 launch: TP rank 1, or SP shard 1)
    receives the rows later stages encode into a scratch buffer: its own are left zero, as
    when a stage's rows go to one peer of stage 0 alone."""
    if rank != 1:
        yield
        return
    from ds_omni.parallelize import bubble_schedule

    def make(recv_rows):
        def planted(enc, micro):
            rows = enc.rows
            enc.rows = bubble_schedule.torch.zeros_like(rows)
            try:
                recv_rows(enc, micro)
            finally:
                enc.rows = rows
        return planted
    yield from patched(bubble_schedule.BubbleEncoding, "recv_rows", make)


plant("bubble_rows_tp0_only", "under pp2 x tp2 \"bubbles\", only TP rank 0 of stage 0 gets the "
      "rows stage 1 encodes (TP rank 1's stay zero)", "pp_bubbles_composed")(
    _bubble_rows_rank0_only)
plant("bubble_rows_sp0_only", "under pp2 x sp2 \"bubbles\", only SP shard 0 of stage 0 gets the "
      "rows its stage 1 encodes (shard 1's stay zero)", "pp_bubbles_composed")(
    _bubble_rows_rank0_only)


# ----------------------- "auto" choosing "bubbles" (tests/unit/parallel/test_bubbles.py)
@plant("auto_calls_unpriced", "\"auto\" models the bubbles schedule's encoder calls and "
       "messages as free (its model before the quiet benchmark run)", "bubbles_auto")
def _auto_calls_unpriced(rank: int):
    from ds_omni.parallel import bubbles

    def make(call_costs):
        return lambda cost, encoder, overhead: call_costs(cost, encoder, bubbles.CallOverhead())
    yield from patched(bubbles, "call_costs", make)


@plant("auto_mix_blind", "\"auto\"'s typical step has one item a sample whatever the data's "
       "mix", "bubbles_auto")
def _auto_mix_blind(rank: int):
    from ds_omni.parallel import bubbles

    def make(typical_items):
        return lambda cost, micro_batches, samples, items_per_sample=None: typical_items(
            cost, micro_batches, samples, None)
    yield from patched(bubbles, "typical_items", make)


# ---------------------------- the encoder pool under pp (tests/dist/test_pipeline_composed.py)
@plant("pp_pool_wrong_rank", "under pp (\"uniform\"), stage 0's pool files the rows a rank "
       "receives under the wrong sender (reversed rank order): rows that rank 1's column of "
       "stages encoded land at the placeholders of rank 0's own items", "pp_pool")
def _pp_pool_wrong_rank(rank: int):
    from tests.plants.parity import _pool_wrong_rank
    yield from _pool_wrong_rank(rank)


@plant("pp_pool_bubble_rows_unexchanged", "under pp \"bubbles\" with the pool, the rows stage "
       "1 encodes reach rank 1 (stage 0 of the text-only column), which puts zeros on the pool's "
       "exchange in their place: rank 0's placeholders get no rows from rank 1's column",
       "pp_pool")
def _pp_pool_bubble_rows_unexchanged(rank: int):
    yield from _bubble_rows_rank0_only(rank)


# ------------------- "auto" beside sp and tp (tests/unit/parallelize/test_auto_placement.py)
@plant("auto_shard_items_whole", "under sp \"auto\"'s typical step gives each SP shard's "
       "pipeline the whole row's items (its reshard plan's half ignored)", "auto_composed")
def _auto_shard_items_whole(rank: int):
    from ds_omni.parallelize import pipeline

    def make(typical_step):
        def planted(cfg, plan, cost, stages):
            times, micro, samples, items, overhead = typical_step(cfg, plan, cost, stages)
            return times, micro, samples, {k: v * plan.sp for k, v in items.items()}, overhead
        return planted
    yield from patched(pipeline, "typical_step", make)


@plant("auto_stages_whole_row", "\"auto\" prices each stage at its whole row's time on one "
       "rank, not a rank's 1/(sp x tp) share", "auto_composed")
def _auto_stages_whole_row(rank: int):
    from ds_omni.parallelize import pipeline
    yield from patched(pipeline, "rank_stage_time", lambda f: lambda t, sp=1, tp=1: list(t))
