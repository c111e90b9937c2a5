"""MegaScale-Omni's evaluation, in the step simulator: ds_omni's predicted speed-up over the
baselines as the paper ran them and over the simulator's five tuned ones, on the paper's kind of
setups, next to the paper's reported 1.27x-7.57x.

    .venv/bin/python benchmarks/sim_megascale_omni.py      # 192 s on 2 shared cores (load ~10)

Setups (H100s, 8 a node): a ~1B ViT + a 12B LLM (Mistral-Nemo dims) on 64 GPUs; a 2.4B ViT +
a 70B LLM (Llama-3-70B dims) on 128; a 10B ViT + the 70B on 256 (`sim_common.py` has the dims).
Workload: image:text samples mixed 1:9, 3:7, 5:5, 7:3, 9:1, samples up to 16K LLM tokens (text
lognormal around 2,000 tokens; 1 + Geometric(1/2) images of 256-16,384 patches, 4 patches an LLM
token), packed into 16K-token rows; 8 samples a GPU per step; the same drawn samples for every
plan of a (setup, mix); beside them, runs whose mix swings from step to step (`SWINGS`).

For each (setup, mix), ds_omni's plan is the best (tokens/s, fitting in memory) of a small grid
(`candidates`: SP degree, per-sequence SP, a joint pipeline of 2-8 stages), the full plan
space's top plans (`ds_omni.sim.search`, `SEARCH_S` seconds on the 5:5 mix) and its runs of the
tuned baselines' plans; each tuned baseline gets its best over the baselines derived from the
grid (its degrees, not ours) and its as-run plan; the as-run ones (`baselines.AS_RUN`) are chosen once on the 5:5 mix
and kept. speed-up = ds_omni's tokens/s / the baseline's; a missed target prints both sides'
critical paths by phase (`phases_s` in the results). Beside them, each joint pipeline with its
encoders in the pipeline's bubbles against "uniform" (`bubbles_beside_uniform`). Writes
benchmarks/results/sim_megascale_omni.json (swings: `swing_cases`, `summary_swing`) and .png.
The reading (what differs from the paper and why): docs/benchmarks/sim_papers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import sim_common  # noqa: E402
from ds_omni.errors import DsOmniError  # noqa: E402
from ds_omni.sim import baselines  # noqa: E402
from ds_omni.sim.cluster import cluster  # noqa: E402
from ds_omni.sim.plan_spec import SimPlan  # noqa: E402
from ds_omni.sim.search import describe  # noqa: E402
from ds_omni.sim.workload import WorkloadSpec  # noqa: E402

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
SETUPS = {"vit1b_llm12b_64gpus": ("vit_1b", "llm_12b", 64),
          "vit2p4b_llm70b_128gpus": ("vit_2.4b", "llm_70b", 128),
          "vit10b_llm70b_256gpus": ("vit_10b", "llm_70b", 256)}
MIXES = {"1:9": 0.1, "3:7": 0.3, "5:5": 0.5, "7:3": 0.7, "9:1": 0.9}  # image : text samples
SEQ, SAMPLES_PER_GPU = 16384, 8
PAPER = {"min": 1.27, "max": 7.57}


def workload(image_fraction: float) -> WorkloadSpec:
    return WorkloadSpec(image_fraction=image_fraction, text_median=2000.0, max_tokens=SEQ,
                        patches_range=(256, 16384))


def candidates(model, c) -> list[SimPlan]:
    """ds_omni's plans tried: no pipeline (SP 1/2/4/8 over rows of 16K tokens a rank, or
    per-sequence SP up to 8; encoders in the pool; ZeRO-1 where the model states fit with it, else ZeRO-3), or a joint pipeline of 2, 4
    or 8 stages (ZeRO-1, encoders on every stage) where a stage's states fit; budget-mode
    reordering in groups of 8 throughout."""
    base = SimPlan(name="ds_omni", global_batch=SAMPLES_PER_GPU * c.gpus, pack_tokens=SEQ,
                   micro_batches=4, reorder="budget", reorder_group=8, encoder_mode="pool")
    zero = 1 if sim_common.states_fit(model, c, 1, 1) else 3
    plans = [base.replace(sp=sp, pack_tokens=SEQ * sp, zero_stage=zero) for sp in (1, 2, 4, 8)]
    plans += [base.replace(max_sequence_sp=8, zero_stage=zero)]
    plans += [base.replace(pp=pp, zero_stage=1, micro_batches=4 * pp, encoder_mode="reshard",
                           encoder_placement="uniform")
              for pp in (2, 4, 8) if sim_common.states_fit(model, c, pp, 1)]
    return plans


AVERAGE_MIX = "5:5"
"""The mix the as-run baselines are sized for (once), and the full-space search runs on."""
SEARCH_S = 120.0
"""CPU seconds the full-space search may take per setup (the best found when it runs out); each
search ends well within it (48 s at 12B, 776 plans simulated)."""


def full_space(model):
    """The search's space over every axis (ep: only where the model has experts)."""
    from ds_omni.sim.search import SearchSpace
    return SearchSpace(reorder_groups=(8,), checkpointing=(True, False))


