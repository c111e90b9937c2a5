"""Where ds_omni's training step spends CPU that HF's does not, on `uniform.py`'s workload.

    .venv/bin/python benchmarks/step_profile.py --steps 24 [--profile 8] [--attention]
    # writes benchmarks/results/step_profile.json

Both step sides of `benchmarks/uniform.py`, built as it builds them (the same samples, the same
saved tiny LLaVA, the same DeepSpeed config, one trainer thread), without the loading:
"omni_ready" (`setup_training`'s engine, `train_step` on step batches made before the clock)
and "hf" (`LlavaForConditionalGeneration.from_pretrained` under `deepspeed.initialize` on the
same samples as padded tensors). The loader runs in-process here (`data.workers` 0) and is only
asked for the ready batches: it does no work while steps are timed.

CPU seconds (`time.process_time`, repeatable on a loaded machine where wall time is not) per
step, the median of `--steps` steps taken one by one, alternating between the sides; split into
phases by wrapping the engine's methods: forward (the model's forward without its loss),
loss (the head and the token loss: ds_omni's `summed_token_loss`, HF's `lm_head` plus its
`loss_function`), backward, step (`engine.step`) and the rest (ds_omni: the step's
all-reduces, the non-finite guard's check, moving micro-batches; HF: nothing). `--profile N`
adds cProfile's top functions (own time) of N steps of each side; `--attention` times the
attention kernels on the packed rows of these batches (forward and backward).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import uniform  # noqa: E402  (the workload and both sides' construction)

PHASES = ("forward", "loss", "backward", "step", "rest")


class Phases:
    """CPU seconds per phase, accumulated by wrapped callables (`wrap`)."""

    def __init__(self):
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.depth = 0  # the loss runs inside forward: its time is taken out of forward's

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - t0
                self.cpu[name] += spent
                if name == "loss":
                    self.cpu["forward"] -= spent
        return timed


def instrument(engine, phases: Phases) -> None:
    """engine's forward, backward and step timed into `phases` (on the instance only)."""
    for name, attr in (("forward", "forward"), ("backward", "backward"), ("step", "step")):
        setattr(engine, attr, phases.wrap(name, getattr(engine, attr)))


def omni_ready_side(cfg, ds_path: str, ready: list):
    from ds_omni.model import omni as omni_model
    from ds_omni.parallel import dist
    from ds_omni.train.nonfinite import NonFiniteGuard
    from ds_omni.train.setup import preflight, setup_training
    from ds_omni.train.step import train_step
    plan, ds_config = preflight(cfg, ds_path)
    rank, _ = dist.init_distributed(600.0)
    _, loader, engine, groups = setup_training(cfg, ds_config, rank, plan)
    guard = NonFiniteGuard(engine)
    phases = Phases()
    instrument(engine, phases)
    omni_model.summed_token_loss = phases.wrap("loss", omni_model.summed_token_loss)
    it = iter(range(10 ** 9))

    def step():
        train_step(engine, ready[next(it) % len(ready)], groups, guard=guard)
    return step, phases, engine, ds_config


def hf_side(model_dir: str, ds_config: dict, steps: list):
    import deepspeed
    from deepspeed.utils import groups as ds_groups
    from transformers import LlavaForConditionalGeneration
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa")
    hf.train()
    ds_groups.mpu = None
    engine, *_ = deepspeed.initialize(model=hf, model_parameters=hf.parameters(),
                                      config=ds_config)
    phases = Phases()
    instrument(engine, phases)
    hf.lm_head.forward = phases.wrap("loss", hf.lm_head.forward)
    loss_function = hf.loss_function
    type(hf).loss_function = property(lambda self: phases.wrap("loss", loss_function))
    it = iter(range(10 ** 9))

    def step():
        for b in steps[next(it) % len(steps)]:
            engine.backward(engine(**b).loss)
            engine.step()
    return step, phases


def measure(sides: dict, n: int) -> dict:
    """Per side: CPU seconds of each of n steps, and of each phase, steps alternating sides."""
    rows = {name: [] for name in sides}
    for i in range(n):
        order = list(sides.items()) if i % 2 == 0 else list(sides.items())[::-1]
        for name, (step, phases) in order:
            before = dict(phases.cpu)
            t0 = time.process_time()
            step()
            total = time.process_time() - t0
            row = {k: phases.cpu[k] - before[k] for k in PHASES[:-1]}
            row["rest"] = total - sum(row.values())
            row["total"] = total
            rows[name].append(row)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in (*PHASES, "total")}
               for name, rs in rows.items()}
    # step i of each side ran back to back: their ratio cancels the machine's drift
    paired = statistics.median(h["total"] / o["total"] for h, o in zip(rows["hf"],
                                                                      rows["omni_ready"]))
    return medians, paired


