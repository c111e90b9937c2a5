"""GPU throughput and MFU: ds_omni's packed step against the HF LLaVA loop a user writes today.

    python benchmarks/gpu_mfu.py           # one GPU, bf16, a ~1.4B LLaVA; about 2-3 minutes on an H200
    python benchmarks/gpu_mfu.py --tiny    # CPU (or GPU), tiny dims, fp32 on CPU: seconds (tested)

The model is LLaVA-1.5-style, built from configs with random weights (no download): a CLIP
ViT-L/14 tower at 336 pixels (24 layers, width 1024; 576 patch embeddings per image, CLS dropped),
the 2-layer GELU projector, and a 1B Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP
8192, vocabulary 32064 as LLaVA-1.5's). One `LlavaForConditionalGeneration` holds the weights;
ds_omni's `OmniModel` is made from it by the llava family adapter and shares every parameter, so
both sides train the very same model, alternately, in one process.

Workload (synthetic, from a seed): a skewed image/text mix. 60 % of samples are one image plus a
short caption (lognormal, median 80 tokens), 40 % are text only (lognormal, median 700 tokens,
sigma 1.1, capped so no sample exceeds --max-len). A step takes the next samples that fill
--rows packed rows of --row-tokens (16K) tokens; both sides get exactly those samples, on the
device, with an optimizer step (fused AdamW on CUDA) at the end:
- ds_omni: each row is one micro-batch (`ds_omni.data.packing.pack`), run by `OmniModel` with
  `attn_implementation="auto"` (torch's varlen FlashAttention kernel on CUDA; per-sample SDPA on
  CPU), loss summed over target tokens and divided by the step's target count;
- baseline: the HF model's own forward with `labels`, SDPA attention, --micro-batch samples per
  micro-batch in loader order, right-padded to the longest one (what a DataLoader with a padding
  collator gives), loss weighted by target tokens so both sides optimise the same objective.
The rounds interleave the two sides (the order alternates), after --warmup rounds of each;
the figures are medians over rounds. Data loading is not timed (batches are made before the
clock starts; the host-to-device copy is timed, on both sides).

Model FLOPs come from the configs, not the implementation, and are the same for both sides:
6 x parameters x tokens for every matmul a token passes through (LLM decoder layers for every
real token, the LM head for target tokens only, the vision layers up to LLaVA's feature layer
for each image's 577 positions, the projector for its 576 embeddings; embedding lookups are not
matmuls), plus attention: 6 x layers x width x s^2 per sample for the causal LLM (FlashAttention
computes half the square) and 12 x layers x width x 577^2 per image for the bidirectional ViT.
MFU = model FLOPs per second / the GPU's dense bf16 peak (`PEAK_BF16_TFLOPS`, by device name;
`--peak-tflops` for another GPU). Padding is never counted, so MFU measures useful work.

Runs without DeepSpeed: both sides are a plain torch loop on one GPU (on one GPU, DeepSpeed would
add only its optimizer; both sides use torch's fused AdamW). It needs torch >= 2.10 (varlen
kernel; 2.10's and later signatures both work), transformers, numpy and this repository, nothing
else of ds_omni's dependencies (no datasets, no deepspeed). On the project's device machine
(one H200, torch 2.11, no deepspeed, no network), from the repository root, about 2-3 minutes:

    PYTHONPATH=$PWD python benchmarks/gpu_mfu.py --out $OUT/gpu_mfu.json

then copy the JSON to benchmarks/results/ and the figures into BENCHMARKS.md. A side that fails
(out of memory, a kernel error) is recorded in the JSON with its error and the other still runs;
`--micro-batch 2` lowers the baseline's memory if it runs out.

Writes benchmarks/results/gpu_mfu.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or REPO / "benchmarks" / "results")
IGNORE = -100
# Dense (no sparsity) bf16 tensor-core peaks, TFLOPS, by a substring of the device name; the
# first match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0), ("H100", 989.0),
                    ("H800", 989.0), ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0),
                    ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0))


# ================================================================================== the model
@dataclass(kw_only=True)
class ModelSpec:
    """Sizes of the LLaVA model; all of them are written to the JSON."""

    vision: dict
    """CLIPVisionConfig fields."""
    llm: dict
    """LlamaConfig fields."""
    image_token_id: int
    vision_feature_layer: int = -2


FULL = ModelSpec(
    vision={"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
            "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "projection_dim": 768},
    llm={"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32064,
         "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False},
    image_token_id=32000)
TINY = ModelSpec(
    vision={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
    llm={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 1024, "tie_word_embeddings": False},
    image_token_id=250)


def build_models(spec: ModelSpec, device: torch.device, dtype: torch.dtype):
    """(HF LlavaForConditionalGeneration, ds_omni OmniModel sharing its parameters)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from ds_omni.model.attention import PackedAttention
    from ds_omni.model.families.llava import Llava
    vision = CLIPVisionConfig(**spec.vision, attn_implementation="sdpa")
    llm = LlamaConfig(**spec.llm, attn_implementation="sdpa")
    config = LlavaConfig(vision_config=vision, text_config=llm, image_token_index=spec.image_token_id,
                         vision_feature_layer=spec.vision_feature_layer,
                         vision_feature_select_strategy="default",
                         image_seq_length=patches(spec), attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlavaForConditionalGeneration(config).to(dtype)
    omni = Llava().to_omni(hf)  # the LLM's attention becomes ds_omni's packed kernel
    omni.backbone.attention = PackedAttention("auto")
    # HF's own forward (the baseline) still runs SDPA with its padding mask: ds_omni's kernel
    # hands calls without `cu_seqlens` to transformers' SDPA function
    return hf, omni


def patches(spec: ModelSpec) -> int:
    """Embeddings per image ("default" drops CLS): (336 / 14)^2 = 576."""
    return (spec.vision["image_size"] // spec.vision["patch_size"]) ** 2


# ============================================================================== the workload
@dataclass(kw_only=True)
class Mix:
    """The synthetic image/text mix; written to the JSON."""

    image_share: float = 0.6
    caption_median: float = 80.0
    text_median: float = 700.0
    text_sigma: float = 1.1


@dataclass
class Doc:
    """One sample: token ids [L] (placeholders included), loss mask [L], its image or None."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    pixels: torch.Tensor | None  # [3, S, S]


def draw_doc(rng: np.random.Generator, spec: ModelSpec, mix: Mix, max_len: int) -> Doc:
    """An image + caption sample, or a text-only one; text ids avoid the image token."""
    n_img = patches(spec)
    image = rng.random() < mix.image_share
    if image:
        text = int(np.clip(rng.lognormal(math.log(mix.caption_median), 0.6), 4, max_len - n_img - 1))
    else:
        text = int(np.clip(rng.lognormal(math.log(mix.text_median), mix.text_sigma), 16, max_len - 1))
    words = torch.from_numpy(rng.integers(1, spec.image_token_id, 1 + text))  # BOS slot + text
    if not image:
        return Doc(words, torch.arange(len(words)) > 0, None)
    ids = torch.cat([words[:1], torch.full((n_img,), spec.image_token_id), words[1:]])
    mask = torch.arange(len(ids)) > n_img  # the caption is the target
    side = spec.vision["image_size"]
    pixels = torch.from_numpy(rng.standard_normal((3, side, side), dtype=np.float32))
    return Doc(ids, mask, pixels)


def draw_steps(rng, spec: ModelSpec, mix: Mix, n_steps: int, rows: int, row_tokens: int,
               max_len: int) -> list[list[list[Doc]]]:
    """n_steps steps, each `rows` packed rows (first fit in arrival order) of <= row_tokens."""
    steps = []
    pending = None
    for _ in range(n_steps):
        step = [[]]
        while True:
            doc = pending or draw_doc(rng, spec, mix, max_len)
            pending = None
            if sum(len(d.input_ids) for d in step[-1]) + len(doc.input_ids) > row_tokens:
                if len(step) == rows:
                    pending = doc
                    break
                step.append([])
            step[-1].append(doc)
        steps.append(step)
    return steps


def omni_batches(step: list[list[Doc]], spec: ModelSpec):
    """ds_omni: one packed MicroBatch per row, through ds_omni's packing."""
    from ds_omni.data.packing import pack
    from ds_omni.data.processing import Sample
    from ds_omni.batch import EncodedItem, ItemProcessor

    def sample(name: str, d: Doc) -> Sample:
        items = [] if d.pixels is None else [("vision", EncodedItem(
            inputs={"pixel_values": d.pixels}, num_embeddings=patches(spec)))]
        return Sample(sample_id=name, source="mix", input_ids=d.input_ids, loss_mask=d.loss_mask,
                      position_ids=torch.arange(len(d.input_ids)), items=items)
    return [pack([sample(f"{r}.{i}", d) for i, d in enumerate(row)], {"vision": ItemProcessor()})
            for r, row in enumerate(step)]


def padded_batches(step: list[list[Doc]], micro: int) -> list[dict[str, torch.Tensor]]:
    """Baseline: the same samples in loader order, `micro` per micro-batch, right-padded."""
    docs = [d for row in step for d in row]
    out = []
    for i in range(0, len(docs), micro):
        part = docs[i:i + micro]
        width = max(len(d.input_ids) for d in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        labels = torch.full((len(part), width), IGNORE)
        attn = torch.zeros(len(part), width, dtype=torch.long)
        for j, d in enumerate(part):
            n = len(d.input_ids)
            ids[j, :n], attn[j, :n] = d.input_ids, 1
            labels[j, :n] = torch.where(d.loss_mask, d.input_ids, IGNORE)
        batch = {"input_ids": ids, "attention_mask": attn, "labels": labels}
        images = [d.pixels for d in part if d.pixels is not None]
        if images:
            batch["pixel_values"] = torch.stack(images)
        out.append(batch)
    return out


# ================================================================================ model FLOPs
@dataclass(kw_only=True)
class FlopModel:
    """What the model FLOPs of a step follow from (module docstring); written to the JSON."""

    llm_body_params: int  # decoder layers + final norm: every real token
    head_params: int  # LM head: target tokens
    vision_params: int  # embeddings, pre-norm, the layers up to the feature layer: 577 per image
    projector_params: int  # 576 embeddings per image
    llm_layers: int
    llm_width: int
    vision_layers: int  # used: up to the feature layer
    vision_width: int
    vision_seq: int  # patches + CLS
    image_embeddings: int

    def step_flops(self, step: list[list[Doc]]) -> float:
        docs = [d for row in step for d in row]
        tokens = sum(len(d.input_ids) for d in docs)
        targets = sum(int(d.loss_mask[1:].sum()) for d in docs)
        images = sum(d.pixels is not None for d in docs)
        squares = sum(len(d.input_ids) ** 2 for d in docs)
        dense = 6 * (self.llm_body_params * tokens + self.head_params * targets
                     + self.vision_params * images * self.vision_seq
                     + self.projector_params * images * self.image_embeddings)
        attention = (6 * self.llm_layers * self.llm_width * squares  # causal: half the square
                     + 12 * self.vision_layers * self.vision_width * images * self.vision_seq ** 2)
        return float(dense + attention)


def flop_model(hf, spec: ModelSpec) -> FlopModel:
    def count(*modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())
    inner = hf.model
    tower = getattr(inner.vision_tower, "vision_model", inner.vision_tower)  # transformers < 5 nests it
    layers = tower.encoder.layers
    used = spec.vision_feature_layer % (len(layers) + 1)  # hidden_states[k] is after layer k
    llm = inner.language_model
    return FlopModel(
        llm_body_params=count(llm.layers, llm.norm), head_params=count(hf.lm_head),
        vision_params=count(tower.embeddings.patch_embedding, tower.pre_layrnorm, layers[:used]),
        projector_params=count(inner.multi_modal_projector),
        llm_layers=spec.llm["num_hidden_layers"], llm_width=spec.llm["hidden_size"],
        vision_layers=used, vision_width=spec.vision["hidden_size"],
        vision_seq=patches(spec) + 1, image_embeddings=patches(spec))


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The dense bf16 peak of a device by its name (`PEAK_BF16_TFLOPS`); None if unknown."""
    if override:
        return override
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


# ================================================================================= the steps
def omni_step(omni, optimizer, batches, device) -> None:
    """ds_omni's micro-batches of one step: packed rows, loss over the step's target tokens."""
    targets = sum(mb.num_targets for mb in batches)
    for mb in batches:
        out = omni(mb.to(device))
        (out.loss_sum / targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def hf_step(hf, optimizer, batches, device) -> None:
    """The baseline: HF's forward on padded micro-batches, each loss weighted by its targets."""
    counts = [int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches]
    for batch, n in zip(batches, counts):
        out = hf(**{k: v.to(device, non_blocking=True) for k, v in batch.items()})
        (out.loss * (n / sum(counts))).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def losses(hf, omni, step, spec, micro, device) -> dict[str, float]:
    """Loss per target token of one step's samples on both sides (same weights): same model?"""
    batches = omni_batches(step, spec)
    total = sum(mb.num_targets for mb in batches)
    ours = sum(float(omni(mb.to(device)).loss_sum) for mb in batches) / total
    padded = padded_batches(step, micro)
    counts = [int((b["labels"][:, 1:] != IGNORE).sum()) for b in padded]
    theirs = sum(float(hf(**{k: v.to(device) for k, v in b.items()}).loss) * n
                 for b, n in zip(padded, counts)) / sum(counts)
    return {"loss_ds_omni": ours, "loss_baseline": theirs,
            "loss_rel_diff": abs(ours - theirs) / abs(theirs)}


def checks(hf, omni, flops: FlopModel, step, spec, micro, device) -> dict:
    """Before training, on the first step's samples: both sides' loss (the same model?), ds_omni's
    loss with per-sample SDPA when it runs torch's varlen kernel (the same numbers?), and the FLOP
    model against torch's counter. A failed check is recorded; the timing still runs."""
    out: dict = {}
    def attempt(name, fn):
        try:
            out.update(fn())
        except Exception as e:
            traceback.print_exc()
            out[name] = f"failed: {type(e).__name__}: {e}"
    attempt("losses", lambda: losses(hf, omni, step, spec, micro, device))
    if omni.backbone.attention.kernel != "sdpa":
        attempt("loss_ds_omni_sdpa_kernel", lambda: {
            "loss_ds_omni_sdpa_kernel": kernel_loss(omni, step, spec, device, "sdpa")})
    attempt("flop_counter_over_model", lambda: {"flop_counter_over_model": counted_flops(
        omni, omni_batches(step, spec), device) / flops.step_flops(step)})
    return out


@torch.no_grad()
def kernel_loss(omni, step, spec, device, kernel: str) -> float:
    """ds_omni's loss per target with another attention kernel (then back to "auto")."""
    from ds_omni.model.attention import PackedAttention
    omni.backbone.attention = PackedAttention(kernel)
    try:
        batches = omni_batches(step, spec)
        total = sum(mb.num_targets for mb in batches)
        return sum(float(omni(mb.to(device)).loss_sum) for mb in batches) / total
    finally:
        omni.backbone.attention = PackedAttention("auto")


def counted_flops(omni, batches, device) -> float:
    """FLOPs torch's `FlopCounterMode` sees in ds_omni's forward + backward of one step: a check
    of the FLOP model (torch counts causal attention as the full square; it does not count an
    op it has no formula for)."""
    from torch.utils.flop_counter import FlopCounterMode
    targets = sum(mb.num_targets for mb in batches)
    with FlopCounterMode(display=False) as counter:
        for mb in batches:
            (omni(mb.to(device)).loss_sum / targets).backward()
    omni.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Side:
    """One side's timed steps, peak memory and (if it ran out of memory) the error."""

    def __init__(self, name: str, run, zero_grad):
        self.name, self.run, self.zero_grad = name, run, zero_grad
        self.times: list[float] = []
        self.peak_bytes = 0
        self.error: str | None = None

    def step(self, batches, device, timed: bool) -> None:
        if self.error:
            return
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        try:
            self.run(batches, device)
            sync(device)
        except Exception as e:  # out of memory, a kernel missing: the other side still runs
            traceback.print_exc()
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.zero_grad()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return
        if timed:
            self.times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(device))


# ==================================================================================== the run
def run(args) -> dict:
    spec, mix = (TINY, Mix(caption_median=20.0, text_median=60.0)) if args.tiny else (FULL, Mix())
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf, omni = build_models(spec, device, dtype)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-5, **fused)  # one for both: shared weights
    rng = np.random.default_rng(args.seed)
    steps = draw_steps(rng, spec, mix, args.warmup + args.rounds, args.rows, args.row_tokens,
                       args.max_len)
    flops = flop_model(hf, spec)
    check = checks(hf, omni, flops, steps[0], spec, args.micro_batch, device)
    zero = lambda: optimizer.zero_grad(set_to_none=True)  # noqa: E731
    sides = [Side("ds_omni", lambda b, d: omni_step(omni, optimizer, b, d), zero),
             Side("baseline", lambda b, d: hf_step(hf, optimizer, b, d), zero)]
    inputs = [(omni_batches(s, spec), padded_batches(s, args.micro_batch)) for s in steps]
    for i, step_inputs in enumerate(inputs):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):  # alternate who goes first
            sides[k].step(step_inputs[k], device, timed=i >= args.warmup)
    out = report(args, spec, mix, device, dtype, hf, omni, flops, steps[args.warmup:],
                 inputs[args.warmup:], sides, check)
    if args.profile:  # one more step of each side, on the last timed step's samples
        out["profile"] = {side.name: profile_step(side, inputs[-1][k], device)
                          for k, side in enumerate(sides) if not side.error}
    return out


