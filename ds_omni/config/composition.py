"""What composes with what: one table over every pair of the plan's features, and the one
validator that reads it.

A feature is on where a config enables it (`FEATURES`: tp when parallel.tp > 1; zero where the
DeepSpeed JSON's ZeRO stage is known). Every pair of features has exactly one `Rule`: it composes,
or it is refused (under its condition, if it has one) with the reason and what to set instead.
`check_composition` raises the first refusal that applies as one error naming both features with
their values. It runs where the parallel section is read (the ZeRO stage unknown: those rules
wait) and in `ds_omni.train.setup.plan_run`, where the DeepSpeed JSON is known, before any process
group; the plan search drops what it refuses, `ds-omni plan --composition` prints it and
docs/composition.md is generated from it (`ds_omni.config.composition_doc`).

A new axis (context parallelism: `cp`) is one `Feature` and one `Rule` per feature already here;
`tests/unit/config/test_composition.py` names the pairs still missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from ds_omni.errors import CompositionError, ModelError


@dataclass(frozen=True)
class Setting:
    """The values the table reads: a parallel section's (or a simulated plan's), and what only
    the DeepSpeed JSON and the train section know."""

    sp: int = 1
    max_sequence_sp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    encoder_placement: str = "stage0"
    encoder_pool: str = "off"
    zero: int | None = None
    """The DeepSpeed JSON's zero_optimization.stage; None where it is not known yet."""
    export_hf: bool = False
    cp: int = 1

    @classmethod
    def of(cls, parallel, zero: int | None = None, export_hf: bool = False) -> "Setting":
        """The setting of `parallel` (a `ParallelConfig`, or anything with its fields)."""
        return cls(**{f: getattr(parallel, f) for f in PARALLEL_FIELDS}, zero=zero,
                   export_hf=export_hf)


PARALLEL_FIELDS = ("sp", "max_sequence_sp", "tp", "pp", "ep", "encoder_placement", "encoder_pool",
                   "cp")
FIELDS = {"zero": "zero_optimization.stage", "export_hf": "train.export_hf",
          **{f: f"parallel.{f}" for f in PARALLEL_FIELDS}}
"""How errors and docs name each value of a `Setting`."""


@dataclass(frozen=True)
class ModelFacts:
    """What a feature's model check reads of the LLM and its rows, read once from config files
    (`ds_omni.model.build.model_facts`)."""

    where: str
    """How errors name the LLM: "model.llm", or the pretrained directory's."""
    family: str
    model_type: str
    splits: bool
    """The family's attention splits over ranks (`Family.sequence_parallel`)."""
    per_sample: str | None
    """Why the LLM's per-sample layers cannot be split over ranks (None: they can)."""
    experts: int
    """Routed experts per MoE layer (0: a dense LLM)."""
    attention_dropout: float
    max_seq_len: int
    """data.max_seq_len: the tokens of a full row."""


@dataclass(frozen=True)
class Feature:
    name: str
    """A field of `Setting`."""
    on: Callable[[Setting], bool]
    what: str
    """When it is on, in words (docs/composition.md)."""
    fits: "Callable[[Setting, ModelFacts], str | None] | None" = None
    """Its model check: why this LLM cannot run it, as an error that says the fix (None: it can)."""


def ring_problem(m: ModelFacts, asked: str, fix: str, field: str,
                 experts: bool = False) -> str | None:
    """Why the LLM `m` cannot run its attention as a ring (`ds_omni.model.ring_attention`), as an
    error: `asked` names what asks for one (parallel.cp, or a per-sequence block past the heads),
    `fix` how to ask for none, `field` the config field that does, `experts` whether an MoE LLM
    may (None: it can)."""
    if not m.splits:
        return (f"{asked}: the {m.family!r} family's attention cannot be split over ranks in "
                f"this version (its family sets no sequence_parallel); {fix}")
    if m.per_sample is not None:
        return f"{asked}: {m.per_sample.replace('parallel.sp', field)}"
    if m.experts and not experts:
        return (f"{asked}: {m.where} ({m.model_type}) is an MoE LLM with {m.experts} experts, "
                "whose per-sample router statistics over a per-sequence block's ring no test "
                f"checks against one process in this version (parallel.cp's ring: "
                f"tests/dist/test_context_parallel_composed.py); {fix}")
    if m.attention_dropout:
        return (f"{asked}: {m.where} has attention_dropout {m.attention_dropout}, which ring "
                f"attention does not apply; set it to 0 in the LLM's config, or {fix}")
    return None


