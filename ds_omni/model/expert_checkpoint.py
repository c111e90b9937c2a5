"""The weights of a DeepSpeed checkpoint written under expert parallelism (AutoEP), in HF's layout.

AutoEP saves each expert of each MoE layer in its own file (`layer_{L}_expert_{e}_mp_rank_00_
model_states.pt`: `...mlp.experts.w1.{e}` [I, H] gate, `w3.{e}` [I, H] up, `w2.{e}` [H, I]),
and the rest of the model in `mp_rank_00_model_states.pt`, with the router under AutoEP's names
(`mlp.router.gate.weight`, and an alias `mlp.gate.gate.weight`). ZeRO 1/2 keep whole weights
there (the trained ones; under bf16 the bf16 copy, as for the pipeline's files), so the HF
state is read from these files alone: experts stacked in global order, HF's fused
`gate_up_proj` [E, 2I, H] = [gate; up] and `down_proj` [E, H, I], the router as `mlp.gate.weight`,
a shared expert under HF's name (`hf_shared_expert_key`). Under ep x tp and pp x ep the
rest of the model is made whole first (TP shards joined, stages' pipeline names mapped) and
handed in; a pipeline's expert files (`mp_rank_SS`: stage SS) hold pipeline names.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ds_omni.errors import ModelError

EXPERT_FILE = "layer_*_expert_*_mp_rank_*_model_states.pt"
_EXPERT_KEY = re.compile(r"(.*\.mlp\.)experts\.(w[123])\.(\d+)")
_ROUTER_KEY = re.compile(r"(.*\.mlp\.)(router\.gate|gate\.gate)\.weight")
_SHARED_KEY = re.compile(r"(.*\.mlp\.)shared_experts(_gate)?\.(.*)")


def hf_shared_expert_key(key: str) -> str:
    """HF's name of an AutoEP shared-expert parameter, other keys as they are. AutoEP keeps HF's
    shared expert and its gate whole but registers them as `mlp.shared_experts` and
    `mlp.shared_experts_gate`; Qwen3.5-MoE (the one preset with shared experts that parallel.ep
    allows: DeepSeek's routers are refused) names them `mlp.shared_expert` and
    `mlp.shared_expert_gate`."""
    m = _SHARED_KEY.fullmatch(key)
    if m is None:
        return key
    return f"{m.group(1)}shared_expert{m.group(2) or ''}.{m.group(3)}"


def is_expert_checkpoint(tag_dir: Path) -> bool:
    return any(Path(tag_dir).glob(EXPERT_FILE))


def expert_checkpoint_state(tag_dir: Path, module: dict | None = None,
                            rename=lambda key: key) -> dict[str, torch.Tensor]:
    """The model's state (OmniModel keys, HF's expert layout) of an AutoEP checkpoint: `module`
    the rest of the model made whole (default: `mp_rank_00_model_states.pt`'s), `rename` maps
    the expert files' keys to OmniModel names (a pipeline's: `layer_files.omni_key`)."""
    states = torch.load(Path(tag_dir) / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)
    stage = states.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        raise ModelError(f"{str(tag_dir)!r} was written under ZeRO-3 with expert parallelism, "
                         "whose partitioned weights this export does not read; train with "
                         "ZeRO 1 or 2 under parallel.ep")
    state = {}
    for key, value in (states["module"] if module is None else module).items():
        router = _ROUTER_KEY.fullmatch(key)
        if router is None:
            state[hf_shared_expert_key(key)] = value
        elif router.group(2) == "router.gate":  # the alias gate.gate is the same tensor
            state[router.group(1) + "gate.weight"] = value
    state.update(_stacked_experts(tag_dir, rename))
    return state


def _stacked_experts(tag_dir: Path, rename) -> dict[str, torch.Tensor]:
    """Every expert file's weights, stacked per MoE layer in expert order (an expert saved by
    more than one rank, as under ep x tp, once)."""
    pieces: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for path in sorted(Path(tag_dir).glob(EXPERT_FILE)):
        for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
            m = _EXPERT_KEY.fullmatch(rename(key))
            if m is None:
                raise ModelError(f"{str(path)!r} holds {key!r}, not an AutoEP expert weight")
            pieces.setdefault((m.group(1), m.group(2)), {})[int(m.group(3))] = value
    whole = {k: torch.stack([v[e] for e in sorted(v)]) for k, v in pieces.items()}  # [E, ...]
    out = {}
    for head in sorted({h for h, _ in whole}):
        out[head + "experts.gate_up_proj"] = torch.cat([whole[head, "w1"], whole[head, "w3"]],
                                                       dim=1)  # [E, 2I, H]
        out[head + "experts.down_proj"] = whole[head, "w2"]  # [E, H, I]
    return out
