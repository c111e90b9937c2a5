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
