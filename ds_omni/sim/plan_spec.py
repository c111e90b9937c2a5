"""What the simulator is asked to run: training's parallel section (`ParallelConfig`) and the
loader's reordering (`ReorderConfig`), held as they are, plus what only the simulator needs (the
batch, the ZeRO stage, the baselines' ways to encode and their encoder GPUs).

The degrees live once, in `SimPlan.parallel`: `SimPlan(sp=2, tp=2)` and `plan.replace(sp=4)` take
any `ParallelConfig` field by its name and `plan.sp` reads it, so a new axis (a field of
`ParallelConfig`) reaches `ParallelPlan.from_config` and the composition table (`Setting.of`)
with no edit here; four fields have the simulator's spellings (`dp` None: "auto", `encoder_mode`,
`long_items`, `reorder` / `reorder_group`). Every derived fact (dp, the long-item group, who
encodes apart) is `ParallelPlan`'s: `parallel_plan` resolves the plan with training's own code,
so a plan the simulator accepts is one `ds-omni train` accepts, and the reverse; but for the pairs
only training's launch refuses (`Rule.launch_only`), which it models and the plan search drops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ds_omni.config import ParallelConfig, ReorderConfig
from ds_omni.config.composition import check_composition
from ds_omni.errors import ConfigError, ModelError
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallelize.expert_parallel import autoep_section
from ds_omni.parallelize.tensor_parallel import check_tensor_parallel, check_tp_with_sp
from ds_omni.sim.encode_sim import ENCODER_MODES

PARALLEL_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
SPELLED = {"encoder_pool": "encoder_mode", "encoder_sp": "long_items"}
"""Config fields the flat view (`SimPlan.as_dict`) shows in the simulator's spelling."""
ENCODINGS = tuple(m for m in ENCODER_MODES if m != "pool")


