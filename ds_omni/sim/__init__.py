"""The step simulator: one training step of a plan on a described cluster, priced by the same
planners training runs (loader reordering, per-sequence SP blocks, the encoder pool, long-short
routing, resharding, pipeline stages and encoder placement) on simulated ranks.

    from ds_omni.sim import simulate, Cluster, ModelSpec, WorkloadSpec, SimPlan
"""

from ds_omni.sim.cluster import Cluster, cluster
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.step import SimPlan, StepReport, simulate
from ds_omni.sim.workload import WorkloadSpec

__all__ = ["Cluster", "cluster", "ModelSpec", "SimPlan", "StepReport", "WorkloadSpec", "simulate"]
