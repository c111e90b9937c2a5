"""The parallel plan: degrees and the rank layout, as a small pure value object.

Axes, outermost first: pp (pipeline stage), dp (data parallel), sp (Ulysses sequence parallel).
sp is innermost so its all-to-all traffic stays among neighbouring ranks (inside a node); pp is
outermost because its point-to-point traffic is the lightest.

    rank = (pp_stage * dp + dp_rank) * sp + sp_rank
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_omni.config import ParallelConfig
from ds_omni.errors import LaunchError


@dataclass(frozen=True)
class RankCoords:
    pp_stage: int
    dp_rank: int
    sp_rank: int


@dataclass(frozen=True)
class ParallelPlan:
    world_size: int
    dp: int
    sp: int = 1
    pp: int = 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelPlan":
        """Resolve "auto" degrees and check that the plan fits `world_size` ranks."""
        model_parallel = cfg.sp * cfg.pp
        if cfg.dp == "auto":
            if world_size % model_parallel:
                raise LaunchError(
                    f"world size {world_size} is not divisible by parallel.sp x parallel.pp = "
                    f"{cfg.sp} x {cfg.pp} = {model_parallel}; launch a multiple of {model_parallel} "
                    "processes or change the plan")
            dp = world_size // model_parallel
        else:
            dp = cfg.dp
        if dp * model_parallel != world_size:
            raise LaunchError(
                f"the plan needs parallel.dp x sp x pp = {dp} x {cfg.sp} x {cfg.pp} = "
                f"{dp * model_parallel} processes but {world_size} were launched; launch "
                f"{dp * model_parallel} (e.g. deepspeed --num_gpus {dp * model_parallel}) or set "
                "parallel.dp to \"auto\"")
        return cls(world_size=world_size, dp=dp, sp=cfg.sp, pp=cfg.pp)

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def coords(self, rank: int) -> RankCoords:
        sp_rank = rank % self.sp
        dp_rank = (rank // self.sp) % self.dp
        return RankCoords(pp_stage=rank // (self.sp * self.dp), dp_rank=dp_rank, sp_rank=sp_rank)

    def rank_of(self, c: RankCoords) -> int:
        return (c.pp_stage * self.dp + c.dp_rank) * self.sp + c.sp_rank

    def dp_group_ranks(self) -> list[list[int]]:
        """Ranks that hold different data and the same model shard: one list per (pp, sp)."""
        return [[self.rank_of(RankCoords(p, d, s)) for d in range(self.dp)]
                for p in range(self.pp) for s in range(self.sp)]

    def sp_group_ranks(self) -> list[list[int]]:
        """Ranks that split one sequence: one list per (pp, dp)."""
        return [[self.rank_of(RankCoords(p, d, s)) for s in range(self.sp)]
                for p in range(self.pp) for d in range(self.dp)]

    def reorder_group_ranks(self, group_size: int) -> list[list[int]]:
        """Ranks whose loaders share sample metadata: G consecutive ranks of each dp group.

        Consecutive dp ranks are near each other (one node), so the metadata exchange stays cheap.
        """
        if group_size < 1 or self.dp % group_size:
            raise ValueError(f"a reorder group of {group_size} ranks does not divide the "
                             f"data-parallel size {self.dp}")
        return [dp_ranks[start:start + group_size] for dp_ranks in self.dp_group_ranks()
                for start in range(0, self.dp, group_size)]

    def layout(self, reorder_group_size: int = 1) -> dict:
        """Every rank's (pp, dp, sp) coordinates and the groups it belongs to, as plain data.

        What `ds-omni plan` prints, so a layout can be checked before any process is launched.
        """
        ranks = [{"rank": r, "pp": c.pp_stage, "dp": c.dp_rank, "sp": c.sp_rank}
                 for r, c in enumerate(map(self.coords, range(self.world_size)))]
        return {"ranks": ranks, "sp_groups": self.sp_group_ranks(),
                "dp_groups": self.dp_group_ranks(), "reorder_group_size": reorder_group_size,
                "reorder_groups": self.reorder_group_ranks(reorder_group_size)}