def top_list(step, n: int, limit: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def attention_kernels(batches: list, reps: int) -> dict:
    """CPU seconds of forward + backward of one layer's attention over the packed rows of
    `batches` (median per row), per kernel, and whether each gives bitwise ds_omni's numbers
    (output and q, k, v gradients): ds_omni's per-sample SDPA; one SDPA call with a dense
    block-diagonal causal mask; flex_attention with a document mask (eager, CPU); the samples
    padded at their ends into [n, L] and one causal SDPA call (no mask: a causal query never
    sees the end padding), the padding and unpadding included; and HF's padded batch as HF lays
    it out (SDPA with the [B, 1, L, L] causal-and-padding mask, the tensors made padded). Shapes
    of the tiny LLaVA's LLM (4 heads, 2 KV heads, head dim 16)."""
    import torch
    import torch.nn.functional as F
    from ds_omni.model.attention import _sdpa_per_sample
    heads, kv, dim = 4, 2, 16
    rows = [mb.cu_seqlens for b in batches for mb in b.micro_batches]

    def packed(cu):  # [1, T, h, D] (q) and [1, T, hkv, D] (k, v), as a layer projects them
        g = torch.Generator().manual_seed(0)
        return (torch.randn(1, int(cu[-1]), n, dim, generator=g).requires_grad_()
                for n in (heads, kv, kv))

    def per_sample(q, k, v, cu):
        return _sdpa_per_sample(*(t.transpose(1, 2) for t in (q, k, v)), cu, None, 0.0)

    def dense_mask(q, k, v, cu):
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
        pos = torch.arange(int(cu[-1]))
        mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T]
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)

    def flex(q, k, v, cu):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
        t = int(cu[-1])
        block = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi),
                                  None, None, t, t, device="cpu")
        out = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block,
                             enable_gqa=True)
        return out.transpose(1, 2)

    def padded_causal(q, k, v, cu):
        lengths = cu.diff()
        n, width = len(lengths), int(lengths.max())
        pos = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lengths)
        slot = torch.repeat_interleave(torch.arange(n), lengths) * width + pos  # [T]

        def pad(t):  # [1, T, h, D] -> [n, h, L, D]
            flat = t.new_zeros(n * width, *t.shape[2:]).index_copy(0, slot, t[0])
            return flat.view(n, width, *t.shape[2:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True,
                                             enable_gqa=True)  # [n, h, L, D]
        return out.transpose(1, 2).reshape(n * width, heads, dim).index_select(0, slot)[None]

    def hf_padded(cu):
        lengths = cu.diff()
        b, width = len(lengths), int(lengths.max())
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, n, width, dim, generator=g).requires_grad_()
                   for n in (heads, kv, kv))
        pos = torch.arange(width)
        mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, :] < lengths[:, None, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                              enable_gqa=True)

    def run(fn, cu):
        if fn is hf_padded:
            out = fn(cu)
            out.sum().backward()
            return None
        q, k, v = packed(cu)
        out = fn(q, k, v, cu)
        out.sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    reference = [run(per_sample, cu) for cu in rows]
    out = {}
    for name, fn in (("per_sample_sdpa", per_sample), ("dense_block_mask_sdpa", dense_mask),
                     ("flex_attention_eager", flex), ("padded_causal_sdpa", padded_causal),
                     ("hf_padded_sdpa", hf_padded)):
        times = []
        try:
            got = [run(fn, cu) for cu in rows]
            for _ in range(reps):
                for cu in rows:
                    t0 = time.process_time()
                    run(fn, cu)
                    times.append(time.process_time() - t0)
        except Exception as e:  # a kernel this torch cannot run on CPU: say so
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        out[name] = {"cpu_s_per_row_median": statistics.median(times)}
        if fn is not hf_padded:
            out[name]["bitwise_rows"] = sum(all(map(torch.equal, a, b))
                                            for a, b in zip(got, reference))
            out[name]["max_abs_diff"] = max(float((x - y).abs().max()) for a, b in
                                            zip(got, reference) for x, y in zip(a, b))
            out[name]["rows"] = len(rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24, help="timed steps per side (median)")
    p.add_argument("--ready", type=int, default=8, help="distinct step batches, cycled")
    p.add_argument("--profile", type=int, default=0, help="cProfile this many steps a side")
    p.add_argument("--attention", action="store_true", help="time the attention kernels")
    # uniform.RESULTS: benchmarks/results, or DS_OMNI_BENCH_RESULTS (make bench's quick runs)
    p.add_argument("--out", default=str(uniform.RESULTS / "step_profile.json"))
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ds_omni_step_profile_"))
    cfg, ds_path, model_dir = uniform.setup(root)
    # nothing loads while steps are timed: the loader stays in this process, idle
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, workers=0,
                                                            pin_cores=False))
    ready_omni, ready_hf = uniform.ready_batches(cfg, args.ready)
    omni_step, omni_phases, _, ds_config = omni_ready_side(cfg, ds_path, ready_omni)
    hf_step, hf_phases = hf_side(model_dir, ds_config, ready_hf)
    sides = {"omni_ready": (omni_step, omni_phases), "hf": (hf_step, hf_phases)}
    measure(sides, 4)  # warm-up
    med, paired = measure(sides, args.steps)
    result = {"cpu_s_per_step": med, "steps": args.steps,
              # = omni_ready / hf in tokens per CPU second (both sides train the same tokens)
              "ratio_hf_over_omni_cpu": med["hf"]["total"] / med["omni_ready"]["total"],
              "ratio_hf_over_omni_cpu_paired": paired,
              "setup": {"global_batch": uniform.BATCH, "micro_batch": uniform.MICRO,
                        "trainer_threads": 1, "zero_stage": 2}}
    print(f"{'side':<11}" + "".join(f"{k:>10}" for k in (*PHASES, "total")) + "   (CPU ms/step)")
    for name, row in med.items():
        print(f"{name:<11}" + "".join(f"{1e3 * row[k]:>10.2f}" for k in (*PHASES, "total")))
    print(f"hf / omni_ready CPU per step: {result['ratio_hf_over_omni_cpu']:.3f} (medians), "
          f"{paired:.3f} (median of step pairs)")
    if args.attention:
        result["attention"] = attention_kernels(ready_omni, 5)
        print(json.dumps(result["attention"], indent=1))
    if args.profile:
        for name, (step, _) in sides.items():
            text = top_list(step, args.profile)
            result[f"profile_{name}"] = text
            print(f"==== cProfile, {name}, {args.profile} steps ====\n{text}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