SWINGS = {"1:9-5:5": ("1:9", "3:7", "5:5"), "1:9-9:1": tuple(MIXES),
          "5:5-9:1": ("5:5", "7:3", "9:1")}
"""Runs whose mix swings from step to step: one step at each listed mix of the window, the steps'
samples the fixed-mix cases' draws. A run's tokens/s depends only on its steps' mixes (the
simulator's steps share no state), so each mix once holds the run's mean at the window's middle
mix exactly, with no sampling noise from a few draws; the as-run pools are sized for that mix."""


def run_setup(setup: str, mixes: list[str], seed: int,
              search_s: float = SEARCH_S) -> tuple[list[dict], list[dict]]:
    """Every mix of one setup: ds_omni's best (the grid, the full space's top plans found on the
    average mix, and ds_omni's runs of the tuned baselines' plans) against the tuned baselines
    and against the as-run baselines (chosen once on the average mix, kept for every mix); then
    every swing (`SWINGS`) whose mixes are all run, each plan fixed over its steps."""
    vit, llm, gpus = SETUPS[setup]
    model, c = sim_common.model_spec(vit, llm), cluster("h100", gpus)
    grid = candidates(model, c)
    draw = lambda mix: workload(MIXES[mix]).draw(grid[0].global_batch, seed,  # noqa: E731
                                                 tuple(model.dims.encoders))
    searches = {mix: sim_common.Search(c, model, draw(mix)) for mix in {*mixes, AVERAGE_MIX}}
    avg = searches[AVERAGE_MIX]
    top, found = sim_common.space_plans(avg, grid[0], full_space(model), search_s)
    as_run = {AVERAGE_MIX: as_run_plans(avg, grid)}
    cases = [run_mix(setup, mix, searches[mix], grid, top, as_run[AVERAGE_MIX], found)
             for mix in mixes]
    swings = []
    for name, steps in SWINGS.items():
        if set(steps) <= set(mixes):
            mean = steps[len(steps) // 2]
            if mean not in as_run:
                as_run[mean] = as_run_plans(searches[mean], grid)
            run = sim_common.Swing(c, model, searches[mean].samples,
                                   steps=[searches[m] for m in steps])
            swings.append({"setup": setup, "mix": f"swing {name}", "steps": list(steps),
                           "sized_for": mean, "gpus": c.gpus,
                           **compared(run, grid, top, as_run[mean])})
    return cases, swings


def as_run_plans(avg: sim_common.Search, grid: list[SimPlan]) -> dict:
    """{name: (plan, None) or (None, why)} of the papers' baselines, each the fastest fitting on
    the average mix of its fixed family (Megatron-LM: tp x pp; disaggregated: the grid's degrees,
    its encoder pool sized for the average mix's encoder share), kept for every mix; no plan
    fitting: why (`sim_common.brief`: the least peak memory any of them needed)."""
    share = baselines.encoder_share(avg.model, avg.samples)
    base = grid[0].replace(zero_stage=1)
    megatron = avg.best(_built(lambda d: baselines.megatron_as_run(base, *d),
                             baselines.AS_RUN_TP_PP))
    disagg = avg.best(_built(
        lambda p: baselines.disaggregated_as_run(p, avg.cluster.gpus, share), grid))
    return {name: (plan, None if plan else sim_common.brief(None, report))
            for name, (plan, report) in (("megatron_as_run", megatron),
                                         ("disaggregated_as_run", disagg))}


def _built(make, args) -> list[SimPlan]:
    """The plans `make` builds of `args`, less those training's table refuses."""
    out = []
    for a in args:
        try:
            out.append(make(a))
        except DsOmniError:
            pass
    return out


def run_mix(setup, mix, search, grid, top, as_run, found) -> dict:
    return {"setup": setup, "mix": mix, "gpus": search.cluster.gpus,
            **compared(search, grid, top, as_run),
            "full_space": {"top": [describe(p) for p in top], "candidates": found.candidates,
                           "simulated": found.simulated, "unexplored": found.unexplored,
                           "seconds": found.seconds},
            "bubbles_beside_uniform": bubbles_beside_uniform(search, grid),
            "plans_simulated": len(search.runs), "simulation_s": search.seconds}


def compared(search, grid, top, as_run) -> dict:
    """ds_omni's best plan on the search's samples (one step, or a `Swing`'s steps) against the
    tuned baselines and the as-run ones, and the speed-ups."""
    tuned = tuned_baselines(search, grid, as_run)
    own = [sim_common.own_version(p, grid[0]) for p, _ in tuned.values()]
    best_plan, best = search.best(grid + top + [p for p in own if p is not None])
    ours = sim_common.brief(best_plan, best)
    theirs = {name: sim_common.brief(*pr) for name, pr in tuned.items()}
    papers = {name: sim_common.fixed(search, plan) if plan else why
              for name, (plan, why) in as_run.items()}
    return {"ds_omni": ours, "baselines": theirs, "speedup": sim_common.speedups(ours, theirs),
            "as_run": papers, "speedup_as_run": sim_common.speedups(ours, papers)}


def tuned_baselines(search, grid, as_run: dict) -> dict:
    """The tuned baselines on the search's samples: each at its best over the grid's and its
    as-run plan (`as_run_plans`: Megatron-LM's fixed tp x pp, the pool sized for the average
    mix), so a tuned baseline is never slower than the same family as run."""
    family = {"megatron": "megatron_as_run", "disttrain": "disaggregated_as_run"}
    return search.baselines(grid, also={name: [as_run[run][0]] for name, run in family.items()})


def bubbles_beside_uniform(search, plans) -> dict:
    """Per joint-pipeline candidate ("pp4"): its tokens/s with encoders placed "uniform" and
    in the pipeline's bubbles ("bubbles", issue 39), and bubbles over uniform (None: unfit)."""
    out = {}
    for plan in plans:
        if plan.pp > 1 and plan.encoder_placement == "uniform":
            runs = {w: search.run(plan.replace(encoder_placement=w)) for w in ("uniform", "bubbles")}
            tps = {w: sim_common.tokens_per_s(r) if getattr(r, "fits", False) else None
                   for w, r in runs.items()}
            out[f"pp{plan.pp}"] = {**tps, "bubbles_over_uniform": tps["bubbles"] / tps["uniform"]
                                   if tps["bubbles"] and tps["uniform"] else None}
    return out


def summarise(cases: list[dict]) -> dict:
    """Per setup and over everything: the range of speed-ups over each baseline (the ones that
    fit), and over all baselines."""
    out = {}
    for setup in dict.fromkeys(c["setup"] for c in cases):
        mine = [c for c in cases if c["setup"] == setup]
        out[setup] = _ranges(mine)
        out[setup]["as_run"] = _ranges(mine, "speedup_as_run", baselines.AS_RUN[:2])
    out["all"] = _ranges(cases)
    out["all"]["as_run"] = _ranges(cases, "speedup_as_run", baselines.AS_RUN[:2])
    return out


def _ranges(cases: list[dict], key: str = "speedup", names=baselines.BASELINES) -> dict:
    per = {}
    for name in names:
        vals = [c[key][name] for c in cases if c[key].get(name) is not None]
        if vals:
            per[name] = {"min": min(vals), "max": max(vals)}
    every = [v for r in per.values() for v in r.values()]
    if every:
        per["any_baseline"] = {"min": min(every), "max": max(every)}
    return per


def plot(cases: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    setups = list(dict.fromkeys(c["setup"] for c in cases))
    fig, axes = plt.subplots(1, len(setups), figsize=(5 * len(setups), 4), squeeze=False)
    for ax, setup in zip(axes[0], setups):
        mine = [c for c in cases if c["setup"] == setup]
        width = 0.8 / len(baselines.BASELINES)
        for j, name in enumerate(baselines.BASELINES):
            ys = [c["speedup"][name] or 0.0 for c in mine]
            ax.bar([i + j * width for i in range(len(mine))], ys, width, label=name)
        ax.axhspan(PAPER["min"], PAPER["max"], color="grey", alpha=0.15,
                   label="paper: 1.27x-7.57x")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(mine))], [c["mix"] for c in mine])
        ax.set_title(setup, fontsize=9)
        ax.set_xlabel("image : text samples")
        ax.set_ylabel("ds_omni tokens/s over the baseline's")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("MegaScale-Omni's setups, simulated (H100): ds_omni's best plan over each "
                 "baseline's best (0: no plan fits)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def show(case: dict) -> str:
    """A case in three lines: ds_omni's plan, the tuned and the as-run speed-ups; where a target
    is missed (< 1.0x tuned, < 1.27x as run), the two plans' critical paths by phase."""
    fmt = lambda d: ", ".join(f"{k} {v:.2f}x" if v else f"{k} -" for k, v in d.items())  # noqa
    ours = case["ds_omni"] or {}
    lines = [f"{case['setup']} {case['mix']}: ds_omni {ours.get('plan')}",
             f"  tuned: {fmt(case['speedup'])}", f"  as run: {fmt(case['speedup_as_run'])}"]
    if "bubbles_beside_uniform" in case:
        lines.append("  bubbles / uniform: " + fmt({k: v["bubbles_over_uniform"] for k, v in
                                                    case["bubbles_beside_uniform"].items()}))
    for kind, floor in (("speedup", 1.0), ("speedup_as_run", PAPER["min"])):
        side = case["baselines"] if kind == "speedup" else case["as_run"]
        for name, v in case[kind].items():
            if v is not None and v < floor - 1e-9:
                lines.append(f"  below {floor}x vs {name}: ds_omni {ours.get('phases_s')}; "
                             f"{name} {side[name]['plan']} {side[name]['phases_s']}")
    return "\n".join(lines)


def write(args, cases: list[dict], swings: list[dict], wall_s: float) -> None:
    result = {"what": __doc__.splitlines()[0], "gpu": "h100", "seq_tokens": SEQ,
              "samples_per_gpu": SAMPLES_PER_GPU, "seed": args.seed, "paper": PAPER,
              "search_s": args.search_s,
              "models_billions": {s: sim_common.billions(sim_common.model_spec(*SETUPS[s][:2]))
                                  for s in args.setups},
              "complete": len(cases) == len(args.setups) * len(args.mixes),
              "cases": cases, "summary": summarise(cases), "swing_cases": swings,
              "summary_swing": summarise(swings) if swings else {}, "wall_s": wall_s}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--search-s", type=float, default=SEARCH_S)
    parser.add_argument("--out", default="sim_megascale_omni")
    args = parser.parse_args(argv)
    start, cases, swings = time.perf_counter(), [], []
    for setup in args.setups:
        mine, swung = run_setup(setup, args.mixes, args.seed, args.search_s)
        cases += mine
        swings += swung
        for case in mine + swung:
            print(show(case), flush=True)
        write(args, cases, swings, time.perf_counter() - start)  # a partial run counts
    plot(cases, RESULTS / f"{args.out}.png")
    print(json.dumps(summarise(cases)["all"], indent=1))
    if swings:
        print("swinging mixes:", json.dumps(summarise(swings)["all"]["as_run"]))
    print(f"wrote {RESULTS / args.out}.json and .png in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
