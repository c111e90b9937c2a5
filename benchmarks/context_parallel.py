"""Activation memory per rank of one long packed row under ring attention (parallel.cp 1/2/4).

Each cp rank's forward is run in this process over its zigzag share of the row (the ring's
passes answered with the blocks the other ranks would send, as received tensors): `layers`
decoder blocks (q/k/v/o projections, `ds_omni.model.ring_attention`, an MLP) of width `width`.
Activations are the bytes autograd saves for backward (`saved_tensors_hooks`, each storage
once, parameters excluded), the largest rank's. Baseline: cp 1, the same kernel over the whole
row in one rank. `cp`: the ring's own backward (`RingAttention`, the default: it keeps q, k, v,
out and lse); `autograd_cp`: autograd through the pure-torch blocks (it keeps every block's
probabilities). Writes benchmarks/results/context_parallel.json.

Run: .venv/bin/python benchmarks/context_parallel.py [--tokens 2048] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ds_omni.model import ring_attention as ra
from ds_omni.parallel.ring import Pending, RingGroup
from ds_omni.parallel.zigzag import zigzag_layout

# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS")
               or Path(__file__).resolve().parent / "results") / "context_parallel.json"
HEADS, KV_HEADS = 8, 4


def _weights(width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dim = width // HEADS
    shapes = {"q": (width, width), "k": (width, KV_HEADS * dim), "v": (width, KV_HEADS * dim),
              "o": (width, width), "up": (width, 4 * width), "down": (4 * width, width)}
    return {n: (torch.randn(*s, generator=g) * s[0] ** -0.5).requires_grad_()
            for n, s in shapes.items()}


def _block(x, w, index, rank, cp, cu, whole_kv, backward):
    """One decoder block of cp rank `rank` over its tokens x [C, width]."""
    c, width = x.shape
    dim = width // HEADS
    q = (x @ w["q"]).view(1, c, HEADS, dim)
    k = (x @ w["k"]).view(1, c, KV_HEADS, dim)
    v = (x @ w["v"]).view(1, c, KV_HEADS, dim)
    steps = iter(range(1, cp))

    def received(kv, send_to, recv_from, tag):  # the block the ring brings: another rank's
        return Pending(whole_kv[:, index[(rank - next(steps)) % cp]].detach().clone())
    ring = RingGroup(group=None, rank=rank, size=cp, prev=(rank - 1) % cp, next=(rank + 1) % cp,
                     transport=received)
    out = ra.ring_attention(q, k, v, index, ring, cu, None, backward=backward)
    out = out[0].reshape(c, width)
    x = x + out @ w["o"]
    return x + F.gelu(x @ w["up"]) @ w["down"]


def saved_bytes(fn, params) -> int:
    """Bytes autograd saves for backward while `fn()` runs (each storage once, no parameters)."""
    seen, skip = {}, {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure(lengths: list[int], cp: int, width: int, layers: int,
            backward: str = "ring") -> dict:
    layout = zigzag_layout(lengths, cp)
    index = torch.as_tensor(layout.ring_index())
    total = len(layout.order)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()] + ([total] if layout.pad else [])
    cu = torch.tensor(bounds, dtype=torch.int32)
    w = _weights(width)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(total, width, generator=g)
    dim = width // HEADS
    per_rank = []
    for rank in range(cp):
        def forward(rank=rank):
            x = hidden[index[rank]].clone().requires_grad_()
            for _ in range(layers):
                with torch.no_grad():  # what the other ranks' k/v would be at this layer
                    kv = torch.stack([(hidden @ w[n]).view(total, KV_HEADS, dim) for n in "kv"])
                x = _block(x, w, index, rank, cp, cu, kv, backward)
            return x
        per_rank.append(saved_bytes(forward, list(w.values())))
    return {"tokens_per_rank": layout.rank_tokens, "activation_bytes": per_rank,
            "activation_bytes_max": max(per_rank)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    # one long packed row: a long sample and shorter ones
    lengths = [args.tokens // 2, args.tokens // 4, args.tokens // 8, args.tokens // 8]
    start = time.perf_counter()
    out = {"row_tokens": sum(lengths), "samples": lengths, "layers": args.layers,
           "width": args.width, "heads": HEADS, "kv_heads": KV_HEADS}
    for key, backward in (("cp", "ring"), ("autograd_cp", "autograd")):
        runs = {str(cp): measure(lengths, cp, args.width, args.layers, backward)
                for cp in (1, 2, 4)}
        for run in runs.values():
            run["over_cp1"] = run["activation_bytes_max"] / runs["1"]["activation_bytes_max"]
        out[key] = runs
    out["ring_over_autograd"] = {cp: out["cp"][cp]["activation_bytes_max"]
                                 / out["autograd_cp"][cp]["activation_bytes_max"]
                                 for cp in out["cp"]}
    out["seconds"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({key: {cp: round(r["over_cp1"], 3) for cp, r in out[key].items()}
                      for key in ("cp", "autograd_cp")}))
    return out


if __name__ == "__main__":
    main()
