"""Planted errors of tensor parallelism's launches (tests/dist/test_tensor_parallel.py)."""

from tests.plants.registry import on_result, patched, plant


# ------------------------------- the TP group's reader (tests/dist/test_tensor_parallel.py)
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
    yield from on_result(shared_read, "peer_view", negated)


# ------------------------------------------ tp x sp (tests/dist/test_tensor_parallel.py, 4 ranks)
@plant("seq_data_across_tp", "under tp x sp the sequence x data group is every rank of the "
       "stage (across the TP ranks, as without tp) instead of the dp x sp ranks of one TP rank",
       "tp_sp")
def _seq_data_across_tp(rank: int):
    from ds_omni.parallel.plan import ParallelPlan

    def planted(plan):
        return [[r for r in range(plan.world_size) if plan.coords(r).pp_stage == stage]
                for stage in range(plan.pp)]
    yield from patched(ParallelPlan, "seq_data_group_ranks", lambda f: planted)


# --------------------------------------------- tensor parallel (tests/dist/test_tensor_parallel.py)
@plant("tp_bias_twice", "each column-parallel AutoTP layer adds its bias shard twice",
       "tp_slow")
def _tp_bias_twice(rank: int):
    from deepspeed.module_inject.layers import LinearLayer

    def bias_again(out, layer, *args):
        return out if layer.bias is None else out + layer.bias
    yield from on_result(LinearLayer, "forward", bias_again)


@plant("tp_input_grad_not_summed", "the column-parallel layers' input gradient is not summed "
       "over the TP ranks (each rank keeps its own part)", "tp")
def _tp_input_grad_not_summed(rank: int):
    from deepspeed.module_inject import layers

    def make(backward):
        return staticmethod(lambda ctx, grad_output: (None, grad_output))
    yield from patched(layers.ColumnParallel, "backward", make)


@plant("tp_encoder_grad_not_summed", "the encoders' parameter gradients are not summed over the "
       "TP ranks (each keeps the part of the items it encoded)", "tp")
def _tp_encoder_grad_not_summed(rank: int):
    from ds_omni.parallelize.tp_encoders import TPEncoders
    yield from patched(TPEncoders, "sum_grads_over_tp", lambda f: lambda self, encoders: 0)


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
    yield from patched(GatherTPRows, "backward", make)


# ------------------- tp x max_sequence_sp (tests/dist/test_tp_per_sequence.py, 4 ranks)
@plant("block_across_tp", "under tp a per-sequence block is drawn across TP ranks (member d of "
       "the block on TP rank t + d) instead of over the data-parallel ranks of one TP rank: its "
       "Ulysses all-to-all mixes the heads of different TP shards", "tp_msp")
def _block_across_tp(rank: int):
    from ds_omni.parallel.plan import ParallelPlan, RankCoords

    def planted(plan, start, size):
        return [[plan.rank_of(RankCoords(p, d, 0, (t + d - start) % plan.tp))
                 for d in range(start, start + size)] for p in range(plan.pp)
                for t in range(plan.tp)]
    yield from patched(ParallelPlan, "sequence_block_ranks", lambda f: planted)


@plant("block_encoder_grad_summed_over_tp", "under tp the encoders' gradients of a per-sequence "
       "block's row (whose items every TP rank encoded alike) are summed over the TP ranks too, "
       "as a row split over them would be (tp times too large)", "tp_msp")
def _block_encoder_grad_summed_over_tp(rank: int):
    from ds_omni.parallelize.tp_encoders import TPEncoders

    def always_apart(cls_attr):
        return property(lambda self: True, lambda self, value: None)
    yield from patched(TPEncoders, "apart", always_apart)


# -------------- tp x sp x encoder_pool (tests/dist/test_tensor_parallel.py, 8 ranks)
@plant("pool_encoder_grad_summed_over_tp", "under tp x sp with the encoder pool the encoders' "
       "gradients are summed over the TP ranks (as if each had encoded its own items), though "
       "every TP rank pooled and encoded the same ones (tp times too large)", "tp_sp_pool")
def _pool_encoder_grad_summed_over_tp(rank: int):
    import torch
    import ds_omni.parallelize as parallelize

    def make(apply_plan):
        def planted(model, **kwargs):
            out = apply_plan(model, **kwargs)
            group = kwargs.get("tp_group")
            for p in model.encoders.parameters():
                if p.requires_grad and group is not None:
                    p.register_hook(lambda g: _summed(torch, g, group))
            return out
        return planted
    yield from patched(parallelize, "apply_plan", make)


def _summed(torch, grad, group):
    grad = grad.contiguous()
    torch.distributed.all_reduce(grad, group=group)
    return grad


# ------------------------- Qwen3-VL's borrowed plan (tests/dist/test_tensor_parallel_qwen3_vl.py)
@plant("tp_qk_norm_grad_not_summed", "AutoTP's hooks that sum the q/k norms' gradients over the "
       "TP ranks are never registered (each rank keeps the part from its own heads)",
       "tp_qwen3_vl")
def _tp_qk_norm_grad_not_summed(rank: int):
    from deepspeed.module_inject.auto_tp import AutoTP
    yield from patched(AutoTP, "register_replicated_grad_hooks", lambda f: lambda self, m: None)
