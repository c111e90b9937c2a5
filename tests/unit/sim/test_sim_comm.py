"""The simulator's collective formulas against hand-computed values on small clusters (2 ranks on
one node, 2 nodes), its cluster checks, and its ZeRO memory arithmetic.

Planted error "a2a_even_splits" (tests/plants/sim.py): an all-to-all priced as if its messages were
even must fail the uneven-split check.
"""

import math

import numpy as np
import pytest

from ds_omni.errors import ConfigError
from ds_omni.sim import comm, memory
from ds_omni.sim.cluster import Cluster, cluster
from tests import plants

# round numbers: intra 1 GB/s and 1 ms, inter 0.1 GB/s and 10 ms; nodes of 2 GPUs
C = Cluster(gpus=4, gpus_per_node=2, flops=1e12, hbm_bytes=1e10, intra_bw=1e9,
            intra_latency=1e-3, inter_bw=1e8, inter_latency=1e-2)
INTRA, INTER = comm.link_of(C, [0, 1]), comm.link_of(C, [0, 2])


def test_links_follow_the_rank_layout():
    assert (INTRA.latency, INTRA.bandwidth) == (1e-3, 1e9)
    assert (INTER.latency, INTER.bandwidth) == (1e-2, 1e8)
    assert comm.link_of(C, [2, 3]) == INTRA  # the second node's pair is inside a node too


def test_ring_collectives_by_hand():
    # 2 ranks, 1e8 bytes: 2 (p-1) alpha + 2 (p-1)/p n / beta
    assert comm.ring_all_reduce(1e8, 2, INTRA) == pytest.approx(2e-3 + 0.1)
    assert comm.ring_all_reduce(1e8, 2, INTER) == pytest.approx(2e-2 + 1.0)
    # 4 ranks over 2 nodes, 4e8 bytes: (p-1) alpha + (p-1)/p n / beta
    assert comm.reduce_scatter(4e8, 4, INTER) == pytest.approx(3e-2 + 3.0)
    assert comm.all_gather(4e8, 4, INTER) == pytest.approx(3e-2 + 3.0)
    assert comm.tree_all_reduce(1e6, 4, INTER) == pytest.approx(2 * 2 * (1e-2 + 1e-2))
    assert comm.all_reduce(1e3, 4, INTER) == comm.tree_all_reduce(1e3, 4, INTER)  # small: tree
    assert comm.p2p(1e8, INTER) == pytest.approx(1e-2 + 1.0)
    assert comm.ring_all_reduce(1e8, 1, INTRA) == 0.0


def check_uneven_all_to_all() -> None:
    """Rank 0 sends 3e8 bytes to rank 1, rank 1 sends 1e8 back (one node): rank 0's 3e8 out and
    rank 1's 3e8 in bound the exchange at 1 ms + 0.3 s; an even split of the same total takes
    1 ms + 0.2 s."""
    times = comm.all_to_all_ranks(np.array([[0, 3e8], [1e8, 0]]), [0, 1], C)
    assert times == pytest.approx([1e-3 + 0.3, 1e-3 + 0.3])
    assert comm.even_all_to_all(2e8, 2, INTRA) == pytest.approx(1e-3 + 0.1)


def test_uneven_all_to_all_by_hand():
    check_uneven_all_to_all()
    # 3 ranks, rank 2 on the other node: rank 0 sends 1e8 inside its node and 1e7 across; the
    # two links run at once: max(0.1 s, 0.1 s), and two messages at the inter-node latency
    sends = np.array([[0, 1e8, 1e7], [0, 0, 0], [0, 0, 0]])
    t = comm.all_to_all_ranks(sends, [0, 1, 2], C)
    assert t[0] == pytest.approx(2 * 1e-2 + 0.1)
    assert t[1] == pytest.approx(1e-3 + 0.1)
    assert t[2] == pytest.approx(1e-2 + 0.1)
    assert comm.all_to_all(np.zeros((2, 2)), [0, 1], C) == 0.0


@pytest.mark.parametrize("plant", plants.for_launch("sim"))
def test_plant_sim(plant):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_uneven_all_to_all()


def test_cluster_errors_teach():
    with pytest.raises(ConfigError, match="gpus_per_node=8 is more than the cluster's gpus=4"):
        cluster("h100", 4, 8)
    with pytest.raises(ConfigError, match="not a whole number of nodes"):
        cluster("h100", 12, 8)
    with pytest.raises(ConfigError, match="unknown GPU preset 'tpu'"):
        cluster("tpu", 8)
    assert cluster("h200", 16).hbm_bytes > cluster("h100", 16).hbm_bytes
    assert cluster("h100", 16).nodes == 2


def test_zero3_states_are_zero0_states_over_dp():
    z0 = memory.model_states(7e9, 7e9, 8, 0)
    z3 = memory.model_states(7e9, 7e9, 8, 3)
    assert z0.total == pytest.approx(16 * 7e9)  # 2 + 2 + 12 bytes a parameter
    assert z3.total == pytest.approx(z0.total / 8)
    for kind in ("params", "grads", "optimizer"):
        assert getattr(z3, kind) == pytest.approx(getattr(z0, kind) / 8)
    z1, z2 = memory.model_states(7e9, 7e9, 8, 1), memory.model_states(7e9, 7e9, 8, 2)
    assert (z1.params, z1.grads, z1.optimizer) == (z0.params, z0.grads, z0.optimizer / 8)
    assert (z2.params, z2.grads) == (z0.params, z0.grads / 8)
    frozen = memory.model_states(7e9, 0, 8, 0)
    assert frozen.total == 2 * 7e9 and not math.isnan(frozen.total)
    with pytest.raises(ConfigError, match="ZeRO stage must be 0, 1, 2 or 3"):
        memory.model_states(1, 1, 1, 4)


def test_ulysses_pays_a_latency_per_all_to_all_call():
    """DeepSpeed's `DistributedAttention` sends q, k, v and the output by one all-to-all each
    (4 calls a layer; backward 4 more): at a link of 1 ms and no bytes' worth of time, a
    2-rank SP step of one micro-batch spends layers x 2 x 4 latencies in Ulysses (it was
    charged one call a layer, 4x short, while gloo's ~0.7 ms a call is most of it on CPU)."""
    from ds_omni.data.cost import ModelDims
    from ds_omni.sim.model_spec import ModelSpec
    from ds_omni.sim.plan_spec import SimPlan
    from ds_omni.sim.step import simulate
    from ds_omni.sim.workload import Samples
    assert comm.ULYSSES_CALLS == 4
    assert comm.even_all_to_all(2e8, 2, INTRA, calls=4) == pytest.approx(4e-3 + 0.1)
    assert comm.even_all_to_all_each(np.array([2e8, 0.0]), 2, INTRA, calls=4) == pytest.approx(
        [4e-3 + 0.1, 0.0])
    m = ModelSpec.from_dims(ModelDims(hidden=64, layers=3, intermediate=128, vocab=100))
    empty = np.zeros(0, dtype=np.int64)
    samples = Samples(np.array([256]), empty, np.array([], dtype=str), empty, empty)
    plan = SimPlan(sp=2, zero_stage=1, global_batch=1, micro_batches=1, pack_tokens=256,
                   checkpointing=False)  # no recomputed forward's 4 calls more
    fast = cluster("cpu", 2, 2, intra_latency=1e-3, intra_bw=1e15)  # bytes cost ~nothing
    phases = simulate(fast, m, samples, plan).summary()["critical_path"]["by_phase"]
    assert phases["llm_sp"] == pytest.approx(3 * 2 * 4 * 1e-3, rel=1e-6)