def profile_step(side: "Side", batches, device, top: int = 15) -> dict:
    """One step of `side` under `torch.profiler`: its wall time, the top kernels by device time
    (CPU ops on a CPU), and the host gaps, the time the GPU sat idle between kernels (a step
    waiting on the host: a sync, Python overhead, small launches), largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        side.run(batches, device)
        sync(device)
    wall = time.perf_counter() - t0
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))
    out = {"wall_s": wall, "top": [{"name": e.key[:120], "calls": e.count,
                                    "total_ms": getattr(e, key) / 1e3} for e in averages[:top]]}
    if cuda:
        kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        gaps = [(b.time_range.start - a.time_range.end, a.name, b.name)
                for a, b in zip(kernels, kernels[1:]) if b.time_range.start > a.time_range.end]
        busy = sum(e.time_range.elapsed_us() for e in kernels)
        out.update(kernels=len(kernels), device_busy_ms=busy / 1e3,
                   host_gaps_ms=sum(g for g, _, _ in gaps) / 1e3,
                   largest_gaps=[{"ms": g / 1e3, "after": a[:80], "before": b[:80]}
                                 for g, a, b in sorted(gaps, reverse=True)[:10]])
    return out


def report(args, spec, mix, device, dtype, hf, omni, flops, steps, inputs, sides, check) -> dict:
    import transformers
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(name, args.peak_tflops)
    tokens = [sum(len(d.input_ids) for row in s for d in row) for s in steps]
    padded = [sum(b["input_ids"].numel() for b in base) for _, base in inputs]
    step_flops = [flops.step_flops(s) for s in steps]
    out = {
        "command": "python benchmarks/gpu_mfu.py " + " ".join(args.argv),
        "device": name,
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype),
        "ds_omni_kernel": omni.backbone.attention.kernel, "peak_tflops": peak,
        "model": {"params": sum(p.numel() for p in hf.parameters()), "spec": asdict(spec),
                  "flop_model": asdict(flops)},
        "workload": {"mix": asdict(mix), "rows_per_step": args.rows, "row_tokens": args.row_tokens,
                     "max_len": args.max_len, "baseline_micro_batch": args.micro_batch,
                     "timed_steps": len(steps), "warmup_steps": args.warmup,
                     "samples_per_step": statistics.mean(sum(len(r) for r in s) for s in steps),
                     "image_samples_share": _image_share(steps),
                     "tokens_per_step": statistics.mean(tokens),
                     "baseline_padding_share": 1 - sum(tokens) / sum(padded),
                     "model_tflop_per_step": statistics.mean(step_flops) / 1e12},
        "checks_before_training": check,
    }
    for side in sides:
        out[side.name] = _side_figures(side, tokens, step_flops, peak)
    ours, theirs = (s.times for s in sides)
    if ours and theirs and len(ours) == len(theirs):
        out["speedup_tokens_per_s"] = statistics.median(b / a for a, b in zip(ours, theirs))
    return out


def _image_share(steps) -> float:
    docs = [d for s in steps for row in s for d in row]
    return sum(d.pixels is not None for d in docs) / len(docs)


def _side_figures(side: Side, tokens, step_flops, peak) -> dict:
    if side.error or not side.times:
        return {"error": side.error or "no timed step"}
    t = statistics.median(side.times)
    rate = statistics.median(f / s for f, s in zip(step_flops, side.times))
    return {"step_s": t, "step_s_all": side.times,
            "tokens_per_s": statistics.median(n / s for n, s in zip(tokens, side.times)),
            "model_tflops_per_s": rate / 1e12,
            "mfu": rate / (peak * 1e12) if peak else None,
            "peak_memory_gb": side.peak_bytes / 2 ** 30 if side.peak_bytes else None}


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny dims, seconds on CPU (the test)")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--rows", type=int, help="packed rows (ds_omni micro-batches) per step")
    p.add_argument("--row-tokens", type=int, help="tokens per packed row")
    p.add_argument("--max-len", type=int, help="longest sample, tokens")
    p.add_argument("--micro-batch", type=int, default=4, help="baseline samples per micro-batch")
    p.add_argument("--warmup", type=int, help="untimed steps per side")
    p.add_argument("--rounds", type=int, help="timed steps per side")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak of this GPU, if not in the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="also profile one step of each side (torch.profiler) into the JSON")
    p.add_argument("--out", help="JSON path (default benchmarks/results/gpu_mfu.json)")
    args = p.parse_args(argv)
    defaults = ({"rows": 2, "row_tokens": 256, "max_len": 128, "warmup": 1, "rounds": 2} if args.tiny
                else {"rows": 4, "row_tokens": 16384, "max_len": 4096, "warmup": 2, "rounds": 6})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    threads = torch.get_num_threads()
    if args.tiny:  # tiny ops: one thread is many times faster than two fighting on a busy host
        torch.set_num_threads(1)
    try:
        result = run(args)
    finally:
        torch.set_num_threads(threads)
    path = Path(args.out) if args.out else RESULTS / "gpu_mfu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    _print(result, path)
    return result


def _print(r: dict, path: Path) -> None:
    print(f"{r['device']} ({r['dtype']}, ds_omni kernel {r['ds_omni_kernel']}): "
          f"{r['model']['params'] / 1e9:.3f}B params, {r['workload']['tokens_per_step']:.0f} tokens "
          f"per step, baseline padding {r['workload']['baseline_padding_share']:.0%}")
    for name in ("ds_omni", "baseline"):
        side = r[name]
        if "error" in side:
            print(f"  {name:9s} {side['error']}")
            continue
        mfu = f"MFU {side['mfu']:.1%}" if side["mfu"] is not None else "MFU n/a (no peak known)"
        print(f"  {name:9s} {side['tokens_per_s']:10.0f} tokens/s  {side['model_tflops_per_s']:8.2f} "
              f"TFLOPS  {mfu}")
    if "speedup_tokens_per_s" in r:
        print(f"  ds_omni / baseline tokens/s: {r['speedup_tokens_per_s']:.2f}x")
    print(f"  checks: {json.dumps(r['checks_before_training'])}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
