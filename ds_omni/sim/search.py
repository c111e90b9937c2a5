"""Plan search: for a cluster, a model and a workload, every plan of a space either dropped with its
reason or ranked by its simulated step time.

Three filters, cheapest first, none of which can drop a plan that would have ranked: training's
own rules (the composition table, `ds_omni.config.composition`; `SimPlan.parallel_plan`,
`check_model`, `plan_run`'s checks: dropped with training's message); model states that alone
exceed a GPU's memory; and branch and bound: plans simulated in order of a lower bound on their
step time (compute spread perfectly, plus the traffic no schedule hides), stopping when the next
bound is no better than the top-th best found. Plans share the loader's planning, encoder
placements and resolved parallel plans where they can (`simulate(..., cache=)`). A budget of CPU
seconds (`budget_s`; CPU, so the answer does not move with the machine's load) stops early and
says how many plans were left and their best bound.
More: docs/simulator.md.
"""

from __future__ import annotations

import heapq
import itertools
import re
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from ds_omni.config.composition import DEGREES
from ds_omni.errors import DsOmniError
from ds_omni.parallel.hdp import ulysses_ring_split
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.sim import bounds
from ds_omni.sim.baselines import baseline_plans
from ds_omni.sim.bounds import GIB, Shell
from ds_omni.sim.cluster import Cluster
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import loader_plan, simulate
from ds_omni.sim.workload import Samples


EVERY_RANK = 1 << 30  # a reorder group of every data-parallel rank (capped at dp below)


@dataclass(frozen=True)
class SearchSpace:
    """The values the search tries; degrees above the GPUs (tp, sp: above a node) are skipped."""

    degrees: tuple[int, ...] = (1, 2, 4, 8)
    """Values of sp, tp, pp, ep and max_sequence_sp."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    encoder_modes: tuple[str, ...] = ("reshard", "pool")
    encoder_placements: tuple[str, ...] = ("stage0", "uniform")
    reorder_groups: tuple[int, ...] = (8, 32, EVERY_RANK)
    """G, capped at dp. EVERY_RANK: one group of all data-parallel ranks, which balances a long
    tail of costly sequences that groups of 8-32 get unevenly (benchmarks/sim_bytescale.py)."""
    checkpointing: tuple[bool, ...] = (True, False)
    ring_shard: int = 8192
    """cp is tried up to the least degree whose shard of the longest sequence, longest / (sp x
    cp), is at most this many tokens (shorter shards hide no ring step behind their attention)."""


@dataclass
class Ranked:
    plan: SimPlan
    step_time: float
    mfu: float
    peak_memory: float
    critical_phase: str
    bound: float
    breakdown: dict = field(default_factory=dict)
    """{phase: seconds} of the step's critical path (what its step time is made of)."""


@dataclass
class SearchResult:
    top: list[Ranked]
    dropped: list[dict] = field(default_factory=list)
    """[{plan, reason}] every plan not ranked, with why: refused (training's message), out of
    memory (the figures), pruned by the bound, slower than the top, left by the budget."""
    baselines: dict = field(default_factory=dict)
    """{name: step time | error} of the best plan's five baselines, same samples."""
    baselines_as_run: dict = field(default_factory=dict)
    """{name: step time | error} of the baselines as their papers ran them (filled by the
    caller, `sim/baselines.py`; printed when present)."""
    cache: dict = field(default_factory=dict, repr=False)
    """`simulate`'s cache the search filled (the caller's further plans of these samples)."""
    candidates: int = 0
    simulated: int = 0
    pruned: int = 0
    """Plans whose bound was no better than the top-th best time (never simulated)."""
    unexplored: int = 0
    """Plans left when the time budget ran out (0: the top is proven)."""
    unexplored_bound: float | None = None
    seconds: float = 0.0
    below: list = field(default_factory=list, repr=False)
    """Simulated plans pushed below the top (moved to `dropped` when the search ends)."""


def describe(plan) -> str:
    """A plan (a SimPlan or the fields of a candidate) in one line of its searched fields."""
    f = plan if isinstance(plan, dict) else plan.as_dict()
    parts = [f"dp={f['dp']}"] + [f"{k}={f.get(k, 1)}" for k in DESCRIBED if f.get(k, 1) > 1]
    if f["max_sequence_sp"] > 1:
        parts.append(f"max_sequence_sp={f['max_sequence_sp']}")
    if "pack_tokens" in f and f.get("sp", 1) * f.get("cp", 1) > 1:  # a row split over them
        parts.append(f"rows={f['pack_tokens'] // 1024}K")
    parts += [f"zero={f['zero_stage']}", f"encoders={f['encoder_mode']}"]
    if f["pp"] > 1:
        parts.append(f"placement={f['encoder_placement']}")
    parts += [f"G={f['reorder_group']}", f"ckpt={'on' if f['checkpointing'] else 'off'}"]
    return " ".join(parts)


