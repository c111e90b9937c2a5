"""Expert parallelism's all-to-all bytes a step, measured on 2 CPU ranks, against the simulator.

    .venv/bin/python benchmarks/ep_all_to_all.py [--steps 3]   # about 1-2 minutes on 2 cores

Two CPU ranks over gloo train the demo composition (CLIP tower, builtin:shapes data) with
`test_expert_parallel.py`'s Qwen3-MoE backbone (2 MoE layers, width 64, 4 experts, top-2,
HF's aux loss on) at ep=2 (DeepSpeed's AutoEP: each rank holds 2 of every layer's 4 experts),
16 samples a step, through the real `setup_training` / `train_step`. Every
`torch.distributed.all_to_all_single` is wrapped and its bytes sent to the OTHER ranks of its
group counted by caller: AutoEP's `_AllToAllV` (`module_inject/auto_ep_layer.py`), the dispatch
and the combine of every MoE layer, forward and backward ("llm_experts"); its per-expert count
exchange (`_split_plan_from_expert_counts`, a few int32 a layer) apart ("ep_counts"). Each step's
samples are read back from the loader and simulated (`ds_omni.sim`, the config's own model and
plan through `from_config.model_spec` / `sim_plan`) on the same global batch.

The simulator prices activations in bf16, the CPU run moves fp32: measured bytes are halved. The
simulator takes routing as uniform: (ep - 1) / ep of a rank's token copies leave it. So two
figures a step: the routed volume (every copy a call handles, kept or sent, x width x 2 bytes x
(ep - 1) / ep) over the prediction, which the simulator must get exactly (its calls, top-k and
width), and the bytes that really left a rank over the prediction, which the router decides.
Writes benchmarks/results/ep_all_to_all.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
WORLD, EP = 2, 2
MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
       "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
       "max_position_embeddings": 256, "tie_word_embeddings": False,
       "output_router_logits": True, "router_aux_loss_coef": 0.02}


def make_config(out_dir: str, steps: int):
    from tests.fixtures import tiny_config
    cfg = tiny_config(out_dir, steps=steps, global_batch_size=16)
    cfg.model.llm.config = dict(MOE)
    cfg.parallel.ep = EP
    return cfg


def _kind(stack) -> str:
    """Who called the all-to-all: AutoEP's dispatch / combine, its count exchange, or other."""
    if not any(f.filename.endswith("auto_ep_layer.py") for f in stack):
        return "other"
    return "ep_counts" if any(f.name == "_split_plan_from_expert_counts" for f in stack) \
        else "llm_experts"


def count_all_to_alls(counts: dict, kind_of=_kind) -> None:
    """Wrap torch.distributed.all_to_all_single (deepspeed.comm calls it by keyword): per
    caller (`kind_of(stack)`: by default AutoEP's parts), the bytes this rank sends to other
    ranks, and every row it hands the call (`<kind>_rows`). tests/dist/test_sim_a2a_measured.py
    counts Ulysses' and resharding's calls with it."""
    import torch.distributed as dist
    original = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):
        me, g = dist.get_rank(group), dist.get_world_size(group)
        per_row = input.numel() // max(1, input.shape[0]) * input.element_size()
        splits = input_split_sizes or [input.shape[0] // g] * g
        kind = kind_of(traceback.extract_stack())
        counts[kind] = counts.get(kind, 0) + (sum(splits) - splits[me]) * per_row
        counts[kind + "_rows"] = counts.get(kind + "_rows", 0) + sum(splits)
        return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

    dist.all_to_all_single = counted


def ranks(rank: int, world: int, out_dir: str, steps: int) -> list[dict]:
    """This rank's log of `steps` steps: its all-to-all counts, AutoEP's load metrics and the
    metadata of the samples it trained."""
    import torch
    from benchmarks import sim_validation as sv
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.parallelize.expert_parallel import expert_load
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.train.setup import setup_training
    from ds_omni.train.step import train_step
    from tests.fixtures import ds_config
    torch.set_num_threads(1)
    cfg = make_config(out_dir, steps)
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    _, loader, engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_config(1), plan),
                                               rank, plan)
    counts: dict = {}
    count_all_to_alls(counts)
    log = []
    for _ in range(steps):
        batch = loader.next_step()
        counts.clear()
        train_step(engine, batch, groups)
        log.append({"a2a": dict(counts), "keys": sorted(batch.keys),
                    "load": expert_load(engine.module)})  # what the loop logs, every rank
    for record in log:
        record["samples"] = sv.sample_meta(loader, record.pop("keys"))
    return log


