"""The step simulator (`simulate`, through `ds_omni.sim.published`) against published cluster
runs: each GPU type's two kernel numbers fitted on at most two runs (benchmarks/published_runs.json
names them), every other run predicted. Figure: TFLOP/s per GPU, as each source counts FLOPs
(the same step time ratio as tokens/s per GPU). Targets over the validation runs: median
absolute error <= 15 %, none above 30 %; within a source, the runs ordered as measured.

    .venv/bin/python benchmarks/sim_published.py     # ~1 min; writes sim_published.json / .png
    .venv/bin/python benchmarks/sim_published.py --max-gpus 2048   # make bench's quick run

Method, sources and tables: docs/benchmarks/sim_published.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_omni.sim.published import misordered, ordered_pairs, reproduce  # noqa: E402

RUNS = REPO / "benchmarks" / "published_runs.json"
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")


def summarise(result: dict) -> dict:
    """Error figures over the validation runs, and the pairs of one source ordered as measured
    (all runs, each source's table as a whole)."""
    val = [r for r in result["runs"] if r["role"] == "validation"]
    errors = [abs(r["error"]) for r in val]
    agree, total = ordered_pairs(result["runs"])
    by_source = {}
    for s in sorted({r["source"] for r in result["runs"]}):
        a, t = ordered_pairs([r for r in result["runs"] if r["source"] == s])
        errs = [abs(r["error"]) for r in val if r["source"] == s]
        by_source[s] = {"median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
                        "ordered_pairs": a, "pairs": t}
    return {"misordered": [[_pair_row(r) for r in pair] for pair in misordered(result["runs"])],
            "validation_runs": len(val), "calibration_runs": len(result["runs"]) - len(val),
            "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "ordered_pairs": agree, "pairs": total, "order_agreement": agree / total,
            "sources": by_source, "gpus": [min(r["gpus"] for r in result["runs"]),
                                           max(r["gpus"] for r in result["runs"])]}


def _pair_row(r: dict) -> dict:
    """A run of a mis-ordered pair: name, plan (tp x pp x dp, micro-batch, chunks), measured
    and predicted TFLOP/s per GPU, and each critical-path phase's share of the step."""
    p, b = r["plan"], r["breakdown"]
    return {"name": r["name"], "plan": f"{p['tp']} x {p['pp']} x {p['dp']} "
            f"({p['micro_batch']}, {p.get('vp', 1)})", "measured": r["measured"],
            "predicted": round(r["predicted"], 1),
            "shares": {k: round(v / b["step"], 4) for k, v in b.items() if k != "step" and v}}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 6))
    xs, ys = [r["measured"] for r in rows], [r["predicted"] for r in rows]
    lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], alpha=0.15,
                    label="+-15 %")
    colours = {s: f"C{i}" for i, s in enumerate(sorted({r["source"] for r in rows}))}
    for s, c in colours.items():
        for role, marker in (("validation", "o"), ("calibration", "x")):
            pts = [r for r in rows if r["source"] == s and r["role"] == role]
            ax.scatter([r["measured"] for r in pts], [r["predicted"] for r in pts], c=c,
                       marker=marker, label=f"{s} ({role})" if pts else None)
    for r in rows:
        ax.annotate(f"{r['name'].split()[-1]}/{r['gpus']}", (r["measured"], r["predicted"]),
                    fontsize=5)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="measured TFLOP/s per GPU (the source's table)",
           ylabel="simulated TFLOP/s per GPU", title="ds_omni.sim against published runs")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows: list[dict]) -> str:
    """The results as docs/benchmarks/sim_published.md's table (markdown)."""
    out = ["| source | run | GPUs | tp x pp x dp (micro-batch, chunks) | measured TFLOP/s/GPU | "
           "predicted | error | role "
           "| critical path: TP / p2p / grad sync |", "|" + "---|" * 9]
    for r in rows:
        p, b = r["plan"], r["breakdown"]
        share = " / ".join(f"{100 * b.get(k, 0.0) / b['step']:.0f}"
                           for k in ("llm_tp", "p2p", "grad_sync"))
        out.append(f"| {r['source']} | {r['name']} | {r['gpus']:,} | {p['tp']} x {p['pp']} x "
                   f"{p['dp']} ({p['micro_batch']}, {p.get('vp', 1)}) | {r['measured']:.1f} | "
                   f"{r['predicted']:.1f} | "
                   f"{100 * r['error']:+.1f} % | {r['role']} | {share} % |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gpus", type=int, default=None,
                    help="predict only runs of at most this many GPUs (the calibration runs "
                         "are fitted all the same): the largest pipelines take minutes")
    args = ap.parse_args(argv)
    doc = json.loads(RUNS.read_text())
    result = reproduce(doc, lambda r: args.max_gpus is None or r["gpus"] <= args.max_gpus)
    result.update(summarise(result))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_published.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result["runs"], RESULTS / "sim_published.png")
    for r in result["runs"]:
        print(f"{r['source']:20} {r['name']:24} {r['gpus']:5} measured {r['measured']:6.1f} "
              f"predicted {r['predicted']:6.1f} ({100 * r['error']:+5.1f} %) {r['role']}")
    print(table(result["runs"]))
    for lo, hi in result["misordered"]:
        print(f"mis-ordered: {lo['name']} {lo['plan']} {lo['measured']} (pred {lo['predicted']}) "
              f"< {hi['name']} {hi['plan']} {hi['measured']} (pred {hi['predicted']})")
    print(f"validation: median |error| {100 * result['median_abs_error']:.1f} %, max "
          f"{100 * result['max_abs_error']:.1f} %; pairs ordered {result['ordered_pairs']} of "
          f"{result['pairs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
