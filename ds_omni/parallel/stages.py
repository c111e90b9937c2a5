"""Pipeline stage boundaries from modelled cost, and the predicted time of each stage (pure).

The pipeline's layers are the embedding layer (with the encoders under "stage0"), the decoder
layers and the head; a stage is a contiguous run of them, its time their costs plus its share of
encoder work (all of it on stage 0 under "stage0", 1/P on each stage under "uniform"). The "cost"
split minimises the slowest stage (an exact dynamic programme, O(P L^2)). Two baselines
(`parallel.stage_split`), priced the same way so `ds-omni plan` compares them: "parameters"
(DeepSpeed's default: its `partition_balanced`, ported, over trainable parameter counts) and
"layers" (Megatron-LM's even split, the later stages taking any remainder).
More: docs/parallelism.md, "Pipeline parallelism".

Dims: L pipeline layers (decoder layers + 2), P stages.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import numpy as np

from ds_omni.config import StageSplit
from ds_omni.errors import LaunchError

PLACEMENTS = ("stage0", "uniform", "bubbles")  # "bubbles" splits stages as "uniform" does
SPLITS = typing.get_args(StageSplit)


def check_stages(num_layers: int, stages: int) -> None:
    """Each stage needs a decoder layer: the embedding and head layers are too light to be one."""
    if stages > num_layers:
        raise LaunchError(
            f"parallel.pp={stages} pipeline stages but the LLM has only {num_layers} decoder "
            f"layers; each stage needs at least one: set parallel.pp <= {num_layers}")


def partition(costs: list[float], stages: int) -> list[int]:
    """Boundaries [P + 1] (DeepSpeed's `parts`: stage s runs layers parts[s]:parts[s+1]) of the
    contiguous split of `costs` [L] into `stages` non-empty runs with the smallest largest sum;
    ties go to the split with the earliest boundaries."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    # best[s][i]: the smallest largest stage sum of the first i layers in s stages
    best = np.full((stages + 1, n + 1), np.inf)
    cut = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i] - 1e-12 * max(1.0, value):
                    best[s][i], cut[s][i] = value, j
    parts = [n]
    for s in range(stages, 0, -1):
        parts.append(int(cut[s][parts[-1]]))
    return parts[::-1]


def even_layer_parts(num_decoders: int, stages: int) -> list[int]:
    """Megatron-LM's boundaries [P + 1] over [embedding, decoder x num_decoders, head]: the
    decoder layers as evenly as possible (the later stages take the remainder), the embedding
    with the first stage's decoders, the head with the last's."""
    check_stages(num_decoders, stages)
    base, extra = divmod(num_decoders, stages)
    counts = [base + (s >= stages - extra) for s in range(stages)]  # decoders per stage
    return [0] + [1 + sum(counts[:s + 1]) for s in range(stages - 1)] + [num_decoders + 2]


def parameter_parts(layer_params: list[int], stages: int) -> list[int]:
    """DeepSpeed's `partition_method="parameters"` boundaries [P + 1] over layers with
    `layer_params` [L] trainable parameters each: a port of DeepSpeed 0.19's `partition_balanced`
    (`deepspeed/runtime/utils.py`; a unit test holds the two equal), so that planning imports no
    DeepSpeed. It picks the contiguous split with the smallest spread, largest minus smallest
    stage sum (not the smallest largest sum: `partition`), ties going to the latest boundary."""
    n, m = len(layer_params), stages
    if not 1 <= m < n:
        raise ValueError(f"cannot split {n} layers into {m} stages by parameters")
    prefix = [0.0, *np.cumsum(np.asarray(layer_params, dtype=np.float64)).tolist()]
    inf = float("inf")
    # over the first i layers in j stages: the largest and smallest stage sum of the best split,
    # its spread and its last boundary
    big = [[inf] * (m + 1) for _ in range(n + 1)]
    small = [[inf] * (m + 1) for _ in range(n + 1)]
    spread = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    big[0][0], spread[0][0] = 0.0, 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(big[k][j - 1], part), min(small[k][j - 1], part)
                if spread[i][j] >= hi - lo:
                    spread[i][j], big[i][j], small[i][j], cut[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]


@dataclass(frozen=True)
class StagePlan:
    """Boundaries over the pipeline's layers and what each stage is predicted to cost."""

    parts: list[int]  # [P + 1]
    layer_time: list[float]  # [P] modelled cost of each stage's layers (embedding, decoders, head)
    encoder_time: list[float]  # [P] modelled cost of each stage's share of encoder work
    split: str = "cost"  # how the boundaries were chosen (SPLITS)

    @property
    def stage_time(self) -> list[float]:
        return [a + b for a, b in zip(self.layer_time, self.encoder_time)]

    def decoder_layers(self, stage: int) -> range:
        """The LLM decoder layers (0-based) stage `stage` runs."""
        lo, hi = self.parts[stage], self.parts[stage + 1]
        num_decoders = self.parts[-1] - 2
        return range(max(lo - 1, 0), min(hi - 1, num_decoders))

    def encoder_shares(self) -> list[float]:
        """Fraction of the step's encoder work each stage should do."""
        total = sum(self.encoder_time)
        return [t / total for t in self.encoder_time] if total else [0.0] * len(self.encoder_time)


