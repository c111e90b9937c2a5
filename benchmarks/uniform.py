"""Uniform workload: ds_omni's step, its loading included, against the same HF model trained under
DeepSpeed on ready tensors, side by side in one process.

    .venv/bin/python benchmarks/uniform.py     # writes benchmarks/results/uniform.json

What the machinery costs when there is nothing to balance: 16 one-image samples per step (the
shapes conversations of `benchmarks/loader.py`, 256-pixel JPEGs, about the same length each),
micro-batches of 4, a tiny LLaVA saved with `save_pretrained` and loaded back by both sides,
ZeRO-2, fp32, torch AdamW, one data-parallel rank. The trainer holds one core
(`torch.set_num_threads(1)`; `data.pin_cores` pins it there once ds_omni's loader is built, for
both sides); ds_omni's loading runs on the other (`data.workers` 1: its loader process, pinned
to it), as a GPU host's trainer would leave the device work to the GPU. The placement is in the
results.

- ds_omni: the run's own pieces (`setup_training`, its feed, `train_step`) from its config
  (`data.workers` 1: the whole loader in a loader process, the trainer receives finished batches);
  a step's time includes reading, decoding, the HF processor and packing, whatever of it is not
  hidden behind the step.
- ds_omni on ready batches: the same engine fed step batches made before the clock starts, which
  tells what the loading costs (omni / omni_ready) from what the step costs (omni_ready / hf).
- baseline: `LlavaForConditionalGeneration.from_pretrained` of the same directory under
  `deepspeed.initialize` with the same DeepSpeed config, fed the same samples as padded tensors
  made before the clock starts (what a user's loop over a ready dataset sees).

Rounds alternate the order of the sides; tokens/s is real tokens over wall time, the ratio
ds_omni / baseline a median over rounds. The machine's load average is recorded with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
BATCH, MICRO, IMAGE_PX = 16, 4, 256
IGNORE = -100


def omni_side(cfg, ds_path: str, ready: list):
    """Step functions of ds_omni's own training step: loading included, and on `ready` batches
    (the same engine), which tells the loading's cost from the step's."""
    from ds_omni.data.loader_process import feed_for
    from ds_omni.parallel import dist
    from ds_omni.train.setup import preflight, setup_training
    from ds_omni.train.step import train_step
    from ds_omni.train.nonfinite import NonFiniteGuard
    plan, ds_config = preflight(cfg, ds_path)
    rank, _ = dist.init_distributed(600.0)
    _, loader, engine, groups = setup_training(cfg, ds_config, rank, plan)
    feed = feed_for(loader, cfg.data.prefetch_steps)  # data.workers 1: the loader process's
    guard = NonFiniteGuard(engine)

    def step() -> int:
        batch = feed.next_step()
        step.wait_s += feed.last_wait_s
        assert batch.error is None, batch.error
        train_step(engine, batch, groups, guard=guard)
        return sum(mb.num_tokens for mb in batch.micro_batches)
    step.wait_s = 0.0
    it = iter(range(10 ** 9))

    def ready_step() -> int:
        batch = ready[next(it) % len(ready)]
        train_step(engine, batch, groups, guard=guard)
        return sum(mb.num_tokens for mb in batch.micro_batches)
    return step, ready_step, feed, ds_config


def ready_batches(cfg, n_steps: int) -> tuple[list, list[list[dict]]]:
    """The first steps, made before the clock starts by a loader of their own: ds_omni's step
    batches, and their samples as padded HF batches."""
    from ds_omni.data.build import build_loader
    from ds_omni.model.build import build_model
    built = build_model(cfg.model)
    loader = build_loader(cfg, built, num_micro=BATCH // MICRO)
    omni, hf = [], []
    for _ in range(n_steps):
        omni.append(loader.next_step())
        samples = loader.load_samples(omni[-1].keys)
        hf.append([_padded(samples[i:i + MICRO]) for i in range(0, len(samples), MICRO)])
    loader.close()
    return omni, hf


def _padded(samples) -> dict:
    import torch
    width = max(s.length for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE)
    attn = torch.zeros(len(samples), width, dtype=torch.long)
    for j, s in enumerate(samples):
        ids[j, :s.length], attn[j, :s.length] = s.input_ids, 1
        labels[j, :s.length] = torch.where(s.loss_mask, s.input_ids, IGNORE)
    pixels = [item.inputs["pixel_values"] for s in samples for _, item in s.items]
    return {"input_ids": ids, "attention_mask": attn, "labels": labels,
            "pixel_values": torch.cat([p.reshape(-1, *p.shape[-3:]) for p in pixels])}


def hf_side(model_dir: str, ds_config: dict, steps: list[list[dict]]):
    import deepspeed
    from deepspeed.utils import groups as ds_groups
    from transformers import LlavaForConditionalGeneration
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa")
    hf.train()
    ds_groups.mpu = None
    engine, *_ = deepspeed.initialize(model=hf, model_parameters=hf.parameters(),
                                      config=ds_config)
    it = iter(range(10 ** 9))

    def step() -> int:
        batches = steps[next(it) % len(steps)]
        for b in batches:
            engine.backward(engine(**b).loss)
            engine.step()
        return int(sum(int(b["attention_mask"].sum()) for b in batches))
    return step


def timed(step, n: int) -> dict:
    """Tokens/s of n steps (and, for ds_omni, how long it waited for data)."""
    tokens, t0, wait0 = 0, time.perf_counter(), getattr(step, "wait_s", 0.0)
    for _ in range(n):
        tokens += step()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            **({"data_wait_s": step.wait_s - wait0} if hasattr(step, "wait_s") else {})}


def setup(root: Path):
    from ds_omni.config import OmniConfig, from_dict
    from loader import make_sources, quiet_datasets
    from tests.family_dirs import make_llava_dir
    from tests.fixtures import ds_config
    quiet_datasets()
    model_dir = make_llava_dir(root / "llava")
    cfg = from_dict(OmniConfig, {
        "model": {"pretrained": str(model_dir)},
        "data": {"sources": make_sources(root / "data", 1, 2000, IMAGE_PX), "max_seq_len": 256,
                 "chunk_rows": 256, "prefetch_steps": 1, "workers": 1, "pin_cores": True},
        "train": {"steps": 10 ** 6, "global_batch_size": BATCH, "micro_batch_size": MICRO,
                  "lr": 1e-4, "output_dir": str(root / "run"), "export_hf": False}})
    ds_path = root / "ds.json"
    ds_path.write_text(json.dumps(ds_config(2)))
    return cfg, str(ds_path), str(model_dir)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ds_omni_uniform_"))
    cfg, ds_path, model_dir = setup(root)
    ready_omni, ready_hf = ready_batches(cfg, args.steps)
    omni, omni_ready, feed, ds_config = omni_side(cfg, ds_path, ready_omni)
    sides = {"omni": omni, "omni_ready": omni_ready,
             "hf": hf_side(model_dir, ds_config, ready_hf)}
    for side in sides.values():  # warm-up: files opened, the worker started, first allocations
        timed(side, 3)
    rounds, load = [], [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = list(sides.items())
        rounds.append({name: timed(side, args.steps) for name, side in
                       (order if r % 2 == 0 else order[::-1])})
        load.append(os.getloadavg()[0])
        print({k: (round(v["tokens_per_s"]), round(v.get("data_wait_s", 0), 3))
               for k, v in rounds[-1].items()}, flush=True)
    feed.close()
    placement = feed.loader.cores.record()
    feed.loader.close()
    def ratio(a, b):
        return statistics.median(r[a]["tokens_per_s"] / r[b]["tokens_per_s"] for r in rounds)
    result = {"ratio_omni_over_hf_tokens_per_s": ratio("omni", "hf"),
              "ratio_omni_ready_over_hf": ratio("omni_ready", "hf"),
              "ratio_omni_over_omni_ready": ratio("omni", "omni_ready"), "rounds": rounds,
              "load_average_1min": load, "steps_per_round": args.steps,
              "setup": {"global_batch": BATCH, "micro_batch": MICRO, "image_px": IMAGE_PX,
                        "trainer_threads": 1, "data_workers": 1, "prefetch_steps": 1,
                        "zero_stage": 2},
              # data.pin_cores: the training process (both sides) on one core, the loader
              # process on another
              "placement": placement, "cores": sorted(os.sched_getaffinity(0))}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "uniform.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
