"""What the simulator is asked to run: a plan, in the terms of ds_omni's config (degrees, ZeRO
stage, the loader's reorder mode and group, per-sequence SP, where encoders run), plus what the
baselines need that ds_omni does not do (encoders on their own GPUs, every item split).

`parallel_plan` resolves it through the same `ParallelPlan.from_config` and config validation as
training, and `check_composition` reads the same table (`ds_omni.config.composition`), so a plan
the simulator accepts is one `ds-omni train` accepts, and the reverse; but for the pairs only
training's launch refuses (`Rule.launch_only`), which it models and the plan search drops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds_omni.config import ParallelConfig, ReorderConfig
from ds_omni.config.composition import Setting, check_composition
from ds_omni.errors import ConfigError, ModelError
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallelize.expert_parallel import autoep_section
from ds_omni.parallelize.tensor_parallel import check_tp_with_sp
from ds_omni.parallelize.tp_beside_ep import check_tp
from ds_omni.sim.encode_sim import ENCODER_MODES


@dataclass(frozen=True, kw_only=True)
class SimPlan:
    name: str = "plan"
    """A label for reports."""
    dp: int | None = None
    """Data-parallel degree; None: the LLM's GPUs / (sp x pp)."""
    sp: int = 1
    """Static Ulysses SP degree of the LLM."""
    pp: int = 1
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel degree of the LLM's layers (AutoTP; ZeRO 0-2; in every stage under pp;
    under sp each TP rank's heads split again over its SP group: tp x sp divides the heads)."""
    ep: int = 1
    """Expert-parallel degree of an MoE LLM (AutoEP; groups of ep consecutive ranks of a
    stage's dp x sp x tp: beside tp the experts spread over dp x tp)."""
    zero_stage: int = 1
    global_batch: int = 256
    """Samples per optimizer step (the same for every plan of one comparison)."""
    micro_batches: int = 4
    """M: packed micro-batches (gradient accumulation steps) per data-parallel rank."""
    pack_tokens: int = 32768
    """Tokens of one packed micro-batch row (before SP splits it)."""
    reorder: str = "fixed"
    """The loader's mode: "loader_order", "fixed" or "budget" (`data.reorder.mode`)."""
    reorder_group: int = 8
    """G: data-parallel ranks that reorder together (`data.reorder.group_size`; capped at dp)."""
    max_sequence_sp: int = 1
    """Per-sequence SP: the most ranks one long sequence is split over (1: off)."""
    encoder_mode: str = "reshard"
    """Where items are encoded (`encode_sim`): "reshard", "pool", "split_all", "replicated"."""
    long_items: bool = True
    """Long-short SP: items above one rank's share of their row's encoder work are split over
    the row's group (`parallel.encoder_sp="auto"`; False: "off")."""
    encoder_placement: str = "stage0"
    """Under pp > 1: "stage0" or "uniform" (the joint pipeline)."""
    stage_split: str = "cost"
    """Under pp > 1: "cost", "parameters" or "layers"."""
    stage_tokens: int = 0
    """Under pp > 1: tokens of the typical sample the stage boundaries are planned for, as
    training plans them (`parallel.stage_tokens`, else `data.max_seq_len`: `sim_plan` sets
    it); 0: the step's mean sample."""
    encoder_gpus: int = 0
    """DistTrain-style: this many GPUs run the encoders alone, the others the LLM (0: shared)."""
    checkpointing: bool = True
    """Activation checkpointing of the LLM's layers (recompute in backward)."""
    overlap_comm: bool = True
    """ZeRO's per-micro-batch collectives hide behind the round's compute of its fastest rank."""

    def __post_init__(self):
        if self.encoder_mode not in ENCODER_MODES:
            raise ConfigError(f"SimPlan.encoder_mode must be one of {ENCODER_MODES}, got "
                              f"{self.encoder_mode!r}")
        if self.global_batch < 1 or self.micro_batches < 1 or self.pack_tokens < 1:
            raise ConfigError(f"SimPlan needs global_batch, micro_batches and pack_tokens >= 1, "
                              f"got {self.global_batch}, {self.micro_batches}, {self.pack_tokens}")

    # the facts of its degrees, as training's plan computes them (the same fields)
    long_item_group = ParallelPlan.long_item_group

    def replace(self, **changes) -> "SimPlan":
        return dataclasses.replace(self, **changes)

    def llm_gpus(self, gpus: int) -> int:
        if not 0 <= self.encoder_gpus < gpus:
            raise ConfigError(f"encoder_gpus={self.encoder_gpus} must leave GPUs for the LLM "
                              f"out of {gpus}")
        return gpus - self.encoder_gpus

    def check_composition(self, launch: bool = False) -> None:
        """The composition table's rules on this plan, under its ZeRO stage (`launch`: also
        those only training's launch applies, which the simulator models: the search does not
        rank them)."""
        pool = "dp" if self.encoder_mode == "pool" else "off"
        setting = Setting(sp=self.sp, max_sequence_sp=self.max_sequence_sp, tp=self.tp,
                          pp=self.pp, ep=self.ep, encoder_placement=self.encoder_placement,
                          encoder_pool=pool, zero=self.zero_stage)
        check_composition(setting, launch=launch)

    def parallel_plan(self, gpus: int) -> ParallelPlan:
        """The plan over the LLM's GPUs, resolved and checked by training's own code."""
        cfg = ParallelConfig(dp="auto" if self.dp is None else self.dp, sp=self.sp, pp=self.pp,
                             tp=self.tp, ep=self.ep, max_sequence_sp=self.max_sequence_sp,
                             encoder_placement=self.encoder_placement, stage_split=self.stage_split,
                             encoder_sp="auto" if self.long_items else "off",
                             encoder_pool="dp" if self.encoder_mode == "pool" else "off")
        reorder = ReorderConfig(mode=self.reorder, group_size=self.reorder_group)  # capped at dp
        return ParallelPlan.from_config(cfg, self.llm_gpus(gpus), reorder)

    def tp_apart(self, pplan: ParallelPlan) -> bool:
        """The TP ranks of a row encode different items (`ParallelPlan.tp_encodes_apart`) where
        the encoders run as ds_omni runs them (not a baseline's way, not on GPUs of their own)."""
        return pplan.tp_encodes_apart and self.encoder_mode == "reshard" and not self.encoder_gpus

    def check_model(self, model) -> None:
        """Training's rules that need the model (a `ModelSpec`), after the composition table's
        under the plan's ZeRO stage: tp divides the LLM's heads and MLP width, ep divides an MoE
        LLM's experts, an SP degree divides its heads. With the LLM's HF config
        (`ModelSpec.text_config`) training's own checks run (`check_tensor_parallel`,
        `autoep_section`); without it, the same rules on its sizes."""
        self.check_composition()
        text = model.text_config
        if self.tp > 1:
            if text is not None:
                check_tp(text, self.tp, self.ep, "the LLM")
                if self.sp > 1:
                    check_tp_with_sp(text, self.tp, self.sp, "the LLM")
            else:
                _divides(self.tp, "parallel.tp", {"attention heads": model.llm_heads,
                                                  "MLP width": model.dims.intermediate})
                if self.sp > 1:
                    _divides(self.tp * self.sp, "parallel.tp x parallel.sp",
                             {"attention heads": model.llm_heads})
        if self.ep > 1:
            if model.moe is None:
                raise ConfigError(f"parallel.ep={self.ep} needs an MoE LLM; this one is dense: "
                                  "set parallel.ep to 1")
            if text is not None:
                autoep_section(text, self.ep)
            elif model.moe.experts % self.ep:
                raise ConfigError(f"parallel.ep={self.ep} does not divide the LLM's "
                                  f"{model.moe.experts} experts: each expert-parallel rank holds "
                                  f"experts / ep of them; choose an ep that divides "
                                  f"{model.moe.experts}")
        for name, degree in (("parallel.sp", self.sp), ("parallel.max_sequence_sp",
                                                        self.max_sequence_sp)):
            if degree > 1:
                _divides(degree, name, {"attention heads": model.llm_heads})


def _divides(degree: int, name: str, sizes: dict) -> None:
    for what, size in sizes.items():
        if size and int(size) % degree:
            ok = [d for d in range(1, int(size) + 1) if int(size) % d == 0]
            raise ModelError(f"{name}={degree} must divide the LLM's {what} ({int(size)}); it "
                             f"can be one of {ok}")