def plan_stages(decoder_cost: float, num_decoders: int, head_cost: float, encoder_cost: float,
                stages: int, placement: str, embed_cost: float = 0.0, split: str = "cost",
                layer_params: list[int] | None = None, encoder_params: int = 0) -> StagePlan:
    """The split of [embedding, decoder x num_decoders, head] into `stages`, encoder work placed
    as `placement` says, boundaries chosen as `split` says (module docstring): "cost", the
    smallest slowest-stage time; "parameters", DeepSpeed's balance of `layer_params` (trainable
    parameters of each of those layers, the encoders' `encoder_params` left out: they are added
    to the embedding layer under "stage0"); "layers", Megatron's even decoder split."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown encoder placement {placement!r}; choose one of {PLACEMENTS}")
    if split not in SPLITS:
        raise ValueError(f"unknown stage split {split!r}; choose one of {SPLITS}")
    check_stages(num_decoders, stages)
    layers = [embed_cost] + [decoder_cost] * num_decoders + [head_cost]
    stage0 = placement == "stage0"
    if split == "cost":
        parts = partition([layers[0] + encoder_cost * stage0] + layers[1:], stages)
    elif split == "layers":
        parts = even_layer_parts(num_decoders, stages)
    else:
        parts = parameter_parts(_with_encoders(layer_params, num_decoders, encoder_params * stage0),
                                stages)
    shares = [encoder_cost] + [0.0] * (stages - 1) if stage0 else [encoder_cost / stages] * stages
    return StagePlan(parts, _stage_sums(layers, parts), shares, split)


def _with_encoders(layer_params: list[int] | None, num_decoders: int,
                   encoder_params: int) -> list[int]:
    if layer_params is None or len(layer_params) != num_decoders + 2:
        raise ValueError(f"the \"parameters\" split needs the trainable parameter count of each "
                         f"of the {num_decoders + 2} pipeline layers, got {layer_params}")
    return [layer_params[0] + encoder_params] + list(layer_params[1:])


def step_stage_times(stage_plan: StagePlan, encoder_cost: float, placement: str) -> list[float]:
    """[P] predicted stage times of a step whose encoder work is `encoder_cost`, on the fixed
    boundaries of `stage_plan` (made for a typical mix): the mix of a step may differ from it."""
    stages = len(stage_plan.layer_time)
    shares = ([encoder_cost] + [0.0] * (stages - 1) if placement == "stage0"
              else [encoder_cost / stages] * stages)
    return [a + b for a, b in zip(stage_plan.layer_time, shares)]


def _stage_sums(costs: list[float], parts: list[int]) -> list[float]:
    return [float(sum(costs[lo:hi])) for lo, hi in zip(parts[:-1], parts[1:])]


def stage_plan_for(cost, stages: int, placement: str, samples: int, tokens: int,
                   split: str = "cost", layer_params: list[int] | None = None,
                   encoder_params: int = 0) -> StagePlan:
    """The stage plan of a micro-batch of `samples` samples of `tokens` tokens, each with one item
    per encoder of the size the cost model runs as a dummy (one image, one audio window), its
    boundaries chosen by `split` (`plan_stages`).

    `cost` is the loader's `CostModel` (FLOPs, scaled where calibrated): its LLM terms are split
    into L equal decoder layers and the LM head (2 h V FLOPs a token, forward).
    """
    d = cost.dims
    coef = cost.coefficients
    row = samples * (coef["llm_quad"] * tokens ** 2 + coef["llm_lin"] * tokens)
    head = samples * tokens * cost.train_factor * 2 * d.hidden * d.vocab * cost.scales["llm_lin"]
    encoder = samples * sum(float(cost.encoder_cost(name, [max(e.dummy_len, 1)])[0])
                            for name, e in d.encoders.items())
    return plan_stages((row - head) / d.layers, d.layers, head, encoder, stages, placement,
                       split=split, layer_params=layer_params, encoder_params=encoder_params)


def describe(stage_plan: StagePlan) -> list[dict]:
    """Per stage: its decoder layers ("first-last"), whether it has the embedding / head, its
    share of encoder work, and its predicted time per micro-batch: modelled training GFLOPs
    (calibrated scales turn them into seconds) and relative to the slowest stage (1.0)."""
    times = stage_plan.stage_time
    slowest = max(times) or 1.0
    n = len(times)
    return [{"stage": s, "decoder_layers": f"{r.start}-{r.stop - 1}" if len(r) else "none",
             "embedding": s == 0, "head": s == n - 1,
             "encoder_share": round(stage_plan.encoder_shares()[s], 4),
             "predicted_gflop": round(times[s] / 1e9, 6),
             "relative_time": round(times[s] / slowest, 4)}
            for s, r in enumerate(stage_plan.decoder_layers(s) for s in range(n))]