def _ring_fits(s: Setting, m: ModelFacts) -> str | None:
    """Ring attention splits the LLM's attention over any two shards of a row (`ring_problem`),
    and a full row gives every rank its zigzag chunks."""
    if problem := ring_problem(m, f"parallel.cp={s.cp}", "set parallel.cp to 1", "parallel.cp",
                               experts=True):
        return problem
    chunks, n = 2 * s.cp * s.sp, m.max_seq_len
    if n % chunks:
        return (f"parallel.cp={s.cp} x parallel.sp={s.sp}: data.max_seq_len={n} is not a "
                f"multiple of the row's {chunks} chunks (2 x cp zigzag chunks per sample, each "
                "cut over sp ranks), so a full row would leave the ranks uneven shares; set "
                f"data.max_seq_len to {n // chunks * chunks or chunks} or "
                f"{(n // chunks + 1) * chunks}")
    return None


FEATURES = (
    Feature("zero", lambda s: s.zero is not None,
            "data parallelism under the DeepSpeed JSON's ZeRO stage (always, once it is known)"),
    Feature("sp", lambda s: s.sp > 1, "Ulysses sequence parallelism: parallel.sp > 1"),
    Feature("max_sequence_sp", lambda s: s.max_sequence_sp > 1,
            "per-sequence SP: parallel.max_sequence_sp > 1"),
    Feature("tp", lambda s: s.tp > 1, "tensor parallelism of the backbone: parallel.tp > 1"),
    Feature("pp", lambda s: s.pp > 1, "pipeline stages: parallel.pp > 1"),
    Feature("encoder_placement", lambda s: s.encoder_placement != "stage0",
            "the encoders on every stage: parallel.encoder_placement \"uniform\", \"bubbles\" or "
            "\"auto\""),
    Feature("encoder_pool", lambda s: s.encoder_pool != "off",
            "the encoder pool: parallel.encoder_pool \"dp\""),
    Feature("ep", lambda s: s.ep > 1, "expert parallelism of an MoE LLM: parallel.ep > 1"),
    Feature("cp", lambda s: s.cp > 1, "ring attention (context parallelism): parallel.cp > 1",
            fits=_ring_fits),
)


DEGREES = tuple(f.name for f in FEATURES if f.name in PARALLEL_FIELDS
                and type(getattr(Setting(), f.name)) is int)
"""The features that are degrees of the parallel section (sp, tp, ..., cp): what the simulator
enumerates, describes and turns off in its baselines without naming them one by one."""


@dataclass(frozen=True)
class Rule:
    """One pair of features: it composes (`refused` None), or it is refused where both are on
    and `refused` holds."""

    a: str
    b: str
    refused: Callable[[Setting], bool] | None = None
    when: str = ""
    """The refusal's condition in words, beyond both features on (docs/composition.md)."""
    shows: tuple[str, ...] = ()
    """Further values the error names (those its condition reads)."""
    reason: str = ""
    """Why: the DeepSpeed limitation or the arithmetic behind it."""
    fix: str = ""
    """What to set instead."""
    note: str = ""
    """How a composing pair composes, or what it needs."""
    launch_only: bool = False
    """Refused by training's launch (`plan_run`) and the plan search only: the parallel section
    and the simulator's plans take it (the simulator models it, as Megatron-LM runs it)."""


def _composes(a: str, b: str, note: str = "") -> Rule:
    return Rule(a, b, note=note)


def _refused(a: str, b: str, reason: str, fix: str, refused=lambda s: True, **more) -> Rule:
    return Rule(a, b, refused=refused, reason=reason, fix=fix, **more)


UNDER_PP = "encoder_placement acts under pp only"
PP_SECTION = 'docs/parallelism.md, "Per-sequence SP and ring attention under the pipeline"'
BLOCKS_UNDER_PP = ("DeepSpeed's pipeline engine runs gradient_accumulation_steps micro-batches on "
                   "every rank each step (its 1F1B schedule is built for that count), while "
                   "per-sequence SP adds a varying number of long-sequence rounds to each step; "
                   "and each stage runs its decoder layers with one attention fixed when the "
                   "stage is built, so a block's Ulysses group (and ring) cannot be chosen per "
                   f"micro-batch there ({PP_SECTION})")