# ----------------------------------------------------------------------------- the space
SEARCHED = ("sp", "pp", "tp", "ep", "max_sequence_sp", "cp")
"""The composition table's degrees `candidates` enumerates by rules of their own; any other (a
new axis) is tried at every value of `SearchSpace.degrees` (`_other_degrees`)."""
DESCRIBED = ("sp", "cp", "pp", "tp", "ep") + tuple(d for d in DEGREES if d not in SEARCHED)


def _other_degrees(space: SearchSpace) -> list[dict]:
    """Every combination of the table's degrees not in `SEARCHED` over `space.degrees` ([{}]
    where there are none); the table drops what it refuses."""
    others = [d for d in DEGREES if d not in SEARCHED]
    return [dict(zip(others, v)) for v in itertools.product(space.degrees, repeat=len(others))]


def candidates(base: SimPlan, gpus: int, gpus_per_node: int, model: ModelSpec,
               space: SearchSpace = SearchSpace(), longest: int = 0) -> list[dict]:
    """Every plan of `space` on `gpus` GPUs (the SimPlan fields that differ from `base`), with
    `base`'s batch: the same samples per step and per micro-batch row (its micro-batch size),
    so the gradient accumulation steps follow dp. `longest`: the longest sample's tokens (the
    cp degrees tried, `SearchSpace.ring_shard`); where longer than the base's row, also rows
    of sp x cp times its tokens that hold it and per-sequence blocks that do (`_long_rows`)."""
    base_dp = ParallelPlan.dp_of(base.parallel, gpus)
    per_micro = base.global_batch / (base.micro_batches * base_dp)  # samples of one micro-batch
    need = max(1, -(-longest // base.pack_tokens))  # ranks of base's rows the longest spans
    out, seen, others = [], set(), _other_degrees(space)
    for sp, pp, tp, ep, msp in itertools.product(*[space.degrees] * 4,
                                                 _block_degrees(space, need)):
        if tp > gpus_per_node or sp > gpus_per_node or (ep > 1 and model.moe is None):
            continue
        if tp * sp > gpus_per_node:
            continue  # tp x sp inside a node (a ring may cross nodes)
        if sp > 1 and msp > 1:
            continue  # a static sp and a per-sequence degree contradict by definition
        for cp, more in itertools.product(
                _ring_degrees(space, longest, sp) if pp == msp == 1 else (1,), others):
            _add_plans(out, seen, base, gpus, per_micro, space,
                       dict(sp=sp, cp=cp, pp=pp, tp=tp, ep=ep, max_sequence_sp=msp, **more))
        for size in _long_rows(need, gpus) if pp == msp == 1 else ():
            _add_long_rows(out, seen, base, gpus, per_micro, space, size, sp, tp, ep)
    for size in _long_rows(need, gpus):  # static CP's splits (its best must be in the space)
        ulysses = ulysses_ring_split(size, model.llm_heads)[0]
        _add_long_rows(out, seen, base, gpus, per_micro, space, size, ulysses, 1, 1)
    return out


def _add_long_rows(out, seen, base, gpus, per_micro, space, size, sp, tp, ep) -> None:
    """Rows of `size` x the base's tokens over sp x cp = `size` ranks (where sp divides it)."""
    if size >= sp:
        _add_plans(out, seen, base, gpus, per_micro * size, space,
                   dict(sp=sp, cp=size // sp, pp=1, tp=tp, ep=ep, max_sequence_sp=1),
                   pack_tokens=base.pack_tokens * size)


def _power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_degrees(space: SearchSpace, need: int) -> tuple[int, ...]:
    """`space.degrees`, and the least power of two of ranks whose rows of the base's tokens hold
    the longest sequence, where larger (a per-sequence block past them: Ulysses over the heads
    inside, ring across, `hdp.ulysses_ring_split`)."""
    block = _power_of_two(need)
    return space.degrees + ((block,) if block > max(space.degrees) else ())


def _long_rows(need: int, gpus: int) -> list[int]:
    """Where the longest sequence spans `need` > 1 rows of the base's tokens: the sequence
    degrees sp x cp of rows that hold it, each a power of two from the least up to every GPU
    (the range static CP's tuned degree is chosen from, `baselines.bytescale`)."""
    least = _power_of_two(need)
    return [1 << k for k in range(least.bit_length() - 1, gpus.bit_length())
            if need > 1 and 1 << k <= gpus]


def _ring_degrees(space: SearchSpace, longest: int, sp: int) -> list[int]:
    """1 and the powers of two of `space.degrees` up to the least cp whose shard of the longest
    sequence is at most `space.ring_shard` tokens."""
    need, out = max(1.0, longest / (sp * space.ring_shard)), [1]
    for cp in sorted(d for d in space.degrees if d > 1 and not d & (d - 1)):
        if cp / 2 < need:
            out.append(cp)
    return out


def _add_plans(out: list, seen: set, base: SimPlan, gpus: int, per_micro: float,
               space: SearchSpace, degrees: dict, **rows) -> None:
    """The plans of one set of degrees over the space's other fields, each once (`rows`:
    pack_tokens, where not the base's; `per_micro`: the samples of such a row)."""
    pp, unit = degrees["pp"], ParallelPlan.replica_size(SimpleNamespace(**(vars(base.parallel)
                                                                          | degrees)))
    dp = gpus // unit
    if dp * unit != gpus:  # no whole replicas
        return
    micro = max(1, round(base.global_batch / (per_micro * dp)))
    for zero, mode, place, group, ckpt in itertools.product(
            space.zero_stages, space.encoder_modes, space.encoder_placements,
            space.reorder_groups, space.checkpointing):
        if place != "stage0" and pp == 1:
            continue  # the placement acts under pp only
        fields = dict(name="candidate", dp=dp, **degrees, zero_stage=zero, encoder_mode=mode,
                      encoder_placement=place, reorder_group=min(group, dp),
                      checkpointing=ckpt, micro_batches=micro, **rows)
        key = tuple(fields.values())
        if key not in seen:  # a reorder group capped at dp repeats a smaller one
            seen.add(key)
            out.append(fields)


# ------------------------------------------------------------------------------ the search
def search(cluster: Cluster, model: ModelSpec, samples: Samples, base: SimPlan, *,
           top: int = 5, space: SearchSpace = SearchSpace(), check=None,
           budget_s: float | None = None, prune: bool = True,
           baselines: bool = True) -> SearchResult:
    """The `top` fastest plans of `space` that fit, each simulated on `samples`; `check(plan)`
    adds the caller's rules (raise a DsOmniError to refuse). `prune=False` simulates every plan
    that passes the rules and the states check (the exhaustive answer the bound must keep)."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = SearchResult(top=[])
    plans = candidates(base, cluster.gpus, cluster.gpus_per_node, model, space,
                       int(samples.tokens.max()))
    out.candidates = len(plans)
    totals = bounds.totals_of(model, samples)
    heap = []  # (bound, order, refined?, plan, shell): the lowest bound first
    stage_plans: dict = {}
    pplans: dict = {}
    for k, fields in enumerate(plans):
        try:
            plan = base.replace(**fields)
            plan.check_composition(launch=True)  # what the table refuses, with its reason
            shell = Shell(cluster, model, samples, plan, stage_plans, pplans)
            heap.append((_admit(shell, check, totals), k, False, plan, shell))
        except DsOmniError as e:
            out.dropped.append({"plan": describe(fields), "reason": str(e)})
    heapq.heapify(heap)
    cache = out.cache
    while heap:
        bound, k, refined, plan, shell = heapq.heappop(heap)
        if prune and len(out.top) >= top and bound >= out.top[top - 1].step_time:
            out.pruned = len(heap) + 1
            _left(out, heap, (bound, k, refined, plan, shell),
                  f"pruned: bound {{:.4f}} s >= {out.top[top - 1].step_time:.4f} s, the "
                  f"{_nth(top)} best step found")
            break
        if budget_s is not None and time.process_time() - cpu0 > budget_s:
            out.unexplored, out.unexplored_bound = len(heap) + 1, bound
            _left(out, heap, (bound, k, refined, plan, shell),
                  f"left by the time budget ({budget_s:g} s of CPU): bound {{:.4f}} s")
            break
        if prune and not refined:  # tighten it with the loader's plan, then look again
            try:
                assignment = loader_plan(totals["per_sample"]["cost"], samples.tokens,
                                         shell.pplan, plan, cache)
            except DsOmniError as e:  # the loader refuses (a sample longer than a row)
                out.dropped.append({"plan": describe(plan), "reason": str(e)})
                continue
            heapq.heappush(heap, (bounds.refined_bound(shell, assignment, totals), k, True,
                                  plan, shell))
            continue
        _rank(out, cluster, model, samples, plan, bound, cache, top)
    _slower(out, top)
    if baselines and out.top:
        out.baselines = _baselines(cluster, model, samples, out.top[0].plan, cache)
    out.seconds = time.perf_counter() - t0
    return out


def _admit(shell: Shell, check, totals) -> float:
    """The plan's lower bound, or a DsOmniError saying why training refuses it or why its
    model states cannot fit."""
    plan, hbm = shell.plan, shell.cluster.hbm_bytes
    plan.check_model(shell.model)  # the model's rules first: cheaper than the caller's check
    if check is not None:
        check(plan)
    states, words = bounds.states_bytes(shell)
    if states > hbm:
        raise _OutOfMemory(f"out of memory: model states {states / GIB:.1f} GiB a GPU ({words}) "
                           f"> {hbm / GIB:.0f} GiB")
    return bounds.lower_bound(shell, totals)


class _OutOfMemory(DsOmniError):
    """A plan that cannot fit: its figures in the message."""


def _left(out: SearchResult, heap: list, first: tuple, reason: str) -> None:
    """The plans the search stops before simulating (`first` and the heap's), each with
    `reason` (a format of its bound)."""
    for bound, _, _, plan, _ in [first] + heap:
        out.dropped.append({"plan": describe(plan), "reason": reason.format(bound)})


def _slower(out: SearchResult, top: int) -> None:
    """The simulated plans that fit but fell below the top, each with its step time."""
    if len(out.top) < top:
        return
    last = out.top[-1].step_time
    for r in out.below:
        out.dropped.append({"plan": describe(r.plan), "reason": (
            f"slower: step {r.step_time:.4f} s > {last:.4f} s, the {_nth(top)} best")})
    out.below.clear()


def _nth(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _by_phase(path: list[dict]) -> dict:
    """{phase: seconds} of a critical path's segments."""
    out: dict = {}
    for seg in path:
        out[seg["phase"]] = out.get(seg["phase"], 0.0) + seg["seconds"]
    return out


def _rank(out: SearchResult, cluster, model, samples, plan, bound, cache, top) -> None:
    out.simulated += 1
    try:
        r = simulate(cluster, model, samples, plan, cache=cache)
    except DsOmniError as e:
        out.dropped.append({"plan": describe(plan), "reason": str(e)})
        return
    if not r.fits:
        words = ", ".join(f"{k} {v / GIB:.1f}" for k, v in r.memory.items())
        out.dropped.append({"plan": describe(plan), "reason": (
            f"out of memory: peak {r.peak_memory / GIB:.1f} GiB on rank {r.peak_memory_rank} "
            f"({words}) > {cluster.hbm_bytes / GIB:.0f} GiB")})
        return
    out.top.append(Ranked(plan, r.step_time, r.mfu, r.peak_memory, r.critical_phase, bound,
                          _by_phase(r.critical_path)))
    out.top.sort(key=lambda x: (x.step_time, _features(x.plan)))
    out.below += out.top[top:]
    del out.top[top:]


def _features(plan: SimPlan) -> tuple:
    """Among plans equally fast, the simpler first (fewer and smaller degrees, less ZeRO)."""
    return (plan.max_sequence_sp * plan.sp * plan.cp * plan.pp * plan.tp * plan.ep,
            plan.zero_stage,
            plan.encoder_mode != "reshard", plan.reorder_group, not plan.checkpointing)


def _baselines(cluster, model, samples, plan: SimPlan, cache) -> dict:
    res = {}
    for name, b in baseline_plans(plan, cluster.gpus, model, samples).items():
        try:
            r = simulate(cluster, model, samples, b, cache=cache)
            res[name] = {"step_time": r.step_time, "mfu": r.mfu, "fits": r.fits}
        except DsOmniError as e:
            res[name] = {"error": str(e)}
    return res


def as_dict(result: SearchResult) -> dict:
    """Plain data (what `ds-omni plan --search --json` prints)."""
    refused = len(result.dropped) - result.pruned - result.unexplored - sum(
        d["reason"].startswith("slower: ") for d in result.dropped)
    return {"top": [{"plan": describe(r.plan), "fields": r.plan.as_dict(),
                     "step_time": r.step_time, "mfu": r.mfu, "peak_memory_gib": r.peak_memory / GIB,
                     "critical_phase": r.critical_phase, "bound": r.bound,
                     "breakdown": r.breakdown} for r in result.top],
            "baselines": result.baselines, "baselines_as_run": result.baselines_as_run,
            "dropped": result.dropped,
            "counts": {"candidates": result.candidates, "simulated": result.simulated,
                       "pruned_by_bound": result.pruned, "dropped": refused,
                       "unexplored": result.unexplored},
            "unexplored_bound": result.unexplored_bound, "seconds": result.seconds}


def format_search(d: dict, dropped_lines: int | None = None) -> str:
    """The search for people: the top plans with their speed-up over the best baseline and
    their critical path by phase, the baselines (tuned, and as their papers ran them where
    given), then why every other plan was dropped (grouped by reason, `dropped_lines` groups:
    None, all)."""
    base = {k: v["step_time"] for k, v in d["baselines"].items() if "step_time" in v}
    best_base = min(base.values()) if base else None
    c = d["counts"]
    lines = [f"searched {c['candidates']} plans in {d['seconds']:.1f} s: {c['dropped']} dropped, "
             f"{c['simulated']} simulated, {c['pruned_by_bound']} pruned by the bound"
             + (f", {c['unexplored']} left by the time budget (bound >= "
                f"{d['unexplored_bound']:.4f} s: the top is the best found, not proven)"
                if c["unexplored"] else "")]
    for i, r in enumerate(d["top"], 1):
        speed = f", {best_base / r['step_time']:.2f}x the best baseline" if best_base else ""
        lines.append(f"{i}. {r['plan']}\n   step {r['step_time']:.4f} s, MFU {r['mfu']:.1%}, "
                     f"peak {r['peak_memory_gib']:.1f} GiB a GPU, mostly {r['critical_phase']}"
                     + speed)
        if r.get("breakdown"):
            lines.append("   critical path: " + ", ".join(
                f"{k} {v:.4f} s" for k, v in sorted(r["breakdown"].items(), key=lambda kv: -kv[1])))
    for key, title in (("baselines", "baselines of plan 1 (same model, same samples):"),
                       ("baselines_as_run", "baselines as their papers ran them:")):
        lines += _baseline_lines(d.get(key) or {}, title)
    return "\n".join(lines + _dropped_lines(d["dropped"], dropped_lines))


def _baseline_lines(baselines: dict, title: str) -> list[str]:
    if not baselines:
        return []
    return [title] + [f"  {name:10s} " + (f"error: {b['error']}" if "error" in b else
                      f"step {b['step_time']:.4f} s, MFU {b['mfu']:.1%}"
                      + ("" if b.get("fits", True) else ", DOES NOT FIT")
                      + (f" ({b['plan']})" if "plan" in b else ""))
                      for name, b in baselines.items()]


def _dropped_lines(dropped: list[dict], groups: int | None) -> list[str]:
    """Why plans were dropped: a line per kind of reason (its count, one example in full)."""
    reasons: dict = {}
    for x in dropped:
        reasons.setdefault(_reason_kind(x["reason"]), []).append(x)
    kinds = sorted(reasons.items(), key=lambda kv: -len(kv[1]))
    lines = ["dropped:"] if reasons else []
    for kind, xs in kinds[:groups]:
        lines.append(f"  {len(xs):4d} x {kind}; e.g. {xs[0]['plan']}: {xs[0]['reason']}")
    if groups is not None and len(kinds) > groups:
        lines.append(f"  ... {sum(len(xs) for _, xs in kinds[groups:])} more plans for "
                     f"{len(kinds) - groups} other reasons (--json lists every one)")
    return lines


SUMMED = ("out of memory", "pruned", "slower", "left by the time budget")
"""Reasons grouped by their head alone (what precedes the colon): their figures differ."""


def _reason_kind(reason: str) -> str:
    """A reason without its numbers, to group alike ones: its first 60 characters and the rest
    of their last word (cut inside one, "... combined with parallel.pp" and "... parallel.sp"
    were one group)."""
    head = (reason.split(":")[0] if reason.startswith(SUMMED)
            else re.match(r".{0,60}\S*", reason).group().rstrip(":;,"))
    return re.sub(r"\d+", "N", head).strip()
