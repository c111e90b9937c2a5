"""The GPU checks of issue 26 in one run of at most ~6 minutes on one H200; results in JSON.

    python benchmarks/gpu_check.py --wheels .whl --out benchmarks/results/gpu_check
    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/smoke   # tiny sizes, CPU, seconds (tested)

Parts, in this order (each writes its JSON as soon as it ends, so a run stopped by its time limit
keeps what was done; a part that fails records its error and the next still runs):
1. `varlen.json`: torch's varlen FlashAttention kernel (ds_omni's "varlen" `PackedAttention`)
   against per-sample SDPA ("sdpa"), bf16, on packed rows of samples of lognormal lengths, in
   three layer kinds: causal (32 query / 32 KV heads), sliding window (4096, samples longer than
   it) and GQA (32 / 8): max |difference| of the output and of dq, dk, dv, next to the same
   kernel's own max |difference| from an fp32 SDPA (bf16's scale), and the speed ratio of
   forward + backward (CUDA events, median of 10 after 3 warm-ups).
2. `gpu_mfu.json`: `benchmarks/gpu_mfu.py` (ds_omni against HF's padded loop on the ~1.4B LLaVA,
   tokens/s, MFU) with `--profile`: one profiled step of each side (`torch.profiler`: top kernels
   by device time, and the host gaps: time the GPU sat idle between kernels).
3. `train.json`: `ds-omni train` through the `deepspeed` launcher on 1 GPU (`--num_gpus 1`, no
   backend named: NCCL is ds_omni's choice on CUDA) with the shipped `ds_configs/zero2_bf16.json`
   as it is (DeepSpeed's fused Adam, JIT-built with the machine's nvcc for sm_90 only), 20 steps
   of the demo model (`examples/tiny_llava.json`), ending in its HF export, which is then loaded
   with `from_pretrained` and run once.
4. `memory.json`: peak GPU memory of one training step (forward, backward, fused AdamW) of the
   ~1.4B LLaVA on a 16K-token packed row, with and without activation checkpointing (LLM and
   vision layers recomputed).

The device machine (one H200, torch 2.11 with CUDA 13, nvcc, transformers 5.17, accelerate,
pyarrow; no network) lacks deepspeed, datasets, hjson and pydantic, and its transformers is older
than ds_omni's pin (5.24). Carry them as wheels in a folder ignored by git (`echo /.whl/ >>
.git/info/exclude`), made where pip reaches the registry:

    DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==0.19.8 -w .whl/
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        datasets==5.2.0 transformers==5.24.0 huggingface_hub==2.4.0 hjson pydantic pydantic-core \\
        annotated-types typing-inspection dill multiprocess soundfile

(versions of constraints.txt; `unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist` lists
what else one needs). `--wheels DIR` installs every wheel of DIR with `pip install --no-index
--no-deps --target` into a folder put first on the path of this process and of the launcher's
ranks, with this repository (so nothing of ds_omni needs installing). Through the device tool:

    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --wheels .whl --out $OUT",
        carry=[".whl"], timeout_s=420)

then copy the JSON files to benchmarks/results/gpu_check/ and the figures into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def install_wheels(wheels: Path, site: Path) -> None:
    """Every wheel of `wheels` into `site`, first on the path of this process and its children."""
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"--wheels {wheels}: no .whl files there (see this script's docstring)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *found],
                   check=True)
    sys.path.insert(0, str(site))


def on_path(*paths: Path) -> None:
    """`paths` first on sys.path and PYTHONPATH (the launcher's ranks import from there too)."""
    for p in reversed(paths):
        sys.path.insert(0, str(p))
    os.environ["PYTHONPATH"] = os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")])


# ====================================================================== 1. varlen against SDPA
def packed_lengths(total: int, median: float, seed: int) -> list[int]:
    """Sample lengths (lognormal, sigma 1) filling a row of `total` tokens exactly."""
    import numpy as np
    rng, out = np.random.default_rng(seed), []
    while sum(out) < total:
        out.append(int(min(max(16, rng.lognormal(np.log(median), 1.0)), total - sum(out))))
    return [n for n in out if n > 0]


def varlen_check(cpu_smoke: bool) -> dict:
    import torch
    from ds_omni.model.attention import PackedAttention, torch_varlen_available
    cuda = torch.cuda.is_available() and not cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    T, D = (256, 16) if cpu_smoke else (16384, 128)
    layers = {"causal": (32, 32, None), "sliding_window": (32, 32, 64 if cpu_smoke else 4096),
              "gqa": (32, 8, None)}
    if cpu_smoke:
        layers = {k: (4, kv // 8 or 1, w) for k, (h, kv, w) in layers.items()}
    lengths = packed_lengths(T, 40 if cpu_smoke else 2000, seed=0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kernels = {"sdpa": PackedAttention("sdpa")}
    if cuda and torch_varlen_available():
        kernels["varlen"] = PackedAttention("varlen")
    out = {"device": str(device), "row_tokens": T, "head_dim": D, "samples": len(lengths),
           "max_sample": max(lengths), "kernels": sorted(kernels), "layers": {}}
    for name, (h, hkv, window) in layers.items():
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, n, T, D, generator=gen) for n in (h, hkv, hkv))
        grad = torch.randn(1, T, h, D, generator=gen)
        ref = _attend(kernels["sdpa"], q, k, v, grad, cu, window, device, torch.float32)
        row = {"heads": h, "kv_heads": hkv, "window": window}
        for kname, kernel in kernels.items():
            got = _attend(kernel, q, k, v, grad, cu, window, device, torch.bfloat16)
            row[kname] = {"max_abs_diff_vs_fp32": {t: float((got[t] - ref[t]).abs().max())
                                                   for t in got},
                          "fwd_bwd_ms": _time_ms(kernel, q, k, v, grad, cu, window, device,
                                                 2 if cpu_smoke else 10)}
        if "varlen" in kernels:
            a = _attend(kernels["varlen"], q, k, v, grad, cu, window, device, torch.bfloat16)
            b = _attend(kernels["sdpa"], q, k, v, grad, cu, window, device, torch.bfloat16)
            row["varlen_vs_sdpa_max_abs_diff"] = {t: float((a[t] - b[t]).abs().max()) for t in a}
            row["sdpa_over_varlen_time"] = row["sdpa"]["fwd_bwd_ms"] / row["varlen"]["fwd_bwd_ms"]
        out["layers"][name] = row
    return out


def _attend(kernel, q, k, v, grad, cu, window, device, dtype) -> dict:
    """Output and input gradients of `kernel` on q [1, H, T, D], k/v [1, Hkv, T, D], in fp32."""
    import torch
    q, k, v = (t.detach().to(device, dtype).clone().requires_grad_() for t in (q, k, v))
    out = kernel(q, k, v, kernel.boundaries(cu, device), int((cu[1:] - cu[:-1]).max()), None, 0.0,
                 window)  # [1, T, H, D]
    out.backward(grad.to(device, dtype))
    return {"out": out.detach().float().cpu(), **{f"d{n}": t.grad.float().cpu()
                                                  for n, t in zip("qkv", (q, k, v))}}


def _time_ms(kernel, q, k, v, grad, cu, window, device, reps: int) -> float:
    import torch
    q, k, v = (t.detach().to(device, torch.bfloat16).clone().requires_grad_()
               for t in (q, k, v))
    grad, bounds = grad.to(device, torch.bfloat16), kernel.boundaries(cu, device)
    longest = int((cu[1:] - cu[:-1]).max())

    def once():
        kernel(q, k, v, bounds, longest, None, 0.0, window).backward(grad)
    times = []
    for i in range(3 + reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            once()
            elapsed = 1e3 * (time.perf_counter() - t0)
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times)


# ========================================================================== 2. MFU, profiled
def mfu_check(cpu_smoke: bool, out: Path) -> dict:
    bench = _load("gpu_mfu", REPO / "benchmarks" / "gpu_mfu.py")
    return bench.main((["--tiny"] if cpu_smoke else []) + ["--profile", "--out", str(out)])


def _load(name: str, path: Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ============================================================ 3. ds-omni train, the launcher
def train_check(cpu_smoke: bool, work: Path) -> dict:
    """20 steps of the demo model through `deepspeed --num_gpus 1 --module ds_omni train` with
    the shipped bf16 config, its HF export loaded back and run (CPU smoke: 2 steps, fp32 config,
    as the suite's launcher tests do; the GPU run is the one that counts)."""
    from ds_omni.parallel.dist import free_port
    steps, ds = (2, "zero2.json") if cpu_smoke else (20, "zero2_bf16.json")
    out_dir = work / "train"
    # the launcher by module: wheels installed with --target put no `deepspeed` script on PATH
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()), "--module",
           "ds_omni", "train", "--config", str(REPO / "examples" / "tiny_llava.json"),
           "--deepspeed", str(REPO / "ds_configs" / ds), "--set", f"train.steps={steps}",
           "--set", f"train.output_dir={out_dir}", "--set", "train.warmup_steps=2"]
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0",  # fused Adam for Hopper only: faster build
           "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    result = {"command": " ".join(cmd), "deepspeed_config": ds, "steps": steps,
              "returncode": done.returncode, "wall_s": time.perf_counter() - t0,
              "output_tail": (done.stdout + done.stderr)[-3000:]}
    report = out_dir / "report.json"
    if report.exists():
        result["report"] = json.loads(report.read_text())
    result["export"] = _load_export(out_dir / "hf")
    return result