RING_UNDER_PP = ("each pipeline stage runs its decoder layers with one attention fixed when the "
                 "stage is built, on the tensors the engine passes between stages (hidden states, "
                 "positions, cu_seqlens, an index): a ring row's zigzag index is not bound per "
                 "micro-batch there, and no stage's ring groups are drawn from the engine's grid "
                 f"in this version ({PP_SECTION})")

RULES = (
    _composes("zero", "sp", "any stage; under ZeRO-3 zero_optimization.reduce_scatter stays true "
              "(ds_omni sets it: one gradient reduction path, whose scaling is known)"),
    _composes("zero", "max_sequence_sp", "any stage"),
    _refused("tp", "zero", "under ZeRO-3 DeepSpeed 0.19.8 partitions the parameters over the "
             "mpu's data-parallel group (`DeepSpeedZeRoOffload._convert_to_zero_parameters`, "
             "runtime/zero/parameter_offload.py), which under tp x sp holds one TP rank's dp "
             "ranks, not the dp x sp ranks that hold its shards: the SP ranks' gradients are "
             "never summed (tp2 x sp2 measured 25-40 % off one process)",
             "set zero_optimization.stage to 1 or 2 beside tp x sp, or parallel.sp to 1",
             refused=lambda s: s.zero == 3 and s.sp > 1, shows=("sp",),
             when="ZeRO stage 3 and parallel.sp > 1",
             note="ZeRO partitions and reduces over the ranks of one TP rank (they hold the same "
             "shards); under ZeRO-3 each TP shard is partitioned again over them, as DeepSpeed "
             "0.19.8 supports (`engine._configure_tensor_parallel_states`)"),
    _refused("pp", "zero", "DeepSpeed's pipeline engine runs ZeRO 0 or 1 only (it partitions "
             "the model itself)", "use ds_configs/zero1.json (zero_optimization.stage 0 or 1) or "
             "set parallel.pp to 1", refused=lambda s: s.zero in (2, 3), when="ZeRO stage 2 or 3"),
    _composes("zero", "encoder_placement", "under pp: ZeRO 0 or 1"),
    _composes("zero", "encoder_pool", "pays most under ZeRO-3, whose parameter gathers make every "
              "round wait for the busiest rank's encoder"),
    _refused("ep", "zero", "ep under ZeRO-3 trains, but its checkpoints hold AutoEP's "
             "ZeRO-3-partitioned experts, which train.export_hf (and ds-omni convert) cannot "
             "read in this version", "set zero_optimization.stage to 1 or 2 (each rank already "
             "holds 1/ep of the experts), or train.export_hf to false",
             refused=lambda s: s.zero == 3 and s.export_hf, shows=("export_hf",),
             when="ZeRO stage 3 and train.export_hf"),
    _refused("max_sequence_sp", "sp", "max_sequence_sp chooses an SP degree per sequence, where "
             "a static parallel.sp fixes one for all", "set parallel.sp to 1 (max_sequence_sp "
             "splits the long sequences alone), or max_sequence_sp to 1"),
    _composes("sp", "tp", "tp x sp must divide the query heads and tp the key/value heads (each "
              "TP rank's heads are split again over its Ulysses group)"),
    _composes("pp", "sp", "Ulysses inside every stage: the pipeline engine's data axis holds the "
              "dp x sp ranks (ZeRO reduces over them), SP shard i of a stage sends to SP shard i "
              "of the next (`parallelize/pipe_grid.py`)"),
    _composes("sp", "encoder_placement", UNDER_PP + "; \"uniform\" and \"bubbles\": each SP "
              "shard's column of stages encodes the items its reshard plan gives it, stage 0's "
              "resharding all-to-all takes their rows to the shards holding their placeholders; "
              "\"auto\" models a shard's items on 1/sp stages"),
    _composes("sp", "encoder_pool", "the pool is every rank (dp x sp); a row's long items stay "
              "split over its SP group"),
    _refused("ep", "sp", "under sp, DeepSpeed's ZeRO-0 expert reduction divides the experts' "
             "gradients by the whole world (dp x sp: sp times too small, where ZeRO 1 and 2 "
             "divide by dp) and its AutoEP refuses ZeRO-3",
             "set zero_optimization.stage to 1 or 2",
             refused=lambda s: s.zero is not None and s.zero not in (1, 2), shows=("zero",),
             when="ZeRO stage 0 or 3"),
    _composes("tp", "max_sequence_sp", "a block is drawn over the data-parallel ranks of one TP "
              "rank (its all-to-alls never mix TP shards); tp x max_sequence_sp must divide the "
              "query heads and tp the key/value heads"),
    _refused("max_sequence_sp", "pp", BLOCKS_UNDER_PP,
             "set parallel.max_sequence_sp or parallel.pp to 1"),
    _composes("max_sequence_sp", "encoder_placement", UNDER_PP),
    _composes("max_sequence_sp", "encoder_pool", "the pool spreads each round over its groups "
              "(a long sequence's block, the other ranks alone)"),
    _composes("max_sequence_sp", "ep", "a sample's aux-loss statistics are summed over the ranks "
              "its row is split over"),
    _composes("tp", "pp", "AutoTP's layers inside every stage: the pipeline engine's topology has "
              "a model axis of tp ranks (Megatron-DeepSpeed's); the encoders stay whole on every "
              "TP rank"),
    _composes("tp", "encoder_placement", UNDER_PP + "; \"uniform\" and \"bubbles\": each TP "
              "rank's column of stages encodes every item (the encoders stay whole), so every "
              "TP rank of stage 0 holds every row; \"auto\" models every item on 1/tp stages"),
    _composes("tp", "encoder_pool", "each TP rank pools over its own data-parallel (x SP) "
              "ranks, all TP ranks alike"),
    _refused("ep", "tp", "the experts beside tp are DeepSpeed's AutoEP+AutoTP folding, which "
             "DeepSpeed 0.19.8 validates with neither Ulysses SP nor pipeline stages "
             "(auto_ep_folding.validate_folding_global refuses both)",
             "set parallel.sp and parallel.pp to 1 beside tp x ep, or parallel.tp to 1",
             refused=lambda s: s.sp > 1 or s.pp > 1, shows=("sp", "pp"),
             when="parallel.sp > 1 or parallel.pp > 1",
             note="Megatron's expert-data-parallel layout: attention and dense MLPs over tp "
             "(AutoTP's layers), the experts over ep consecutive ranks of a stage's dp x tp, "
             "each TP rank dispatching 1/tp of a row's assignments; ep divides dp x tp"),
    _composes("pp", "encoder_placement", "where the encoders run under pp: \"stage0\", "
              "\"uniform\" (not with bf16.immediate_grad_update), \"bubbles\" (its encoder "
              "backward in the engine's idle slots; bf16 too) or \"auto\" (\"bubbles\" where "
              "the cost model predicts a gain, else \"uniform\")"),
    _composes("encoder_pool", "pp", "each round is planned over a stage's dp x sp ranks as "
              "without pp, on the stages that encode: under \"stage0\" stage 0's ranks encode "
              "what the pool gives them; under \"uniform\" and \"bubbles\" each pool rank's "
              "column of stages splits it (by cost, or into the schedule's idle slots), its rows "
              "going to its stage-0 rank, then over the pool to the shard holding their "
              "placeholders (gradients back the same way)"),
    _composes("ep", "pp", "each stage's MoE blocks are AutoEP's with EP groups of ep "
              "consecutive ranks of the stage's dp x sp ranks (ep divides them); every stage "
              "adds its layers' per-sample router statistics to tensors that travel with the "
              "hidden states, and the last stage forms HF's aux loss from the whole sums (under "
              "sp summed over the row's SP group first)"),
    _composes("encoder_pool", "encoder_placement",
              UNDER_PP + ' ("auto" models a pool rank\'s share)'),
    _composes("encoder_placement", "ep", UNDER_PP),
    _composes("encoder_pool", "ep"),
    # parallel.cp: ring attention across the sp x cp ranks of a row (docs/parallelism.md)
    _composes("zero", "cp", "any stage: ZeRO reduces over the dp x sp x cp ranks, which hold "
              "the same parameters and different tokens"),
    _composes("sp", "cp", "Ulysses inside (sp consecutive ranks exchange heads), the ring across "
              "them: sp must divide the query heads, cp need not"),
    _refused("max_sequence_sp", "cp", "parallel.cp fixes one ring degree for every row, where "
             "per-sequence SP picks each block's own split (Ulysses up to the heads, a ring "
             "across: `ParallelPlan.block_split`)", "set parallel.cp to 1 (a block larger than "
             "the LLM's heads runs its ring by itself), or parallel.max_sequence_sp to 1"),
    _composes("tp", "cp", "the rings (and Ulysses groups) are drawn from the sequence ranks of "
              "one TP rank, each passing its own heads' key/value blocks; ZeRO reduces over "
              "the dp x sp x cp ranks of one TP rank"),
    _refused("pp", "cp", RING_UNDER_PP, "set parallel.cp or parallel.pp to 1 (parallel.sp "
             "splits rows under the pipeline)"),
    _composes("encoder_placement", "cp", UNDER_PP),
    _composes("encoder_pool", "cp", "the pool is every rank (dp x sp x cp); a row's long items "
              "stay split over its sp x cp ranks"),
    _refused("ep", "cp", "under cp, DeepSpeed's ZeRO-0 expert reduction divides the experts' "
             "gradients by the whole world (dp x sp x cp, where ZeRO 1 and 2 divide by dp: at "
             "ep2 x cp2 x dp2 every expert gradient is 1/2 of one process's) and its AutoEP "
             "refuses ZeRO-3",
             "set zero_optimization.stage to 1 or 2",
             refused=lambda s: s.zero is not None and s.zero not in (1, 2), shows=("zero",),
             when="ZeRO stage 0 or 3",
             note="EP groups of ep consecutive ranks of the dp x sp x cp ranks; a sample's aux "
             "statistics are summed over its row's ranks at their zigzag positions"),
)


