"""The ring's CUDA block kernel (torch's varlen flash, `ds_omni.model.ring_varlen`) against the
pure-torch one, on one GPU in one short run (about a minute); results in JSON.

    python benchmarks/gpu_check_ring.py --out benchmarks/results/gpu_check
    python benchmarks/gpu_check_ring.py --cpu-smoke --out /tmp/smoke   # CPU flash stands in

Through the device tool: run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check_ring.py
--out $OUT", timeout_s=300). Without CUDA (and without --cpu-smoke) it writes {"skipped": why}
and exits 0: it is no test of the CPU suite (pytest never collects benchmarks/).
1. `parity`: the ring simulated over cp 1 / 2 / 4 ranks in threads (`tests/ring_sim.py`, which on
   CUDA calls `RingAttention`'s forward and backward directly) on random packed rows (lognormal
   lengths, GQA 8 / 2 heads, head dim 64) with causal, sliding-window and image-block masks:
   kernel "cuda_flash" against "torch"; bf16: max |diff| of out, dq, dk, dv from an fp32
   reference beside pure torch's own at bf16 (`torch_diff`), pass within 4x that or 1% of the
   reference's max; fp32 (flash takes 16-bit: the pure-torch fallback): equal. `blocks`: how
   many blocks ran on flash and how many fell back.
2. `speed`: forward + backward of one 16K-token row (cp 1), both kernels: ms (synchronized wall
   time, median of the last 5 of 7) and peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_omni.model import ring_varlen  # noqa: E402
from ds_omni.parallel.zigzag import zigzag_layout  # noqa: E402
from tests.ring_sim import simulate  # noqa: E402

HEADS, KV_HEADS, DIM = 8, 2, 64
MASKS = {"causal": (None, None), "window": (256, None), "image_blocks": (None, [[40, 300]])}


def packed_row(tokens: int, cp: int, seed: int, device, dtype):
    """(index, cu, q, k, v, weights) of one zigzag row of about `tokens` tokens."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the lengths
    lengths = torch.distributions.LogNormal(6.0, 1.0).sample((64,)).long().clamp(8, tokens)
    lengths = lengths[lengths.cumsum(0) <= tokens].tolist() or [tokens]
    layout = zigzag_layout(lengths, cp)
    total = len(layout.order)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]
                      + ([total] if layout.pad else []), dtype=torch.int32)
    q, k, v, w = (torch.randn(1, total, h, DIM, generator=g).to(device, dtype)
                  for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    return torch.as_tensor(layout.ring_index()), cu, q, k, v, w


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def parity_case(kernel: str, cp: int, mask: str, dtype, device, tokens: int) -> dict:
    index, cu, q, k, v, w = packed_row(tokens, cp, seed=cp, device=device, dtype=dtype)
    window, spans = MASKS[mask]
    kw = {"window": window, "blocks": torch.tensor(spans) if spans else None}
    counts = {"flash": 0, "fallback": 0}
    plan = ring_varlen.CudaFlashBlock.plan

    def counted(q_, allowed):
        got = plan(q_, allowed)
        counts["flash" if got is not None else "fallback"] += 1
        return got
    ring_varlen.CudaFlashBlock.plan = staticmethod(counted)
    try:
        got = simulate(q, k, v, index, cu, w, kernel=kernel, **kw)
    finally:
        ring_varlen.CudaFlashBlock.plan = staticmethod(plan)
    ref = simulate(*(t.float() for t in (q, k, v)), index, cu, w.float(), kernel="torch", **kw)
    same = simulate(q, k, v, index, cu, w, kernel="torch", **kw)
    row = {"kernel": kernel, "cp": cp, "mask": mask, "dtype": str(dtype), "blocks": counts}
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        pick = (lambda r: r[0]) if i == 0 else (lambda r, i=i: r[1][i - 1])
        diff, own = _max_diff(pick(got), pick(ref)), _max_diff(pick(same), pick(ref))
        scale = float(pick(ref).abs().max())
        bound = 0.0 if dtype == torch.float32 and kernel == "cuda_flash" else max(
            4 * own, 0.01 * scale)
        row[name] = {"max_diff": diff, "torch_diff": own, "ref_max": scale,
                     "ok": diff <= bound + 1e-6}
    row["ok"] = all(row[n]["ok"] for n in ("out", "dq", "dk", "dv"))
    return row


def parity(device, kernel: str, dtypes, tokens: int) -> list[dict]:
    return [parity_case(kernel, cp, mask, dtype, device, tokens)
            for dtype in dtypes for cp in (1, 2, 4) for mask in MASKS]


def speed(device, kernel: str, tokens: int = 16384) -> dict:
    index, cu, q, k, v, w = packed_row(tokens, 1, seed=9, device=device, dtype=torch.bfloat16)
    out = {}
    for name in ("torch", kernel):
        times = []
        for rep in range(7):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            simulate(q, k, v, index, cu, w, kernel=name)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[name] = {"ms": 1000 * sorted(times[2:])[len(times[2:]) // 2],
                     "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda"
                     else None}
    return {"tokens": tokens, **out}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu_check")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: the CPU flash kernel stands in, fewer cases (seconds)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check_ring.json"
    if not torch.cuda.is_available() and not args.cpu_smoke:
        result = {"skipped": "no CUDA device: the ring's CUDA flash kernel cannot run here"}
        path.write_text(json.dumps(result, indent=1))
        print(result["skipped"])
        return result
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    kernel = "cpu_flash" if args.cpu_smoke else "cuda_flash"
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    smoke = args.cpu_smoke
    parts = {"parity": lambda: parity(device, kernel, [torch.float32] if smoke
                                      else [torch.bfloat16, torch.float32], 256 if smoke else 2048),
             "speed": lambda: speed(device, kernel, 256 if smoke else 16384)}
    for name, part in parts.items():
        try:
            result[name] = part()
        except Exception:  # noqa: BLE001 - recorded, the next part still runs
            result[name] = {"error": traceback.format_exc()}
        path.write_text(json.dumps(result, indent=1))
    rows = result["parity"] if isinstance(result["parity"], list) else []
    print(json.dumps({"parity_ok": bool(rows) and all(r["ok"] for r in rows),
                      "speed": result["speed"]}, indent=1))
    return result


if __name__ == "__main__":
    main()
