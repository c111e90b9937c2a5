"""An MoE LLM's experts expert-parallel beside a tensor-parallel backbone (parallel.ep x tp).

Megatron's expert-data-parallel layout, as DeepSpeed 0.19.8 "folds" it
(`deepspeed.module_inject.auto_ep_folding`): attention and dense MLPs split over the TP group by
AutoTP's layers (`tensor_parallel.shard_backbone`, the HF plan without its expert entries), the
routed experts over EP groups of ep consecutive ranks of the stage's dp x tp ranks; the TP ranks
of a row, which hold the same tokens, each dispatch 1/tp of its token-expert assignments and
all-gather the outputs back (`AutoEPMoELayer`'s folded path). What DeepSpeed lacks, done here:
its engine folds only under its own `tensor_parallel.autotp_size` (which would shard the
encoders too) and refuses AutoEP beside a TP mpu; its AutoTP refuses the MoE families' HF plans.
So ds_omni builds DeepSpeed's EP and expert-data-parallel groups from the folding tables, swaps
the MoE blocks for AutoEP's layers bound to the fold, and applies the engine's folding gradient
corrections as hooks (router averaged over TP, experts divided by tp); the engine then finds
AutoEP's layers and reduces the experts over their expert-data-parallel groups as usual.
More: docs/parallelism.md, "Expert parallelism".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ds_omni.errors import ModelError


@dataclass(frozen=True)
class ExpertFold:
    """What `fold_experts` needs of the plan: ep x tp inside each pipeline stage."""

    ep: int
    tp: int
    pp: int
    world_size: int
    section: dict
    """DeepSpeed's `expert_parallel` section (`expert_parallel.autoep_section`)."""


def expert_fold_for(plan, tp_group, llm_config) -> ExpertFold | None:
    """The fold under parallel.ep > 1 with parallel.tp > 1, else None (AutoEP runs inside the
    engine, from the DeepSpeed config's section)."""
    if not plan.ep_enabled or tp_group is None:
        return None
    from ds_omni.parallelize.expert_parallel import autoep_section
    return ExpertFold(plan.ep, plan.tp, plan.pp, plan.world_size,
                      autoep_section(llm_config, plan.ep))


def fold_experts(model: nn.Module, fold: ExpertFold, tp_group) -> int:
    """Swap `model`'s MoE blocks for AutoEP's layers, folded over `tp_group`; returns how many.
    Every rank calls it (it makes DeepSpeed's expert groups: collective)."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.module_inject.auto_ep_folding import build_folding_spec
    spec = build_folding_spec(world_size=fold.world_size, pp_size=fold.pp, tp_size=fold.tp,
                              ep_size=fold.ep, mp_mode="tp")
    handles = _folding_groups(spec, tp_group)
    auto_ep = AutoEP(model, parse_autoep_config(fold.section))
    specs = auto_ep.ep_parser()
    if not specs:
        raise ModelError(f"parallel.ep={fold.ep}: DeepSpeed's AutoEP found no MoE block in the "
                         "backbone to split; set parallel.ep to 1")
    auto_ep.replace_moe_layers(specs, ep_size=fold.ep, ep_rank=dist.get_rank(handles.ep_group),
                               collect_sources=False)
    from ds_omni.parallelize.expert_parallel import autoep_layers
    layers = autoep_layers(model)
    for layer in layers.values():
        layer.set_deepspeed_parallelism(folding_group_handles=handles)
        _correct_grads(layer, tp_group, fold.tp)
        layer.ds_omni_fold_counts = {"forwards": 0, "assignments_local": 0,
                                     "assignments_total": 0}
        layer.register_forward_hook(_count_fold)
    return len(layers)


def _count_fold(layer: nn.Module, _args, _out) -> None:
    """Add the folded dispatch's counts of this forward to the layer's totals."""
    counters = layer._last_folding_dispatch_counters
    totals = layer.ds_omni_fold_counts
    totals["forwards"] += 1
    totals["assignments_local"] += counters["assignments_local"]
    totals["assignments_total"] += counters["assignments_total"]


def _folding_groups(spec, tp_group):
    """DeepSpeed's EP / expert-data-parallel groups drawn from the folding tables (made anew: a
    process that built another plan before holds stale ones under the same name), as the
    `FoldingGroupHandles` AutoEP's folded layers take."""
    from deepspeed.module_inject.auto_ep_folding import FoldingGroupHandles, local_folding_ranks
    from deepspeed.utils import groups
    name = f"ep_size_{spec.ep_size}"
    for table in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                  groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.pop(name, None)
    groups._create_expert_and_data_parallel(spec.ep_size, mp_size=spec.tp_size,
                                            pp_size=spec.pp_size, mp_mode="tp",
                                            folding_spec=spec)
    ranks = local_folding_ranks(dist.get_rank(), spec)
    return FoldingGroupHandles(
        spec=spec, tp_group=tp_group, dense_dp_group=None,
        ep_group=groups._get_expert_parallel_group(name),
        edp_group=groups._get_expert_data_parallel_group(name), ep_group_name=name,
        tp_ranks=ranks["tp"], dense_dp_ranks=ranks["dense_dp"], ep_ranks=ranks["ep"],
        edp_ranks=ranks["edp"])


def _correct_grads(layer: nn.Module, tp_group, tp: int) -> None:
    """The engine's folding corrections (`auto_ep_folding.reduce_autoep_folding_gradient`), as
    hooks on each gradient before it accumulates: the outputs' all-gather over TP sends each
    rank tp x its share's gradient back, so the router (whose logits every TP rank also feeds
    the aux loss whole) is averaged over TP and the experts (each rank's own assignments) are
    divided by tp. Shared experts, computed whole on every TP rank, need nothing."""
    def average(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=tp_group)
        return grad / tp
    for p in layer.router.parameters():
        p.register_hook(average)
    for p in layer.experts.parameters():
        p.register_hook(lambda grad: grad / tp)


def fold_counts(model: nn.Module) -> dict[str, int]:
    """Evidence that the fold ran, summed over the model's folded AutoEP layers: forwards, the
    token-expert assignments this rank dispatched and those its TP group routed in all."""
    from ds_omni.parallelize.expert_parallel import autoep_layers
    out = {"folded_layers": 0, "forwards": 0, "assignments_local": 0, "assignments_total": 0}
    for layer in autoep_layers(model).values():
        totals = getattr(layer, "ds_omni_fold_counts", None)
        if totals is not None:
            out["folded_layers"] += 1
            for key, value in totals.items():
                out[key] += value
    return out
