"""Planted errors of expert parallelism (tests/dist/test_expert_parallel.py,
test_expert_sequence_parallel.py; tests/unit/parallelize/test_expert_parallel.py)."""

from tests.plants.registry import on_result, patched, plant


# --------------------------------------------- expert parallel (tests/dist/test_expert_parallel.py)
@plant("ep_wrong_rank", "AutoEP's router sends each token's picks to the expert ep ranks over "
       "(expert e -> e + E/ep): an expert's tokens reach the wrong rank", "ep")
def _ep_wrong_rank(rank: int):
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    def other_rank(routed, router, *args, **kwargs):
        from deepspeed.moe.ep_count import count_tokens_per_expert
        scores, picks, _ = routed
        picks = (picks + router.num_experts // 2) % router.num_experts  # ep=2: the other rank's
        return scores, picks, count_tokens_per_expert(picks, router.num_experts)
    yield from on_result(TokenChoiceTopKRouter, "forward", other_rank)


@plant("aux_loss_dropped", "the MoE auxiliary load-balancing loss is left out of the loss", "ep")
def _aux_loss_dropped(rank: int):
    from ds_omni.model import omni
    yield from patched(omni, "router_aux_sum", lambda f: lambda *a: 0.0)


@plant("moe_aux_not_reduced_over_sp", "under SP each rank prices its shard of a sample as if "
       "it were the whole sample (the MoE aux loss's statistics are not summed over the row's "
       "group) and adds that aux whole", "ep_sp")
def _moe_aux_not_reduced_over_sp(rank: int):
    import torch.distributed as dist
    from ds_omni.model import moe_aux

    def planted(aux, logits, cu_seqlens, targets, group, index=None):
        offset = dist.get_rank(group) * logits[0].shape[0]
        return moe_aux.aux_from_stats(
            aux, moe_aux.shard_stats(aux, logits, cu_seqlens, targets, offset))
    yield from patched(moe_aux, "sp_aux_sum", lambda f: planted)


# ------------------------- ep x cp (tests/dist/test_context_parallel_composed.py, "ep_cp")
@plant("moe_aux_contiguous_under_ring", "under parallel.cp each rank's aux statistics are "
       "summed as if it held a contiguous shard of the row (its tokens' samples read from "
       "positions [r S, (r + 1) S), not from the ring's zigzag index)", "ep_cp")
def _moe_aux_contiguous_under_ring(rank: int):
    from ds_omni.model import moe_aux

    def make(original):
        return lambda aux, logits, cu_seqlens, targets, group, index=None: original(
            aux, logits, cu_seqlens, targets, group)
    yield from patched(moe_aux, "sp_aux_sum", make)


# ---------------------- HF's experts' load at ep=1 (tests/unit/parallelize/test_expert_parallel.py)
@plant("hf_experts_count_first_pick", "HF's expert modules count each token's first pick only "
       "(top-1 of its top-k)", "hf_expert_count")
def _hf_experts_count_first_pick(rank: int):
    from ds_omni.parallelize import expert_parallel
    yield from patched(expert_parallel, "_count_picks", lambda f: lambda m, args, kwargs: f(
       m, (args[0], args[1][:, :1], *args[2:]), kwargs))


# ------------------------------------------ pp x ep (tests/dist/test_expert_parallel.py, "ep_pp")
@plant("pp_ep_wrong_group_rank", "inside each pipeline stage's EP group the ranks' experts are "
       "swapped (EP rank r holds EP rank ep - 1 - r's experts): an expert's tokens reach the "
       "stage group's rank that holds another expert", "ep_pp")
def _pp_ep_wrong_group_rank(rank: int):
    from deepspeed.module_inject.auto_ep import AutoEP

    def make(original):
        def planted(self, specs, ep_size, ep_rank, *args, **kwargs):
            return original(self, specs, ep_size, ep_size - 1 - ep_rank, *args, **kwargs)
        return planted
    yield from patched(AutoEP, "replace_moe_layers", make)


@plant("pp_stage_aux_dropped", "the first pipeline stage adds none of its MoE layers' router "
       "statistics to the carried aux loss (one stage's aux loss dropped)", "ep_pp")
def _pp_stage_aux_dropped(rank: int):
    from ds_omni.parallelize.pipeline_moe import AuxCarry
    first_stage = rank < 2  # pp2 x dp2: ranks 0 and 1 run stage 0
    yield from patched(AuxCarry, "add", lambda f: (lambda self, carry, *a: carry)
                       if first_stage else f)


@plant("pp_carry_backward_dropped", "a stage's outputs' one backward (`one_backward`) runs only "
       "the hidden states': the carried router probabilities' gradient never reaches the first "
       "stage's routers", "ep_pp")
def _pp_carry_backward_dropped(rank: int):
    from ds_omni.parallelize import pipeline_moe
    yield from patched(pipeline_moe, "run_gathered",
                       lambda f: lambda tensors, grads: f(tensors[:1], grads[:1]))


# ---------- ep x tp, the fold's gradient corrections (tests/dist/test_expert_parallel.py, "ep_tp")
@plant("ep_tp_experts_not_divided", "beside tp the experts' gradients are not divided by tp (the "
       "folded all-gather's backward hands each rank tp x its assignments' gradient)", "ep_tp")
def _ep_tp_experts_not_divided(rank: int):
    from ds_omni.parallelize import expert_folding

    def make(original):
        def planted(layer, tp_group, tp):
            original(layer, tp_group, tp)
            for p in layer.experts.parameters():  # runs after the division: undoes it
                p.register_hook(lambda grad: grad * tp)
        return planted
    yield from patched(expert_folding, "_correct_grads", make)


@plant("ep_tp_router_not_averaged", "beside tp the router's gradient is not averaged over the TP "
       "group: each TP rank keeps its own (its share of the assignments, tp x)", "ep_tp")
def _ep_tp_router_not_averaged(rank: int):
    from ds_omni.parallelize import expert_folding

    def planted(layer, tp_group, tp):  # the experts' division alone
        for p in layer.experts.parameters():
            p.register_hook(lambda grad: grad / tp)
    yield from patched(expert_folding, "_correct_grads", lambda f: planted)


# ----------------------------------- pp x sp x ep (tests/dist/test_expert_parallel.py, "ep_pp_sp")
@plant("pp_sp_aux_not_summed", "under pp x sp the last stage forms each sample's aux loss from "
       "its own SP shard's carried statistics (not summed over the row's SP group)", "ep_pp_sp")
def _pp_sp_aux_not_summed(rank: int):
    from ds_omni.parallelize import pipeline_moe
    yield from patched(pipeline_moe, "sum_over",
                       lambda f: lambda group, probs, counts, trained: (probs, counts, trained))