def measure(out_dir: str, steps: int, timeout: float = 800):
    """(the per-rank logs, the config's simulator model, its simulator plan)"""
    from ds_omni.sim.from_config import model_spec, sim_plan
    from tests.fixtures import ds_config
    from tests.harness import run_on_ranks
    per_rank = run_on_ranks(ranks, WORLD, args=(out_dir, steps), timeout=timeout)
    cfg = make_config(out_dir, steps)
    return per_rank, model_spec(cfg), sim_plan(cfg, ds_config(1), WORLD)


def compare(per_rank, model, plan) -> list[dict]:
    """Per step: bytes sent to other ranks (measured, bf16-equivalent) and the routed volume at
    uniform routing (measured rows), against the simulator's prediction."""
    from benchmarks import sim_validation as sv
    from ds_omni.sim import simulate
    from ds_omni.sim.cluster import cluster
    out = []
    for s in range(len(per_rank[0])):
        got = simulate(cluster("h100", WORLD, WORLD), model, sv.samples_of(per_rank, s), plan)
        a2a = [r[s]["a2a"] for r in per_rank]
        rows = sum(c.get("llm_experts_rows", 0) for c in a2a)
        row = {"measured_bytes": sum(c.get("llm_experts", 0) for c in a2a) / 2,  # fp32 -> bf16
               "uniform_bytes": rows * model.dims.hidden * 2 * (plan.ep - 1) / plan.ep,
               "predicted_bytes": got.all_to_all_bytes["llm_experts"],
               "count_exchange_bytes": sum(c.get("ep_counts", 0) for c in a2a), "rows": rows}
        predicted = max(row["predicted_bytes"], 1.0)
        row.update(measured_over_predicted=row["measured_bytes"] / predicted,
                   uniform_over_predicted=row["uniform_bytes"] / predicted,
                   # of the token copies a call handles, the fraction sent away (uniform: 1/2)
                   share_sent=row["measured_bytes"] / max(rows * model.dims.hidden * 2, 1))
        out.append(row)
    return out


def plot(steps: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(steps))
    width = 0.27
    for i, (key, label) in enumerate([("predicted_bytes", "simulated"),
                                      ("uniform_bytes", "measured rows, uniform routing"),
                                      ("measured_bytes", "measured, sent to other ranks")]):
        ax.bar([j + (i - 1) * width for j in x], [s[key] / 1e3 for s in steps], width,
               label=label)
    ax.set_xticks(list(x), [f"step {j}" for j in x])
    ax.set_ylabel("kB a step (bf16), both ranks")
    ax.set_title("ep=2 all-to-all bytes: AutoEP measured vs ds_omni.sim")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ep_a2a_") as tmp:
        steps = compare(*measure(tmp, args.steps))
    ratios = [s["measured_over_predicted"] for s in steps]
    out = {"world": WORLD, "ep": EP, "model": MOE, "steps": steps,
           "summary": {"measured_over_predicted_min": min(ratios),
                       "measured_over_predicted_max": max(ratios),
                       "uniform_over_predicted_max_error": max(
                           abs(s["uniform_over_predicted"] - 1) for s in steps)},
           "command": "benchmarks/ep_all_to_all.py " + " ".join(sys.argv[1:])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ep_all_to_all.json").write_text(json.dumps(out, indent=1))
    plot(steps, RESULTS / "ep_all_to_all.png")
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