@dataclass(frozen=True, init=False)
class SimPlan:
    name: str = "plan"
    """A label for reports."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The LLM's degrees and where its encoders run: training's section, checked by it."""
    reordering: ReorderConfig = field(default_factory=ReorderConfig)
    """The loader's reordering (`data.reorder`: its mode and group G, capped at dp)."""
    zero_stage: int = 1
    encoding: str = "reshard"
    """Without the pool, how a row's items are encoded: "reshard" (ds_omni's), or a baseline's
    "split_all" or "replicated" (`encode_sim`)."""
    global_batch: int = 256
    """Samples per optimizer step (the same for every plan of one comparison)."""
    micro_batches: int = 4
    """M: packed micro-batches (gradient accumulation steps) per data-parallel rank."""
    pack_tokens: int = 32768
    """Tokens of one packed micro-batch row (before SP splits it)."""
    encoder_gpus: int = 0
    """DistTrain-style: this many GPUs run the encoders alone, the others the LLM (0: shared)."""
    checkpointing: bool = True
    """Activation checkpointing of the LLM's layers (recompute in backward)."""
    overlap_comm: bool = True
    """ZeRO's per-micro-batch collectives hide behind the round's compute of its fastest rank."""
    overlap_grad_sync: bool = False
    """The step's gradient reduction hides behind the last backward, ZeRO-1's gather behind the
    first forward (Megatron's --overlap-grad-reduce --overlap-param-gather)."""
    overlap_tp: bool = False
    """TP's all-reduces overlap the pass's GEMMs (Megatron's --tp-comm-overlap): only what
    outlasts the pass's compute is exposed."""
    tp_splits_norms: bool = False
    """Under tp the element-wise work splits over the TP ranks too (Megatron's sequence
    parallelism; with `Cluster.kernels`); False: `gpus.REPLICATED` of it repeated (AutoTP)."""
    autotp_calls: bool = False
    """Under tp, TP's calls as AutoTP and the encoder hooks issue them (`backward_calls`,
    `encoder_grads_seconds`); False: fused, as the GPU studies count them."""
    vocab_parallel: bool = False
    """Under tp the token embedding and LM head split over the TP ranks too (Megatron's
    vocab-parallel layers): their states and gradients 1/tp a rank; False: whole (AutoTP)."""
    virtual_stages: int = 1
    """Model chunks a pipeline rank holds (Megatron's interleaved 1F1B, its virtual pipeline
    stages); 1: the plain 1F1B (DeepSpeed's, Megatron's default)."""
    p2p_scatter: bool = False
    """Under tp each rank sends 1/tp of a stage's activations, the next stage all-gathers them
    inside its node (Megatron's scatter/gather); False: every TP rank sends them whole."""

    def __init__(self, *, parallel: ParallelConfig | None = None,
                 reordering: ReorderConfig | None = None, **fields):
        """`parallel` and `reordering` (default: their configs' defaults) with `fields` over
        them: any `ParallelConfig` field by name, the simulator's spellings, and SimPlan's own."""
        par, reorder = _config_changes(fields)
        own = {f.name for f in dataclasses.fields(self)} - {"parallel", "reordering"}
        if set(fields) - own:
            takes = own | set(PARALLEL_FIELDS) | {"encoder_mode", "long_items", "reorder"}
            raise TypeError(f"SimPlan got unknown fields {sorted(set(fields) - own)}; it takes "
                            f"{sorted(takes | {'reorder_group'})}")
        parallel = parallel or ParallelConfig()
        reordering = reordering or ReorderConfig()
        set_ = object.__setattr__
        set_(self, "parallel", dataclasses.replace(parallel, **par) if par else parallel)
        set_(self, "reordering",
             dataclasses.replace(reordering, **reorder) if reorder else reordering)
        for f in dataclasses.fields(self):
            if f.name in own:
                set_(self, f.name, fields.get(f.name, f.default))
        self._check()

    def _check(self) -> None:
        if self.encoding not in ENCODINGS or (self.encoding != "reshard"
                                              and self.parallel.encoder_pool == "dp"):
            raise ConfigError(f"SimPlan.encoder_mode must be one of {ENCODER_MODES}, got "
                              f"{self.encoding!r} with parallel.encoder_pool="
                              f"{self.parallel.encoder_pool!r}")
        if self.global_batch < 1 or self.micro_batches < 1 or self.pack_tokens < 1:
            raise ConfigError(f"SimPlan needs global_batch, micro_batches and pack_tokens >= 1, "
                              f"got {self.global_batch}, {self.micro_batches}, {self.pack_tokens}")
        if self.virtual_stages < 1 or (self.virtual_stages > 1 and (
                self.pp < 2 or self.micro_batches % self.pp or self.ep > 1
                or self.encoder_placement != "stage0")):
            raise ConfigError(f"SimPlan.virtual_stages={self.virtual_stages} needs pp >= 2, "
                              f"micro-batches a multiple of pp (Megatron's interleaved "
                              f"schedule), ep 1 and encoder_placement 'stage0'; got pp="
                              f"{self.pp}, micro_batches={self.micro_batches}, ep={self.ep}, "
                              f"encoder_placement={self.encoder_placement!r}")

    def __hash__(self) -> int:  # the configs are mutable dataclasses: hash their values
        return hash((self.resolution_key(), *(getattr(self, f.name) for f in
                                              dataclasses.fields(self) if f.name != "parallel"
                                              and f.name != "reordering")))

    def __getattr__(self, name: str):
        """A field of the parallel section by its name (`plan.sp`, a new axis's too)."""
        if name in PARALLEL_FIELDS and "parallel" in self.__dict__:
            return getattr(self.__dict__["parallel"], name)
        raise AttributeError(f"'SimPlan' object has no attribute {name!r}")

    @property
    def dp(self) -> int | None:
        """Data-parallel degree; None: "auto" (the LLM's GPUs over one replica's)."""
        return None if self.parallel.dp == "auto" else self.parallel.dp

    @property
    def encoder_mode(self) -> str:
        """Where items are encoded (`encode_sim`): "pool" (parallel.encoder_pool="dp"), else
        `encoding`."""
        return "pool" if self.parallel.encoder_pool == "dp" else self.encoding

    @property
    def long_items(self) -> bool:
        """Long-short SP: items above one rank's share split over their row's group."""
        return self.parallel.encoder_sp != "off"

    @property
    def gemm_rows(self) -> float:
        """A rank's tokens a micro-batch, the rows its LLM GEMMs multiply: the packed row split
        over sp x cp (`gpus.gemm_seconds` prices their operands' traffic)."""
        return self.pack_tokens / max(self.sp * self.cp, 1)

    @property
    def reorder(self) -> str:
        """The loader's mode: "loader_order", "fixed" or "budget" (`data.reorder.mode`)."""
        return self.reordering.mode

    @property
    def reorder_group(self) -> int:
        """G as configured (`data.reorder.group_size`); the plan's is capped at dp."""
        return self.reordering.group_size

    # the facts of its degrees, as training's plan computes them (the same fields)
    long_item_group = ParallelPlan.long_item_group

    def replace(self, **changes) -> "SimPlan":
        """This plan with `changes` (any field `SimPlan(...)` takes) over it."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return SimPlan(**(own | changes))

    def as_dict(self) -> dict:
        """The plan as the flat fields `SimPlan(...)` takes (what reports print)."""
        par = {SPELLED.get(f, f): getattr(self, SPELLED.get(f, f)) for f in PARALLEL_FIELDS}
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("name", "parallel", "reordering", "encoding")}
        return {"name": self.name, **par, "reorder": self.reorder,
                "reorder_group": self.reorder_group, **own}

    def resolution_key(self) -> tuple:
        """What `parallel_plan` reads: plans equal in it resolve alike (`bounds.resolved_plan`)."""
        return (tuple(vars(self.parallel).values()), self.reorder, self.reorder_group,
                self.encoder_gpus)

    def llm_gpus(self, gpus: int) -> int:
        if not 0 <= self.encoder_gpus < gpus:
            raise ConfigError(f"encoder_gpus={self.encoder_gpus} must leave GPUs for the LLM "
                              f"out of {gpus}")
        return gpus - self.encoder_gpus

    def check_composition(self, launch: bool = False) -> None:
        """The composition table's rules on this plan, under its ZeRO stage (`launch`: also
        those only training's launch applies, which the simulator models: the search does not
        rank them)."""
        check_composition(self.parallel, self.zero_stage, launch=launch)

    def parallel_plan(self, gpus: int) -> ParallelPlan:
        """The plan over the LLM's GPUs, resolved and checked by training's own code."""
        return ParallelPlan.from_config(self.parallel, self.llm_gpus(gpus), self.reordering)

    def tp_apart(self, pplan: ParallelPlan) -> bool:
        """The TP ranks of a row encode different items (`ParallelPlan.tp_encodes_apart`) where
        the encoders run as ds_omni runs them (not a baseline's way, not on GPUs of their own)."""
        return pplan.tp_encodes_apart and self.encoder_mode == "reshard" and not self.encoder_gpus

    def check_model(self, model) -> None:
        """Training's rules that need the model (a `ModelSpec`), after the composition table's
        under the plan's ZeRO stage: tp divides the LLM's heads and MLP width, ep divides an MoE
        LLM's experts, sp divides its heads (a per-sequence block may not: Ulysses over a
        divisor inside, ring across, `hdp.ulysses_ring_split`). With the LLM's HF config
        (`ModelSpec.text_config`) training's own checks run (`check_tensor_parallel`,
        `autoep_section`); without it, the same rules on its sizes."""
        self.check_composition()
        text = model.text_config
        if self.tp > 1:
            if text is not None:
                check_tensor_parallel(text, self.tp, "the LLM", experts_apart=self.ep > 1)
                if max(self.sp, self.max_sequence_sp) > 1:  # a block's Ulysses as sp's
                    check_tp_with_sp(text, self.tp, max(self.sp, self.max_sequence_sp), "the LLM",
                                     "parallel.sp" if self.sp > 1 else "parallel.max_sequence_sp")
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
        if self.sp > 1:  # a per-sequence block needs not: Ulysses inside, ring across
            _divides(self.sp, "parallel.sp", {"attention heads": model.llm_heads})


def _divides(degree: int, name: str, sizes: dict) -> None:
    for what, size in sizes.items():
        if size and int(size) % degree:
            ok = [d for d in range(1, int(size) + 1) if int(size) % d == 0]
            raise ModelError(f"{name}={degree} must divide the LLM's {what} ({int(size)}); it "
                             f"can be one of {ok}")


def _config_changes(fields: dict) -> tuple[dict, dict]:
    """Pop from `fields` the changes to the parallel section and to the reordering (the
    simulator's spellings translated; `encoder_mode` also sets `fields["encoding"]`)."""
    par = {k: fields.pop(k) for k in list(fields) if k in PARALLEL_FIELDS}
    if par.get("dp", "auto") is None:
        par["dp"] = "auto"
    if "long_items" in fields:
        par["encoder_sp"] = "auto" if fields.pop("long_items") else "off"
    if "encoder_mode" in fields:
        mode = fields.pop("encoder_mode")
        if mode not in ENCODER_MODES:
            raise ConfigError(f"SimPlan.encoder_mode must be one of {ENCODER_MODES}, got "
                              f"{mode!r}")
        par["encoder_pool"] = "dp" if mode == "pool" else "off"
        fields["encoding"] = "reshard" if mode == "pool" else mode
    names = {"reorder": "mode", "reorder_group": "group_size"}
    reorder = {names[k]: fields.pop(k) for k in list(fields) if k in names}
    return par, reorder
