"""The parallel plan: degrees and the rank layout, as a small pure value object.

Axes, outermost first: pp (pipeline stage), dp (data parallel), sp (Ulysses sequence parallel),
tp (tensor parallel). The heaviest traffic is innermost so it stays among neighbouring ranks
(inside a node): tp's all-reduces in every layer's forward and backward, then sp's all-to-alls;
pp is outermost because its point-to-point traffic is the lightest.

    rank = ((pp_stage * dp + dp_rank) * sp + sp_rank) * tp + tp_rank

Under parallel.cp the sp axis holds parallel.sp x parallel.cp ranks (`ring_coords`).

The plan also owns what derives from the degrees and the config (the reorder group size G, the
per-sequence SP blocks, the encoder pool's size, the group that shares long items), so nothing
else computes them again: `ds_omni.train.setup` builds the plan once and hands it on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds_omni.config import ParallelConfig, ReorderConfig
from ds_omni.errors import DataError, LaunchError
from ds_omni.parallel.hdp import check_degree, ulysses_ring_split
from ds_omni.parallel.row_cut import RowCut


@dataclass(frozen=True)
class RankCoords:
    pp_stage: int
    dp_rank: int
    sp_rank: int
    tp_rank: int = 0


@dataclass(frozen=True)
class ParallelPlan:
    world_size: int
    dp: int
    sp: int = 1
    """Ranks that split one sequence: parallel.sp x parallel.cp (Ulysses' degree is `ulysses`)."""
    pp: int = 1
    tp: int = 1
    reorder_group: int = 1
    """G: consecutive data-parallel ranks whose loaders exchange sample metadata and reorder
    samples together (1: loader order)."""
    max_sequence_sp: int = 1
    """Per-sequence SP: the most ranks one long sequence is split over (1: off)."""
    ep: int = 1
    """Expert parallelism: each MoE layer's experts split over groups of ep data-parallel ranks
    (1: off; `ds_omni.parallelize.expert_parallel`)."""
    encoder_pool: bool = False
    """parallel.encoder_pool="dp": each round's items are encoded over the pool's ranks."""
    cp: int = 1
    """Ring attention: the ranks of `sp` that pass key/value blocks around a ring (1: off)."""
    heads: int | None = None
    """The LLM's query heads on one TP rank, which a per-sequence block's Ulysses part divides
    (`block_split`; None: not known, every block all Ulysses); set by `with_heads`."""

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int,
                    reorder: ReorderConfig) -> "ParallelPlan":
        """Resolve "auto" degrees and the reorder group, and check that the plan fits
        `world_size` ranks."""
        seq = cfg.sp * cfg.cp  # the ranks that split a row
        model_parallel = cls.replica_size(cfg)  # seq x pp x tp
        # the model-parallel degrees as the errors name them (tp, cp only where they are set)
        names = ["sp", *(["cp"] if cfg.cp > 1 else []), *(["tp"] if cfg.tp > 1 else []), "pp"]
        values = " x ".join(str(getattr(cfg, n)) for n in names)
        if cfg.dp == "auto":
            if world_size % model_parallel:
                raise LaunchError(
                    f"world size {world_size} is not divisible by "
                    f"{' x '.join('parallel.' + n for n in names)} = "
                    f"{values} = {model_parallel}; launch a multiple of {model_parallel} "
                    "processes or change the plan")
            dp = cls.auto_dp(world_size, seq, cfg.pp, cfg.tp)
        else:
            dp = cfg.dp
        if dp * model_parallel != world_size:
            raise LaunchError(
                f"the plan needs parallel.dp x {' x '.join(names)} = {dp} x {values} = "
                f"{dp * model_parallel} processes but {world_size} were launched; launch "
                f"{dp * model_parallel} (e.g. deepspeed --num_gpus {dp * model_parallel}) or set "
                "parallel.dp to \"auto\"")
        group = reorder_group_size(reorder, dp)
        if cfg.max_sequence_sp > 1:
            check_per_sequence(reorder.mode, group, cfg.max_sequence_sp)
        check_expert_parallel(cfg, dp)
        return cls(world_size=world_size, dp=dp, sp=seq, pp=cfg.pp, tp=cfg.tp,
                   reorder_group=group, max_sequence_sp=cfg.max_sequence_sp, ep=cfg.ep,
                   encoder_pool=cfg.encoder_pool == "dp", cp=cfg.cp)

    @staticmethod
    def model_parallel_size(sp: int = 1, pp: int = 1, tp: int = 1) -> int:
        """Ranks of one data-parallel replica (sp x pp x tp): "auto" dp is the world over it."""
        return sp * pp * tp

    @staticmethod
    def auto_dp(world_size: int, sp: int = 1, pp: int = 1, tp: int = 1) -> int:
        """dp "auto": the whole replicas of sp x pp x tp ranks in `world_size` (`from_config`
        refuses a world they do not fill)."""
        return world_size // ParallelPlan.model_parallel_size(sp, pp, tp)

    @staticmethod
    def replica_size(cfg: ParallelConfig) -> int:
        """`model_parallel_size` of `cfg`'s degrees: the ranks of one data-parallel replica."""
        return ParallelPlan.model_parallel_size(cfg.sp * cfg.cp, cfg.pp, cfg.tp)

    @staticmethod
    def dp_of(cfg: ParallelConfig, world_size: int) -> int:
        """`cfg`'s dp on `world_size` ranks: its own, or "auto"'s whole replicas (unchecked:
        `from_config` refuses a world they do not fill)."""
        return world_size // ParallelPlan.replica_size(cfg) if cfg.dp == "auto" else cfg.dp

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def ep_group_ranks(self) -> list[list[int]]:
        """Expert-parallel groups: ep consecutive ranks of one pipeline stage's dp x sp x tp
        ranks each, as DeepSpeed's `groups._create_expert_and_data_parallel` draws them (under
        sp its "sp" mode: consecutive ranks, so an EP group may be an SP group; under tp its
        AutoEP+AutoTP folding tables, `ds_omni.parallelize.expert_folding`)."""
        stage = self.dp * self.sp * self.tp
        return [list(range(start, start + self.ep)) for first in range(0, self.world_size, stage)
                for start in range(first, first + stage, self.ep)]

    def expert_data_group_ranks(self) -> list[list[int]]:
        """The ranks of one stage holding the same experts (one of each EP group), over which
        the experts' gradients are reduced (DeepSpeed's expert-data-parallel groups)."""
        stage = self.dp * self.sp * self.tp
        return [list(range(first + e, first + stage, self.ep))
                for first in range(0, self.world_size, stage) for e in range(self.ep)]

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def seq_data_size(self) -> int:
        """Ranks that hold the same parameters (the same stage and TP shard): dp x sp, over which
        ZeRO partitions (`seq_data_group_ranks`)."""
        return self.dp * self.sp

    @property
    def pool_size(self) -> int:
        """Ranks of the encoder pool (`parallel.encoder_pool`): every rank of a pipeline stage
        (of one TP rank: each TP rank pools its own copy of the encoders)."""
        return self.seq_data_size

    def pool_rank(self, rank: int) -> int:
        """`rank`'s place in its encoder pool (the dp x sp ranks of its TP rank)."""
        c = self.coords(rank)
        return c.dp_rank * self.sp + c.sp_rank

    def replica_rank(self, rank: int) -> int:
        """`rank` with its TP ranks counted as one (rank // tp): the TP ranks of a row run its
        whole layers alike, so they share what is drawn per rank (the dropout stream)."""
        return rank // self.tp

    @property
    def reader_group_size(self) -> int:
        """Ranks that train on the same rows: the sp x tp ranks of one data-parallel rank."""
        return self.sp * self.tp

    @property
    def tp_encodes_apart(self) -> bool:
        """Under tp the TP ranks of a row encode different items of it (and sum the encoders'
        gradients over TP), unless another plan already spreads the row's items: the SP ranks
        under sp > 1, the pool's ranks under encoder_pool; and not under pp, whose encoders run
        on stage 0 or by "uniform"'s plan, every TP rank of a stage alike."""
        return self.tp > 1 and self.sp == 1 and not self.encoder_pool and self.pp == 1

    @property
    def sp_degrees(self) -> list[int]:
        """The Ulysses degrees the LLM runs under (`ulysses`, the largest per-sequence block's
        Ulysses part), > 1."""
        return sorted({d for d in (self.ulysses, self.block_split(self.max_sequence_sp)[0])
                       if d > 1})

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ulysses(self) -> int:
        """Ulysses' degree (parallel.sp): the consecutive sequence ranks that exchange heads."""
        return self.sp // self.cp

    def ring_coords(self, rank: int) -> tuple[int, int]:
        """(cp rank, Ulysses rank) of `rank` in its sequence group: its place in its ring, and
        in the Ulysses group of its cp shard."""
        return divmod(self.coords(rank).sp_rank, self.ulysses)

    def row_cut(self) -> RowCut:
        """How a row is cut over its `sp` ranks (the ring's zigzag under cp), for the loader."""
        return RowCut(self.sp, zigzag=self.cp)

    def cp_group_ranks(self) -> list[list[int]]:
        """Rings: the sequence ranks with the same Ulysses rank, in cp-rank order (one list per
        sequence group and Ulysses rank)."""
        u = self.ulysses
        return [group[j::u] for group in self.sp_group_ranks() for j in range(u)]

    def ulysses_group_ranks(self) -> list[list[int]]:
        """Under cp: the Ulysses groups, the `ulysses` consecutive sequence ranks of one cp
        shard (without cp, `sp_group_ranks`)."""
        u = self.ulysses
        return [group[c * u:(c + 1) * u] for group in self.sp_group_ranks()
                for c in range(self.cp)]

    def axis_group_ranks(self) -> dict[str, list[list[int]]]:
        """The process groups an axis needs of its own, by name (`<name>_groups` in `layout`):
        `rank_groups` makes each kind whose groups have more than one rank and hands this rank's
        on (`RankGroups.axes`). Under cp: the rings and the Ulysses groups of the cp shards."""
        if not self.cp_enabled:
            return {}
        return {"cp": self.cp_group_ranks(), "ulysses": self.ulysses_group_ranks()}

    @property
    def long_item_group(self) -> int:
        """The most ranks that share one row and so may split its long items (long-short SP)."""
        return max(self.sp, self.max_sequence_sp)

    def sequence_blocks(self) -> list[tuple[int, int]]:
        """Per-sequence SP: every aligned block (first data-parallel rank, size) of 2, 4, ...
        max_sequence_sp data-parallel ranks, in the order every rank creates their groups."""
        return [(start, size) for size in _powers_of_two(2, self.max_sequence_sp)
                for start in range(0, self.dp, size)]

    def sequence_block_ranks(self, start: int, size: int) -> list[list[int]]:
        """The global ranks of block (start, size): one list per (pp, tp), so a block's ranks
        share one TP rank and its all-to-alls never mix TP shards (without tp: the ranks
        [start, start + size))."""
        return [[self.rank_of(RankCoords(p, d, 0, t)) for d in range(start, start + size)]
                for p in range(self.pp) for t in range(self.tp)]

    def with_heads(self, heads: int) -> "ParallelPlan":
        """This plan for an LLM of `heads` query heads (split over tp): its blocks' splits."""
        return dataclasses.replace(self, heads=heads // self.tp)

    def block_split(self, size: int) -> tuple[int, int]:
        """(Ulysses degree, ring degree) of a per-sequence block of `size` ranks: Ulysses over
        the largest degree dividing the heads, ring attention across (`hdp.ulysses_ring_split`,
        the simulator's rule too)."""
        return ulysses_ring_split(size, self.heads)

    def block_cut(self, size: int) -> RowCut:
        """How a per-sequence block of `size` ranks cuts its row: zigzag over its ring
        (`block_split`), contiguous where the block fits the heads."""
        return RowCut(size, zigzag=self.block_split(size)[1])

    def block_ring_ranks(self, members: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(Ulysses groups, rings) of a block of global ranks `members` (in sequence-rank
        order) whose `block_split` has a ring: as `ulysses_group_ranks` and `cp_group_ranks`
        cut the static sequence group, sequence rank s = cp rank x ulysses + Ulysses rank."""
        u, cp = self.block_split(len(members))
        return ([members[c * u:(c + 1) * u] for c in range(cp)],
                [members[j::u] for j in range(u)])

    def coords(self, rank: int) -> RankCoords:
        tp_rank, rest = rank % self.tp, rank // self.tp
        sp_rank = rest % self.sp
        dp_rank = (rest // self.sp) % self.dp
        return RankCoords(pp_stage=rest // (self.sp * self.dp), dp_rank=dp_rank, sp_rank=sp_rank,
                          tp_rank=tp_rank)

    def rank_of(self, c: RankCoords) -> int:
        return ((c.pp_stage * self.dp + c.dp_rank) * self.sp + c.sp_rank) * self.tp + c.tp_rank

    def dp_group_ranks(self) -> list[list[int]]:
        """Ranks that hold different data and the same model shard: one list per (pp, sp, tp)."""
        return [[self.rank_of(RankCoords(p, d, s, t)) for d in range(self.dp)]
                for p in range(self.pp) for s in range(self.sp) for t in range(self.tp)]

    def sp_group_ranks(self) -> list[list[int]]:
        """Ranks that split one sequence: one list per (pp, dp, tp)."""
        return [[self.rank_of(RankCoords(p, d, s, t)) for s in range(self.sp)]
                for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def tp_group_ranks(self) -> list[list[int]]:
        """Ranks that split the backbone's layers (and read the same rows): one list per
        (pp, dp, sp); consecutive ranks."""
        return [[self.rank_of(RankCoords(p, d, s, t)) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp) for s in range(self.sp)]

    def reader_group_ranks(self) -> list[list[int]]:
        """Ranks that train on the same rows (the sp x tp ranks of one data-parallel rank): one
        list per (pp, dp), consecutive ranks, in (sp, tp) order. Its first rank reads the rows
        for all of them under data.shared_reading (`ds_omni/data/shared_read.py`)."""
        return [[self.rank_of(RankCoords(p, d, s, t)) for s in range(self.sp)
                 for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def seq_data_group_ranks(self) -> list[list[int]]:
        """Ranks that hold the same parameters (or the same TP shard) and different tokens: the
        dp x sp ranks of one (pp, tp). ZeRO partitions and reduces over them under sp > 1, and the
        step's target count adds up over them (each token once)."""
        return [[self.rank_of(RankCoords(p, d, s, t)) for d in range(self.dp)
                 for s in range(self.sp)] for p in range(self.pp) for t in range(self.tp)]

    def reorder_group_ranks(self, group_size: int) -> list[list[int]]:
        """Ranks whose loaders share sample metadata: G consecutive ranks of each dp group.

        Consecutive dp ranks are near each other (one node), so the metadata exchange stays cheap.
        """
        if group_size < 1 or self.dp % group_size:
            raise ValueError(f"a reorder group of {group_size} ranks does not divide the "
                             f"data-parallel size {self.dp}")
        return [dp_ranks[start:start + group_size] for dp_ranks in self.dp_group_ranks()
                for start in range(0, self.dp, group_size)]

    def layout(self, gpus_per_node: int | None = None) -> dict:
        """Every rank's (pp, dp, sp[, tp]) coordinates and the groups it belongs to, as plain
        data; with `gpus_per_node`, the groups of each kind that cross a node boundary.

        What `ds-omni plan` prints, so a layout can be checked before any process is launched.
        """
        tp = self.tp_enabled  # the tp coordinate and groups are printed under parallel.tp only
        ranks = [{"rank": r, "pp": c.pp_stage, "dp": c.dp_rank, "sp": c.sp_rank,
                  **({"tp": c.tp_rank} if tp else {})}
                 for r, c in enumerate(map(self.coords, range(self.world_size)))]
        # tp x sp: ZeRO's group is then no longer every rank of a stage, so it is printed too
        both = tp and self.sp_enabled
        out = {"ranks": ranks, **({"tp_groups": self.tp_group_ranks()} if tp else {}),
               "sp_groups": self.sp_group_ranks(), "dp_groups": self.dp_group_ranks(),
               **({"seq_data_groups": self.seq_data_group_ranks()} if both else {}),
               **{f"{name}_groups": ranks for name, ranks in self.axis_group_ranks().items()},
               **({"ep_groups": self.ep_group_ranks(),
                   "expert_data_groups": self.expert_data_group_ranks()}
                  if self.ep_enabled else {}),
               "reorder_group_size": self.reorder_group,
               "reorder_groups": self.reorder_group_ranks(self.reorder_group)}
        out.update(self._feature_groups())
        if gpus_per_node:  # every kind of group
            kinds = [k for k in out if k.endswith("_groups")]
            out["cross_node"] = {kind: [g for g in out[kind] if _crosses(g, gpus_per_node)]
                                 for kind in kinds}
        return out

    def pp_group_ranks(self) -> list[list[int]]:
        """Ranks of one pipeline, stage by stage: one list per (dp, sp, tp)."""
        return [[self.rank_of(RankCoords(p, d, s, t)) for p in range(self.pp)]
                for d in range(self.dp) for s in range(self.sp) for t in range(self.tp)]

    def _feature_groups(self) -> dict[str, list[list[int]]]:
        """The groups of the features on (`layout`): the pipelines, the encoder pools (the
        dp x sp ranks of one TP rank, `RankGroups.pool`), every per-sequence block's groups."""
        out = {}
        if self.pp_enabled:
            out["pp_groups"] = self.pp_group_ranks()
        if self.encoder_pool:
            out["pool_groups"] = self.seq_data_group_ranks()
        if self.max_sequence_sp > 1:
            out["sequence_block_groups"] = [g for start, size in self.sequence_blocks()
                                            for g in self.sequence_block_ranks(start, size)]
            rings = [self.block_ring_ranks(g) for g in out["sequence_block_groups"]
                     if self.block_split(len(g))[1] > 1]  # blocks past the heads
            if rings:
                out["sequence_block_ring_groups"] = [r for _, ring in rings for r in ring]
        return out


def _crosses(group: list[int], gpus_per_node: int) -> bool:
    """Whether the ranks of `group` sit on more than one node (ranks fill nodes in order)."""
    return len({r // gpus_per_node for r in group}) > 1


def reorder_group_size(cfg: ReorderConfig, dp_size: int) -> int:
    """G: ranks that share metadata (1 for loader order; never more than the dp ranks)."""
    if cfg.mode == "loader_order":
        return 1
    group = min(cfg.group_size, dp_size)
    if dp_size % group:
        raise DataError(f"data.reorder.group_size={group} must divide the data-parallel size "
                        f"{dp_size}; pick a divisor of {dp_size}")
    return group


def check_per_sequence(mode: str, group_size: int, max_degree: int) -> None:
    """Per-sequence SP places long sequences on blocks inside a reorder group."""
    if mode == "loader_order":
        raise DataError("parallel.max_sequence_sp > 1 needs grouped reordering to place long "
                        "sequences; set data.reorder.mode to \"fixed\" or \"budget\"")
    try:
        check_degree(max_degree, group_size)
    except ValueError as e:
        raise DataError(f"{e} (the group has min(data.reorder.group_size, data-parallel ranks) "
                        "ranks)") from None


def _powers_of_two(low: int, high: int) -> list[int]:
    out = []
    while low <= high:
        out.append(low)
        low *= 2
    return out


def check_expert_parallel(cfg: ParallelConfig, dp: int) -> None:
    """parallel.ep fits the plan: it divides a pipeline stage's dp x sp x tp ranks (expert-parallel
    groups are drawn from those, as DeepSpeed's AutoEP draws them). What it composes with is
    `ds_omni.config.composition`'s table."""
    if cfg.ep == 1:
        return
    stage = dp * cfg.sp * cfg.tp
    if stage % cfg.ep:
        raise LaunchError(f"parallel.ep={cfg.ep} does not divide the data-parallel x "
                          f"sequence-parallel x tensor-parallel ranks of a pipeline stage, "
                          f"{dp} x {cfg.sp} x {cfg.tp} = {stage}: expert-parallel groups are drawn "
                          f"from those ranks; launch a multiple of {cfg.ep} of them per stage or "
                          "change parallel.ep")
