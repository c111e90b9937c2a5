"""Planted errors of ring attention (parallel.cp), caught in one process by the ring simulated
over its ranks against the SDPA path and by the zigzag layout's balance
(tests/unit/model/test_ring_attention.py: `test_plant_is_caught`)."""

from tests.plants.registry import patched, plant


@plant("ring_lse_merge_wrong", "the online-softmax merge adds a new block's output without its "
       "weight exp(lse_b - lse) (the running output is rescaled, the new one is not)", "ring")
def _ring_lse_merge_wrong(rank: int):
    import torch
    from ds_omni.model import ring_attention

    def merge(out, lse, out_b, lse_b):
        both = torch.logaddexp(lse, lse_b)
        return out * torch.exp(lse - both).transpose(0, 1)[..., None] + out_b, both
    yield from patched(ring_attention, "merge", lambda original: merge)


@plant("ring_step_skipped", "the ring stops one step short: the block of the rank after this "
       "one (the last to arrive) is never attended to", "ring")
def _ring_step_skipped(rank: int):
    import torch
    from ds_omni.model import ring_attention

    def make(original):
        def planted(self, step):
            got = original(self, step)
            return torch.zeros_like(got) if step and step == self.ring.size - 1 else got
        return planted
    yield from patched(ring_attention.RingSpec, "allowed", make)


@plant("ring_bwd_block_lse", "the ring's backward runs each block's kernel with that block's own "
       "log-sum-exp instead of the final one over the whole ring", "ring")
def _ring_bwd_block_lse(rank: int):
    from ds_omni.model import ring_attention

    def planted(kernel, dout, q, k, v, out, lse, allowed, scaling):
        _, block_lse = kernel.forward(q, k, v, allowed, scaling)
        return kernel.backward(dout, q, k, v, out, block_lse, allowed, scaling)
    yield from patched(ring_attention, "_block_grads", lambda original: planted)


@plant("ring_dkv_not_home", "the ring's backward never sends the key/value gradient accumulators "
       "home after the last step (each rank keeps the next rank's)", "ring")
def _ring_dkv_not_home(rank: int):
    from ds_omni.model import ring_attention

    def make(original):
        return lambda dkv, ring, last: dkv if last else original(dkv, ring, last)
    yield from patched(ring_attention, "_pass_grads", make)


@plant("zigzag_chunk_wrong_rank", "each sample's tail chunks go to the ranks in order (chunk k "
       "to rank k mod cp) instead of mirrored: the last rank gets the most causal work", "ring")
def _zigzag_chunk_wrong_rank(rank: int):
    from ds_omni.parallel import zigzag
    yield from patched(zigzag, "chunk_owner", lambda original: lambda chunk, cp: chunk % cp)


@plant("ring_causal_local", "the causal triangle is applied by each block's local slot (as if "
       "every received block were the rank's own) instead of by row position", "ring")
def _ring_causal_local(rank: int):
    import torch
    from ds_omni.model import ring_attention

    def make(original):
        def planted(q_pos, k_pos, bounds, window=None, spans=None):
            local = torch.arange(len(k_pos))[None, :] <= torch.arange(len(q_pos))[:, None]
            same = (ring_attention._sample_of(q_pos, bounds)[:, None]
                    == ring_attention._sample_of(k_pos, bounds)[None, :])
            return local & same  # the sample rule kept, causality by slot
        return planted
    yield from patched(ring_attention, "ring_mask", make)


@plant("block_ring_transposed", "a per-sequence block past the heads builds its rings from "
       "consecutive ranks and its Ulysses groups across them (the split's Ulysses part ignored), "
       "while the loader cuts the row with the Ulysses ranks consecutive", "ring_block")
def _block_ring_transposed(rank: int):
    from ds_omni.parallel.plan import ParallelPlan

    def make(original):
        def planted(self, members):
            ulysses, rings = original(self, members)
            return rings, ulysses  # same sizes here (2 x 2): the groups swapped
        return planted
    yield from patched(ParallelPlan, "block_ring_ranks", make)


@plant("ring_varlen_window_shifted", "the CUDA ring kernel's varlen plan gives flash a sliding "
       "window one key wider than the mask's (window_size_left + 1)", "ring")
def _ring_varlen_window_shifted(rank: int):
    import torch
    from ds_omni.model import ring_varlen

    def make(original):
        def planted(lo, hi, starts):
            found = original(lo, hi, starts)
            if found is None:
                return None
            L, nk, nq, left, right, run = found
            return L, nk, nq, torch.where(left >= 0, left + 1, left), right, run
        return planted
    yield from patched(ring_varlen, "_run_windows", make)


@plant("ring_across_tp", "under tp x cp each ring pairs sequence ranks of different TP ranks "
       "(its k/v blocks carry another TP shard's heads) instead of the sequence ranks of one "
       "TP rank", "tp_cp")
def _ring_across_tp(rank: int):
    from ds_omni.parallel.plan import ParallelPlan

    def make(original):
        def planted(self):
            rings = original(self)  # tp2 x cp2: [0, 2], [1, 3] -> [0, 3], [1, 2]
            return [[ring[0], rings[i ^ 1][1]] for i, ring in enumerate(rings)]
        return planted
    yield from patched(ParallelPlan, "cp_group_ranks", make)