def shown(name: str, s: Setting) -> str:
    """`name`'s field with its value as the JSON configs write it: `parallel.encoder_pool="dp"`."""
    return f"{FIELDS[name]}={json.dumps(getattr(s, name))}"


def message(rule: Rule, s: Setting) -> str:
    """The error of a refused rule: both features with their values, the reason and the fix."""
    when = " and ".join(shown(name, s) for name in rule.shows)
    return (f"{shown(rule.a, s)} cannot be combined with {shown(rule.b, s)}"
            f"{' when ' + when if when else ''}: {rule.reason}; {rule.fix}")


# The rules the parallel section decides alone first, then those that read the ZeRO stage, then
# the launch's: a plan that several rules refuse is named by the same one wherever it is checked.
ORDER = sorted(RULES, key=lambda r: ("zero" in (r.a, r.b, *r.shows), r.launch_only))


def refusal(s: Setting, launch: bool = True) -> Rule | None:
    """The first rule (in `ORDER`) that refuses `s`, or None. `launch=False`: without the rules
    only training's launch applies (`Rule.launch_only`)."""
    on = {f.name for f in FEATURES if f.on(s)}
    for rule in ORDER:
        if (rule.refused is not None and rule.a in on and rule.b in on and rule.refused(s)
                and (launch or not rule.launch_only)):
            return rule
    return None


def check_composition(parallel, zero: int | None = None, export_hf: bool = False, *,
                      launch: bool = True) -> None:
    """Raise a `CompositionError` when the table refuses `parallel` (a `Setting`, a
    `ParallelConfig`, or anything with its fields) under ZeRO stage `zero` (None: not known yet,
    its rules wait) and `export_hf`."""
    s = parallel if isinstance(parallel, Setting) else Setting.of(parallel, zero, export_hf)
    rule = refusal(s, launch)
    if rule is not None:
        raise CompositionError(message(rule, s))


def check_model_fits(parallel, facts: ModelFacts) -> None:
    """Raise a `ModelError` when a feature `parallel` turns on cannot run on the LLM `facts`
    describes (each `Feature.fits`), before any process group."""
    s = parallel if isinstance(parallel, Setting) else Setting.of(parallel)
    for feature in FEATURES:
        if feature.fits is not None and feature.on(s) and (problem := feature.fits(s, facts)):
            raise ModelError(problem)
