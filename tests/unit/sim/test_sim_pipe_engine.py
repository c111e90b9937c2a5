"""The pipeline engine's own costs in the simulated schedule (`Cluster.pipe_pass_s`,
`Cluster.p2p_byte_s`, fitted on CPU from the validation's pipeline runs): each pass of a stage
pays one pass and the bytes it receives and sends, by hand on three stages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ds_omni.sim.cluster import cluster
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import simulate
from tests import plants
from tests.unit.sim.test_sim_step import llava_7b, text_samples

PLAN = SimPlan(pp=3, global_batch=8, micro_batches=4, pack_tokens=8192)


def _paid_by_pipeline_engine() -> bool:
    """Three stages, 4 micro-batches of two 4,096-token rows: each rank's compute grows by
    2 x 4 passes x `pipe_pass_s`, and by its bytes x `p2p_byte_s`: a micro-batch's activations
    (8,192 tokens x hidden x 2 bytes) once a pass on the end stages (received or sent), twice
    on the middle one (received and sent)."""
    m, samples, base = llava_7b(), text_samples([4096] * 8), cluster("h100", 3, 3)
    plain = np.asarray(simulate(base, m, samples, PLAN).compute)
    passes = np.asarray(simulate(dataclasses.replace(base, pipe_pass_s=1e-3), m, samples,
                                 PLAN).compute)
    nbytes = np.asarray(simulate(dataclasses.replace(base, p2p_byte_s=1e-12), m, samples,
                                 PLAN).compute)
    act = 8192 * m.dims.hidden * 2
    return (passes - plain == pytest.approx([8 * 1e-3] * 3, rel=1e-9)
            and np.sort(nbytes - plain) == pytest.approx(
                [8 * act * 1e-12] * 2 + [16 * act * 1e-12], rel=1e-9))


def test_each_pipeline_pass_pays_the_engine_and_its_bytes():
    assert _paid_by_pipeline_engine()


@pytest.mark.parametrize("plant", plants.for_launch("sim_pipe_engine"))
def test_plant_sim_pipe_engine(plant):
    with plants.applied(plant, 0):
        assert not _paid_by_pipeline_engine(), f"plant {plant} went unseen"
