"""Sequence parallelism: reshard traffic against the naive schemes, and real step time sp=2 vs sp=1.

    .venv/bin/python benchmarks/sequence_parallel.py              # both parts, about 5 minutes
    .venv/bin/python benchmarks/sequence_parallel.py --only bytes # the metadata part, seconds
    .venv/bin/python benchmarks/sequence_parallel.py --only step  # the 2-rank training part

bytes: synthetic packed rows of 8K-32K tokens (metadata only, no model) go through the real
`item_slots` / `plan_reshard` / `bytes_moved` for sp in {2, 4, 8}, on an image-heavy and a
text-heavy mix, with a hidden size of 4096 in bf16 and an encoder cost quadratic in item length.
Per row it compares adaptive resharding (each item encoded by one rank chosen by LPT, then one
all-to-all) with (a) an all-gather of all embeddings to every SP rank, (b) every SP rank encoding
every item (no traffic, sp x the encoder work) and (c) each item encoded by the rank that holds
most of its placeholders (locality: little traffic, no encoder balance).

step: two ranks on CPU over gloo, through the real `setup_training` / `train_step`; sp=2 (dp=1)
against sp=1 (dp=2) with the same global batch, on (a) long image-heavy rows (2304 image tokens
per sample) and (b) the tiny default demo workload (plus sp=1 with micro-batches of one sample,
as many per rank as sp=2 runs). All variants' engines live in one launch and take one step each
per round, in an order that rotates, so a slow spell of the shared machine hits all of them; the
figure is the median over rounds of the paired ratio variant / sp=1 of step time (the slower
rank's; the loader's time is measured apart).

Writes benchmarks/results/sequence_parallel.json and sequence_parallel.png (a partial run keeps
the other part's results from the previous JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from ds_omni.parallel.reshard import bytes_moved, item_slots, plan_reshard  # noqa: E402

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
SP_SIZES = (2, 4, 8)
TEXT, PLACEHOLDER, PAD = 1, 2, 0  # token ids of the synthetic rows


# =============================================================================== bytes part
@dataclass(kw_only=True)
class Mix:
    """Parameters of one synthetic sample mix; all of them are written to the JSON."""

    image_sample_share: float
    """Share of samples that carry images."""
    images_per_image_sample: tuple[int, int]
    """Images of an image sample, uniform in this closed range (0 allowed: text-only)."""
    image_side: tuple[int, int] = (16, 48)
    """An image yields side^2 placeholder tokens, side uniform here: 256-2304 tokens."""
    text_median: float
    """Median text tokens of a sample without images (lognormal, sigma 1)."""
    caption_median: float = 200.0
    """Median text tokens of an image sample (lognormal, sigma 1)."""
    row_tokens: tuple[int, int] = (8192, 32768)
    """A packed row's token budget, uniform in this range."""


MIXES = {
    "image_heavy": Mix(image_sample_share=1.0, images_per_image_sample=(0, 4), text_median=200.0),
    "text_heavy": Mix(image_sample_share=0.05, images_per_image_sample=(1, 2), text_median=1500.0),
}


