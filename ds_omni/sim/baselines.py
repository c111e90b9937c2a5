"""The five baselines, each a `SimPlan` over the same cluster, model and samples as the plan it
is compared with (its degrees kept where the baseline has them): "megatron" (Megatron-LM style:
the encoder on the first stage, layers split evenly, static DP x SP, every SP rank encoding its
row's items, loader order); "disttrain" (encoders and LLM on separate GPU pools, the encoder pool
sized by the encoders' FLOP share; samples reordered); "deepspeed" (packed rows in loader order,
one static SP degree, HF's Ulysses: every SP rank encodes the whole row; no pipeline, no ring);
"bytescale" (one static context-parallel degree for every sequence, large enough for the
longest: Ulysses up to the heads, ring past them; loader order); "veomni" (every encoder item
split across the SP group, ZeRO-3, no pipeline, no ring, loader order).

The papers' baselines as the papers ran them (`AS_RUN`, fixed for a setup while the mix swings):
`megatron_as_run`, `disaggregated_as_run`, `static_cp_as_run`; docs/benchmarks/sim_papers.md.
"""

from __future__ import annotations

import math

from ds_omni.config.composition import FEATURES, PARALLEL_FIELDS, Setting
from ds_omni.errors import DsOmniError
from ds_omni.parallel.hdp import ulysses_ring_split
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import simulate
from ds_omni.sim.workload import Samples

BASELINES = ("megatron", "disttrain", "deepspeed", "bytescale", "veomni")
NAMED = ("sp", "max_sequence_sp", "tp", "pp", "ep", "cp", "encoder_placement", "encoder_pool")
"""The composition table's features the baselines below set or keep on purpose; any other
(a new axis) is at its default, off, in every baseline (`_plain`)."""


def _plain(plan: SimPlan, name: str, **changes) -> SimPlan:
    """The plan with ds_omni's own techniques off, then `changes`."""
    off = dict(name=name, dp=None, reorder="loader_order", max_sequence_sp=1, long_items=False,
               encoder_gpus=0)
    new = {f.name: getattr(Setting(), f.name) for f in FEATURES
           if f.name in PARALLEL_FIELDS and f.name not in NAMED}
    return plan.replace(**(new | off | changes))


def megatron(plan: SimPlan) -> SimPlan:
    return _plain(plan, "megatron", encoder_mode="replicated", encoder_placement="stage0",
                  stage_split="layers", zero_stage=min(plan.zero_stage, 1))