def _load_export(hf_dir: Path) -> dict:
    """The exported directory loads with transformers and gives a finite loss on one prompt."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    model = AutoModelForImageTextToText.from_pretrained(hf_dir)
    processor = AutoProcessor.from_pretrained(hf_dir)
    ids = processor.tokenizer("a red circle", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    return {"class": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
            "loss": float(loss), "finite": bool(torch.isfinite(loss))}


# ============================================================== 4. memory with recomputation
def memory_check(cpu_smoke: bool) -> dict:
    """Peak memory of one step of gpu_mfu's model on one packed row, without and with
    activation checkpointing (CPU smoke: tiny model, no memory figure)."""
    import numpy as np
    import torch
    bench = sys.modules.get("gpu_mfu") or _load("gpu_mfu", REPO / "benchmarks" / "gpu_mfu.py")
    spec, mix = (bench.TINY, bench.Mix(caption_median=20.0, text_median=60.0)) if cpu_smoke \
        else (bench.FULL, bench.Mix())
    device = torch.device("cpu" if cpu_smoke else "cuda")
    dtype = torch.float32 if cpu_smoke else torch.bfloat16
    row_tokens = 256 if cpu_smoke else 16384
    hf, omni = bench.build_models(spec, device, dtype)
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-5, **({} if cpu_smoke else {"fused": True}))
    step = bench.draw_steps(np.random.default_rng(0), spec, mix, 1, 1, row_tokens,
                            128 if cpu_smoke else 4096)[0]
    batches = bench.omni_batches(step, spec)
    out = {"params": sum(p.numel() for p in hf.parameters()), "row_tokens": row_tokens,
           "tokens": sum(mb.num_tokens for mb in batches)}
    for recompute in (False, True):
        omni.set_checkpointing({"llm", "vision"} if recompute else set())
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        bench.omni_step(omni, optimizer, batches, device)
        bench.sync(device)
        key = "checkpointed" if recompute else "plain"
        out[key] = {"step_s": time.perf_counter() - t0, "peak_gb": (
            torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None)}
    return out


# ==================================================================================== the run
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", type=Path, help="a folder of wheels to install first")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_check")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU; CUDA parts skipped")
    p.add_argument("--parts", default="varlen,mfu,train,memory")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        install_wheels(args.wheels, Path("/tmp/gpu_check_site"))
        on_path(REPO, Path("/tmp/gpu_check_site"))
    else:
        on_path(REPO)
    parts = {"varlen": lambda: varlen_check(args.cpu_smoke),
             "mfu": lambda: mfu_check(args.cpu_smoke, args.out / "gpu_mfu.json"),
             "train": lambda: train_check(args.cpu_smoke, args.out),
             "memory": lambda: memory_check(args.cpu_smoke)}
    summary = {}
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            result = parts[name]()
        except Exception as e:  # the next part still runs
            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}"}
        result = {"part_s": time.perf_counter() - t0, **result}
        if name != "mfu":  # gpu_mfu.py writes its own file
            (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        summary[name] = {"part_s": result["part_s"], "error": result.get("error")}
        print(f"gpu_check: {name} done in {result['part_s']:.0f}s"
              + (f" ({result['error']})" if result.get("error") else ""), flush=True)
    return summary


if __name__ == "__main__":
    main()