def draw_row(mix: Mix, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """One packed row: token ids [T] (placeholders among text) and each image's token count."""
    budget = int(rng.integers(mix.row_tokens[0], mix.row_tokens[1] + 1))
    parts, sizes, used = [], [], 0
    while True:
        ids, images = _draw_sample(mix, rng)
        if used + len(ids) > budget:
            if not parts:  # a first sample longer than the row: keep its head, as overlong="crop"
                ids = ids[:budget]
                images = _sizes_in(ids)
                parts, sizes, used = [ids], images, len(ids)
            break
        parts.append(ids)
        sizes += images
        used += len(ids)
    return np.concatenate(parts), sizes


def _draw_sample(mix: Mix, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    has_images = rng.random() < mix.image_sample_share
    n_images = int(rng.integers(mix.images_per_image_sample[0],
                                mix.images_per_image_sample[1] + 1)) if has_images else 0
    median = mix.caption_median if n_images else mix.text_median
    text = max(8, int(rng.lognormal(np.log(median), 1.0)))
    images = [int(rng.integers(mix.image_side[0], mix.image_side[1] + 1)) ** 2
              for _ in range(n_images)]
    cuts = np.sort(rng.integers(0, text + 1, n_images))  # images sit among the text
    pieces, last = [], 0
    for cut, n in zip(cuts, images):
        pieces += [np.full(cut - last, TEXT), np.full(n, PLACEHOLDER)]
        last = cut
    pieces.append(np.full(text - last, TEXT))
    return np.concatenate(pieces).astype(np.int64), images


def _sizes_in(ids: np.ndarray) -> list[int]:
    """Token counts of the placeholder runs of `ids` (for a cropped sample; adjacent images merge,
    which only matters for the rare first-sample crop)."""
    mask = np.concatenate([[0], (ids == PLACEHOLDER).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(mask))
    return (edges[1::2] - edges[0::2]).tolist()


def item_cost(n: np.ndarray | int) -> np.ndarray:
    """Modelled encoder cost of an item of n embeddings: quadratic (attention over its patches)."""
    return np.asarray(n, dtype=np.float64) ** 2


def reshard_row(ids: np.ndarray, sizes: list[int], sp: int, hidden: int, dtype_bytes: int) -> dict:
    """Every scheme's traffic and encoder load for one row at one SP degree."""
    pad = -len(ids) % sp
    ids = np.concatenate([ids, np.full(pad, PAD)])  # as packing pads the row to a multiple of sp
    shard_len = len(ids) // sp
    costs = item_cost(sizes).tolist()
    t0 = time.perf_counter()
    slots = item_slots(ids, {"vision": PLACEHOLDER}, {"vision": sizes}, {"vision": costs})
    plans = plan_reshard(slots, sp, shard_len, ["vision"])
    plan_s = time.perf_counter() - t0
    moved = bytes_moved(plans, hidden, dtype_bytes)
    lpt = np.array([sum(costs[k] for k in p.encode.get("vision", [])) for p in plans])  # [sp]
    local_bytes, local = _locality(slots, sp, shard_len, hidden * dtype_bytes)
    total = float(sum(costs))
    return {"reshard": moved["reshard"], "all_gather": moved["all_gather"],
            "locality_bytes": local_bytes, "items": len(sizes), "embeddings": int(sum(sizes)),
            "lpt_max": float(lpt.max()), "locality_max": float(local.max()), "total_cost": total,
            "largest_item": float(max(costs, default=0.0)), "plan_s": plan_s}


def _locality(slots, sp: int, shard_len: int, row_bytes: int) -> tuple[int, np.ndarray]:
    """Scheme (c): each item encoded where most of its placeholders are; bytes and load [sp]."""
    load, moved = np.zeros(sp), 0
    for s in slots:
        held = np.bincount(s.positions // shard_len, minlength=sp)
        owner = int(np.argmax(held))
        load[owner] += s.cost
        moved += int(len(s.positions) - held[owner])
    return moved * row_bytes, load


def bytes_part(rows: int, hidden: int, dtype_bytes: int, seed: int) -> dict:
    results = []
    for mix_i, (name, mix) in enumerate(MIXES.items()):
        rng = np.random.default_rng([seed, mix_i])
        drawn = [draw_row(mix, rng) for _ in range(rows)]
        for sp in SP_SIZES:
            per_row = [reshard_row(ids, sizes, sp, hidden, dtype_bytes) for ids, sizes in drawn]
            results.append({"mix": name, "sp": sp, **summarise(per_row, sp),
                            "row_tokens_median": float(np.median([len(i) for i, _ in drawn]))})
            r = results[-1]
            print(f"bytes {name} sp={sp}: reshard/all-gather {r['reshard_over_all_gather']:.3f}, "
                  f"rows moved {r['rows_moved_share']:.2f}, LPT max/mean "
                  f"{r['lpt_max_over_mean_median']:.3f}", flush=True)
    return {"rows_per_mix": rows, "hidden": hidden, "dtype_bytes": dtype_bytes, "seed": seed,
            "item_cost": "n^2 (n = the item's embeddings)",
            "mixes": {k: asdict(m) for k, m in MIXES.items()}, "results": results}


def summarise(per_row: list[dict], sp: int) -> dict:
    """Ratios over the rows of one mix and SP degree (rows without items only count for bytes)."""
    col = lambda k: np.array([r[k] for r in per_row], dtype=np.float64)  # noqa: E731
    reshard, gather, local = col("reshard"), col("all_gather"), col("locality_bytes")
    with_items = col("items") > 0
    mean_load = col("total_cost")[with_items] / sp
    lpt = col("lpt_max")[with_items] / mean_load
    loc = col("locality_max")[with_items] / mean_load
    floor = np.maximum(col("largest_item")[with_items] / mean_load, 1.0)
    every = col("total_cost")[with_items] / col("lpt_max")[with_items]  # scheme (b)'s max / LPT's
    mb = 1 / 2 ** 20
    q = lambda x, p: float(np.percentile(x, p))  # noqa: E731
    return {
        "rows": len(per_row), "rows_with_items_share": float(with_items.mean()),
        "items_per_row_mean": float(col("items").mean()),
        "embeddings_per_row_mean": float(col("embeddings").mean()),
        # (a) all-gather
        "reshard_mb_per_row_mean": float(reshard.mean() * mb),
        "all_gather_mb_per_row_mean": float(gather.mean() * mb),
        "reshard_over_all_gather": float(reshard.sum() / gather.sum()),
        "reshard_over_all_gather_per_row_median": float(np.median(reshard[with_items] /
                                                                  gather[with_items])),
        "rows_moved_share": float((reshard > 0).mean()),
        "rows_moved_share_of_rows_with_items": float((reshard[with_items] > 0).mean()),
        # encoder load under the plan
        "lpt_max_over_mean_median": float(np.median(lpt)), "lpt_max_over_mean_p90": q(lpt, 90),
        "lpt_max_over_mean_mean": float(lpt.mean()),
        "single_item_floor_median": float(np.median(floor)), "single_item_floor_p90": q(floor, 90),
        "lpt_on_floor_share": float(np.mean(np.isclose(lpt, floor, rtol=1e-9))),
        # (b) every rank encodes every item
        "encode_all_work_multiplier": float(sp),
        "encode_all_max_over_lpt_max_median": float(np.median(every)),
        "encode_all_max_over_lpt_max_p10": q(every, 10),
        # (c) locality: encode where the placeholders are
        "locality_mb_per_row_mean": float(local.mean() * mb),
        "locality_over_all_gather": float(local.sum() / gather.sum()),
        "locality_max_over_mean_median": float(np.median(loc)),
        "locality_max_over_mean_p90": q(loc, 90),
        "plan_ms_per_row_median": float(np.median(col("plan_s")) * 1e3),
    }


# ================================================================================ step part
LONG_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "image_size": 192, "patch_size": 4}  # 48^2 = 2304 tokens
LONG_LLM = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
            "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 4096}


@dataclass(kw_only=True)
class Workload:
    """One step-time workload: overrides of the tiny test config (tests/fixtures.py)."""

    vision: dict
    llm: dict
    max_seq_len: int
    global_batch_size: int
    micro_batch_size: int
    steps: int
    """Measured steps per variant (after `warmup`)."""
    warmup: int
    profile_steps: int
    """sp=2 steps profiled after the timed rounds, to attribute its time to the all-to-alls."""
    variants: dict[str, tuple[int, int]]
    """label -> (sp, micro_batch_size); "sp1" is the baseline, every other is divided by it."""


BASE_VARIANTS = {"sp1": (1, 2), "sp2": (2, 2)}
WORKLOADS = {
    # one 192 px image per sample at patch 4: 2304 placeholder tokens + ~25 text; two samples a row
    "long_image": Workload(vision=LONG_VISION, llm=LONG_LLM, max_seq_len=2560,
                           global_batch_size=4, micro_batch_size=2, steps=8, warmup=1,
                           profile_steps=1, variants=BASE_VARIANTS),
    # the default tiny demo config: one 16-token image + ~25 text tokens per sample. "sp1_mb1"
    # runs sp=1 with as many micro-batches per rank as sp=2 has (4), to split SP's overhead into
    # "more, smaller passes" and "the SP machinery itself"
    "short_uniform": Workload(vision={}, llm={}, max_seq_len=128, global_batch_size=8,
                              micro_batch_size=2, steps=30, warmup=3,
                              profile_steps=6, variants={**BASE_VARIANTS, "sp1_mb1": (1, 1)}),
}


def workload_config(work: Workload, label: str, output_dir: str):
    from ds_omni.config import OmniConfig, from_dict
    from tests.fixtures import tiny_config_dict
    sp, micro = work.variants[label]
    d = tiny_config_dict(output_dir, steps=work.warmup + work.steps,
                         global_batch_size=work.global_batch_size, micro_batch_size=micro)
    d["model"]["vision"]["config"].update(work.vision)
    d["model"]["llm"]["config"].update(work.llm)
    d["data"]["max_seq_len"] = work.max_seq_len
    # the same token budget per packed row whatever the micro-batch size
    d["data"]["pack_tokens"] = work.max_seq_len * work.micro_batch_size
    d["parallel"] = {"sp": sp}
    return from_dict(OmniConfig, d)


def step_ranks(rank: int, world: int, name: str, zero_stage: int, out_dir: str) -> dict:
    """Every variant of workload `name` on this rank; each round runs one step of each, in an
    order that rotates from round to round."""
    import torch
    from deepspeed.utils import groups as ds_groups
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.setup import setup_training
    from tests.fixtures import ds_config
    torch.set_num_threads(1)  # two ranks on two cores
    work = WORKLOADS[name]
    runs, setup_s = {}, {}
    for label in work.variants:
        t0 = time.perf_counter()
        cfg = workload_config(work, label, f"{out_dir}/{label}")
        plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
        _, loader, engine, groups = setup_training(
            cfg, derive_ds_config(cfg, ds_config(zero_stage), plan), rank, plan)
        runs[label] = (loader, engine, groups)
        setup_s[label] = time.perf_counter() - t0
    labels = list(runs)
    log = {label: [] for label in labels}
    for i in range(work.warmup + work.steps):
        for label in labels[i % len(labels):] + labels[:i % len(labels)]:
            log[label].append(_one_step(*runs[label], ds_groups))
    return {"log": log, "setup_s": setup_s, "threads": torch.get_num_threads(),
            "comm": _comm_profile(*runs["sp2"], ds_groups, work.profile_steps)}


def _one_step(loader, engine, groups, ds_groups) -> dict:
    import torch.distributed as dist
    from ds_omni.train.step import train_step
    # DeepSpeed reads its sequence-parallel degree and groups from a module global (set by the
    # last `initialize`); engines alternate here, so each gets its own back before stepping
    ds_groups.mpu = engine.mpu
    dist.barrier()
    t0 = time.perf_counter()
    batch = loader.next_step()
    t1 = time.perf_counter()
    result = train_step(engine, batch, groups)
    t2 = time.perf_counter()
    items = sum(int(mb.encoder_inputs["vision"]["pixel_values"].shape[0])
                for mb in batch.micro_batches if "vision" in mb.encoder_inputs)
    return {"load_s": t1 - t0, "step_s": t2 - t1, "loss": result.loss, "tokens": result.tokens,
            "keys": sorted(batch.keys), "micro_batches": len(batch.micro_batches),
            "images_encoded": items}


COMM_EVENTS = ("_SeqAllToAll", "ReshardEmbeddings", "ReshardEmbeddingsBackward")
"""Profiler events that cover SP's all-to-alls: DeepSpeed's Ulysses exchange (its backward calls
the same Function again, so its total counts both directions) and ds_omni's reshard, each with
the gloo call and the wait for the other rank inside it."""


def _comm_profile(loader, engine, groups, ds_groups, steps: int) -> dict:
    """Share of sp=2's step time spent inside its all-to-alls, from a CPU profile of a few steps
    taken after the timed rounds (the profiler's overhead stays out of the timings)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logs = [_one_step(loader, engine, groups, ds_groups) for _ in range(steps)]
    inside = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key in COMM_EVENTS}
    wall = sum(log["step_s"] for log in logs)
    return {"steps": steps, "step_s": wall / steps,
            "all_to_all_s_per_step": {k: v / steps for k, v in inside.items()},
            "share_of_step": sum(inside.values()) / wall}


def step_part(names: list[str], zero_stage: int, timeout: float) -> dict:
    import tempfile
    from tests.harness import run_on_ranks
    out = {"zero_stage": zero_stage, "workloads": {}, "load_average_before": os.getloadavg()}
    for name in names:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="ds_omni_spbench_") as tmp:
            ranks = run_on_ranks(step_ranks, 2, args=(name, zero_stage, tmp), timeout=timeout)
        out["workloads"][name] = r = summarise_steps(name, ranks)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"step {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["over_sp1"].items())
              + f" (sp1 {r['sp1']['step_s_median']:.3f} s); sp2 in all-to-alls "
              f"{r['sp2_all_to_all_share_of_step']:.0%}; wall {r['wall_s']} s", flush=True)
    return out


def summarise_steps(name: str, ranks: list[dict]) -> dict:
    work = WORKLOADS[name]
    w = work.warmup
    per = {label: _variant(label, ranks) for label in work.variants}
    measured = {label: v["step_s"][w:] for label, v in per.items()}
    ratios = {label: [b / a for a, b in zip(measured["sp1"], measured[label])]
              for label in per if label != "sp1"}
    out = {
        "workload": asdict(work), "attention_share_of_llm_flops": llm_attention_share(work),
        # the headline: median over rounds of the paired ratio (one step of each per round)
        "over_sp1": {label: statistics.median(r) for label, r in ratios.items()},
        "over_sp1_per_round": ratios,
        "over_sp1_of_medians": {label: statistics.median(measured[label])
                                / statistics.median(measured["sp1"]) for label in ratios},
        "load_over_sp1": {label: statistics.median(per[label]["load_s"][w:])
                          / statistics.median(per["sp1"]["load_s"][w:]) for label in ratios},
        # dp=2 and dp=1 read different shards of the stream: same sizes, not the same samples
        "same_global_batches_sp2_sp1": per["sp1"].pop("keys") == per["sp2"].pop("keys"),
        "torch_threads_per_rank": ranks[0]["threads"],
        "sp2_profile_per_rank": [r["comm"] for r in ranks],
        "sp2_all_to_all_share_of_step": statistics.mean(r["comm"]["share_of_step"] for r in ranks),
    }
    for label, v in per.items():
        v.pop("keys", None)
        out[label] = {"step_s_median": statistics.median(measured[label]),
                      "load_s_median": statistics.median(v["load_s"][w:]), **v}
    return out


def _variant(label: str, ranks: list[dict]) -> dict:
    logs = [r["log"][label] for r in ranks]  # [rank][step]
    steps = range(len(logs[0]))
    return {
        "step_s": [max(log[i]["step_s"] for log in logs) for i in steps],  # the slower rank
        "load_s": [max(log[i]["load_s"] for log in logs) for i in steps],
        # the global batch: union over data-parallel ranks (under sp=2 both hold the same rows)
        "keys": [sorted({k for log in logs for k in log[i]["keys"]}) for i in steps],
        "loss": [logs[0][i]["loss"] for i in steps],
        "tokens_per_step": logs[0][-1]["tokens"],
        "micro_batches": logs[0][-1]["micro_batches"],
        "images_encoded_per_rank_last_step": [log[-1]["images_encoded"] for log in logs],
        "setup_s": max(r["setup_s"][label] for r in ranks),
    }


def llm_attention_share(work: Workload) -> float:
    """Attention's share of the LLM's forward matmul FLOPs for one sample (analytic, causal).

    Per token and layer: projections 2 (2 h^2 + 2 h kv_dim) + MLP 6 h i; attention scores and
    values 2 * 2 * (L / 2) h (causal: half the keys on average). The LM head is left out.
    """
    from tests.fixtures import TINY_LLAMA, TINY_VISION
    llm = {**TINY_LLAMA, **work.llm}
    vision = {**TINY_VISION, **work.vision}
    h, i = llm["hidden_size"], llm["intermediate_size"]
    kv_dim = h // llm["num_attention_heads"] * llm["num_key_value_heads"]
    length = (vision["image_size"] // vision["patch_size"]) ** 2 + 25  # image tokens + ~text
    linear = 2 * (2 * h * h + 2 * h * kv_dim) + 6 * h * i
    attention = 2 * length * h
    return attention / (attention + linear)


# ==================================================================================== report
def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    res = report.get("bytes", {}).get("results", [])
    width = 0.2
    for k, (mix, style) in enumerate((("image_heavy", "C0"), ("text_heavy", "C1"))):
        rows = [r for r in res if r["mix"] == mix]
        if not rows:
            continue
        x = np.arange(len(rows)) + (k - 0.5) * 2 * width
        axes[0].bar(x - width / 2, [r["reshard_over_all_gather"] for r in rows], width,
                    color=style, label=f"{mix}: LPT reshard")
        axes[0].bar(x + width / 2, [r["locality_over_all_gather"] for r in rows], width,
                    color=style, alpha=0.4, hatch="//", label=f"{mix}: encode where placed")
        axes[1].plot([r["sp"] for r in rows], [r["lpt_max_over_mean_median"] for r in rows],
                     f"{style}-o", label=f"{mix}: LPT (reshard)")
        axes[1].plot([r["sp"] for r in rows], [r["locality_max_over_mean_median"] for r in rows],
                     f"{style}--s", label=f"{mix}: encode where placed")
        axes[1].plot([r["sp"] for r in rows], [r["single_item_floor_median"] for r in rows],
                     f"{style}:", label=f"{mix}: single-item floor")
    axes[0].set(xticks=range(len(SP_SIZES)), xticklabels=[f"sp={s}" for s in SP_SIZES],
                ylabel="bytes / all-gather bytes", title="embedding traffic per row (all-gather = 1)")
    axes[0].legend(fontsize=7)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set(xscale="log", xticks=SP_SIZES, xticklabels=[str(s) for s in SP_SIZES],
                xlabel="SP degree", ylabel="max / mean encoder cost per rank (median row)",
                title="encoder balance (encode-all: 1.0 at sp x the work)")
    axes[1].xaxis.set_minor_formatter(NullFormatter())
    axes[1].legend(fontsize=7)
    steps = report.get("step", {}).get("workloads", {})
    bars = [(f"{n}\n{label}", steps[n]["over_sp1"][label], steps[n]["over_sp1_per_round"][label])
            for n in steps for label in steps[n]["over_sp1"]]
    if bars:
        axes[2].bar(range(len(bars)), [b[1] for b in bars], color="C3", tick_label=[b[0] for b in bars])
        for j, (_, _, rounds) in enumerate(bars):
            axes[2].plot([j] * len(rounds), rounds, "k.", ms=4)
        axes[2].axhline(1.0, color="grey", lw=0.8)
        axes[2].set(yscale="log", ylabel="step time / sp=1 (dp=2) step time",
                    title="2 CPU ranks, same global batch (dots: rounds)")
        axes[2].tick_params(axis="x", labelsize=7)
        axes[2].yaxis.set_major_formatter(ScalarFormatter())
        axes[2].yaxis.set_minor_formatter(NullFormatter())
        axes[2].set_yticks([0.5, 0.75, 1, 1.5, 2, 3, 4])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("bytes", "step"))
    ap.add_argument("--rows", type=int, default=400, help="synthetic rows per mix (bytes part)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--zero-stage", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=400.0, help="per launch of 2 ranks, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    path = args.out / "sequence_parallel.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    if args.only != "step":
        t0 = time.perf_counter()
        report["bytes"] = bytes_part(args.rows, args.hidden, 2, args.seed)
        report["bytes"]["runtime_s"] = round(time.perf_counter() - t0, 1)
        report["bytes"]["command"] = (".venv/bin/python benchmarks/sequence_parallel.py --only bytes"
                                      + (f" --rows {args.rows}" if args.rows != 400 else ""))
    if args.only != "bytes":
        t0 = time.perf_counter()
        report["step"] = step_part(args.workloads, args.zero_stage, args.timeout)
        report["step"]["runtime_s"] = round(time.perf_counter() - t0, 1)
        report["step"]["load_average_after"] = os.getloadavg()
        report["step"]["command"] = ".venv/bin/python benchmarks/sequence_parallel.py --only step"
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    plot(report, args.out / "sequence_parallel.png")


if __name__ == "__main__":
    main()