def disttrain(plan: SimPlan, gpus: int, encoder_share: float) -> SimPlan:
    """Encoder GPUs in proportion to the encoders' share of the step's FLOPs (at least one),
    the rest (a multiple of sp x pp) for the LLM; its fewer data-parallel ranks each run
    proportionally more micro-batches (the same global batch, the same packed row size)."""
    unit = ParallelPlan.replica_size(plan.parallel)
    llm = unit * max(1, math.floor(gpus * (1 - encoder_share) / unit))
    llm = min(llm, unit * ((gpus - 1) // unit))
    dp = llm // unit
    if dp < 1:  # no GPUs left for one LLM replica beside the encoders' (2 GPUs, pp=2): the plan
        # asks for all of them as encoder GPUs, which simulating refuses (`SimPlan.llm_gpus`),
        # and every caller reports as this baseline's error
        return _plain(plan, "disttrain", encoder_gpus=gpus)
    group = max(g for g in range(1, min(plan.reorder_group, dp) + 1) if dp % g == 0)
    shared_dp = ParallelPlan.dp_of(plan.parallel, gpus)
    micro = math.ceil(plan.micro_batches * shared_dp / dp)
    return _plain(plan, "disttrain", reorder="fixed", reorder_group=group, encoder_mode="reshard",
                  micro_batches=micro,
                  encoder_placement="stage0", stage_split="layers",
                  zero_stage=min(plan.zero_stage, 1) if plan.pp > 1 else plan.zero_stage,
                  encoder_gpus=gpus - llm)


def static_degree(plan: SimPlan, samples: Samples) -> int:
    """The plan's largest sequence degree (sp x cp, or its blocks'), raised to the power of two
    whose shards hold the longest sequence within one micro-batch row."""
    need = max(1, math.ceil(int(samples.tokens.max()) / plan.pack_tokens))
    return max(plan.long_item_group * plan.cp, 1 << math.ceil(math.log2(need)))


def deepspeed(plan: SimPlan) -> SimPlan:
    return _plain(plan, "deepspeed", sp=plan.long_item_group, cp=1, pp=1,
                  encoder_mode="replicated")


def bytescale(plan: SimPlan, samples: Samples, heads: int | None = None) -> SimPlan:
    """Static CP of `static_degree` ranks: Ulysses over a degree dividing the LLM's `heads`,
    ring attention across the rest (`hdp.ulysses_ring_split`: past the heads, as ByteScale's
    context parallelism has no head limit)."""
    degree = static_degree(plan, samples)
    sp, cp = ulysses_ring_split(degree, heads)
    return _plain(plan, "bytescale", sp=sp, cp=cp, pp=1, tp=1, ep=1 if degree > 1 else plan.ep,
                  encoder_mode="reshard",
                  pack_tokens=plan.pack_tokens * degree // max(plan.sp * plan.cp, 1))


def veomni(plan: SimPlan) -> SimPlan:
    return _plain(plan, "veomni", sp=plan.long_item_group, cp=1, pp=1, tp=1, zero_stage=3,
                  encoder_mode="split_all")


def encoder_share(model, samples: Samples) -> float:
    """The encoders' share of the samples' training FLOPs."""
    terms = model.cost.term_costs(samples.tokens, samples.item_sample, samples.item_encoder,
                                  samples.item_len)  # [N, T]
    total = float(terms.sum())
    return float(terms[:, 2:].sum()) / total if total else 0.0


def baseline_plans(plan: SimPlan, gpus: int, model, samples: Samples) -> dict[str, SimPlan]:
    """The five baselines of `plan` for these samples."""
    share = encoder_share(model, samples)
    return {"megatron": megatron(plan), "disttrain": disttrain(plan, gpus, share),
            "deepspeed": deepspeed(plan), "bytescale": bytescale(plan, samples, model.llm_heads),
            "veomni": veomni(plan)}


AS_RUN = ("megatron_as_run", "disaggregated_as_run", "static_cp_as_run")


def megatron_as_run(plan: SimPlan, tp: int, pp: int) -> SimPlan:
    """Megatron-LM as MegaScale-Omni ran it: `megatron` at a fixed tp x pp (no SP, no ring), the
    encoder on the first stage, ZeRO-1 (its distributed optimizer), M = 4 x pp micro-batches."""
    return megatron(plan.replace(tp=tp, pp=pp, sp=1, cp=1, ep=1, encoder_placement="stage0",
                                 encoder_mode="replicated", max_sequence_sp=1,
                                 micro_batches=4 * pp)).replace(name="megatron_as_run",
                                                                zero_stage=1)


def disaggregated_as_run(plan: SimPlan, gpus: int, average_share: float) -> SimPlan:
    """Encoders and LLM on separate pools (DistTrain / Optimus-style) sized once by the encoders'
    FLOP share of the *average* mix, kept for every mix (no re-sizing as the mix swings)."""
    return disttrain(plan, gpus, average_share).replace(name="disaggregated_as_run")


def static_cp_as_run(plan: SimPlan, context: int, heads: int | None = None) -> SimPlan:
    """ByteScale's baseline as its paper ran it: static DP x CP, the CP degree the least power
    of two whose shards of `plan.pack_tokens` hold the `context` (whatever the batch's longest),
    Ulysses over the heads and ring across; loader order, no TP / PP."""
    degree = 1 << math.ceil(math.log2(max(1, math.ceil(context / plan.pack_tokens))))
    sp, cp = ulysses_ring_split(degree, heads)
    return _plain(plan, "static_cp_as_run", sp=sp, cp=cp, pp=1, tp=1, ep=1,
                  encoder_mode="reshard", pack_tokens=plan.pack_tokens * degree)


def compare(cluster, model, workload, plan: SimPlan, seed: int = 0) -> dict:
    """{name: StepReport} of the plan and each baseline, all on the same drawn samples; a
    baseline the cluster cannot run (its degrees do not divide the GPUs) maps to its error."""
    samples = workload if isinstance(workload, Samples) else workload.draw(
        plan.global_batch, seed, tuple(model.dims.encoders))
    out = {plan.name: simulate(cluster, model, samples, plan)}
    for name, base in baseline_plans(plan, cluster.gpus, model, samples).items():
        try:
            out[name] = simulate(cluster, model, samples, base)
        except DsOmniError as e:
            out[name] = e
    return out


AS_RUN_TP_PP = tuple((tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8))
"""Megatron-LM's fixed tp x pp: the fastest of these (on the papers' average mix in
benchmarks/sim_megascale_omni.py), kept for every mix."""


def as_run(cluster, model, samples: Samples, plan: SimPlan, context: int,
           cache: dict | None = None) -> dict:
    """{name: its step or error} of the papers' baselines as they ran them, for `plan`'s run on
    these samples (what `ds-omni plan --search` prints): Megatron-LM at the fastest fitting fixed
    tp x pp, the encoder and LLM pools sized by these samples' encoder share, static DP x CP at
    the degree a `context`-token sequence needs. `cache`: the search's (`simulate`'s)."""
    share = encoder_share(model, samples)
    tries = {"megatron_as_run": [lambda d=d: megatron_as_run(plan, *d) for d in AS_RUN_TP_PP],
             "disaggregated_as_run": [lambda: disaggregated_as_run(plan, cluster.gpus, share)],
             "static_cp_as_run": [lambda: static_cp_as_run(plan, context, model.llm_heads)]}
    out = {}
    for name, makes in tries.items():
        for make in makes:
            try:
                b = make()
                b.check_composition(launch=True)
                r = simulate(cluster, model, samples, b, cache=cache)
            except DsOmniError as e:
                out.setdefault(name, {"error": str(e)})
                continue
            if "step_time" not in out.get(name, {}) or (r.fits, -r.step_time) > (
                    out[name]["fits"], -out[name]["step_time"]):
                out[name] = {"step_time": r.step_time, "mfu": r.mfu, "fits": r.fits,
                             "plan": f"tp={b.tp} pp={b.pp} sp={b.sp} cp={b.cp}"
                                     + (f" encoder_gpus={b.encoder_gpus}" if b.encoder_gpus else "")}
    return out

