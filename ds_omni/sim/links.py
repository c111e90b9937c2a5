"""Collectives over a cluster's two link levels, as NCCL runs them on nodes of NVLink joined by a
network: a group with several ranks on each node reduces inside the node first (NVLink), then
each rank carries its 1/k share across nodes on its own share of the node's network adapters,
then gathers inside the node again. Every GPU of a node communicating across nodes at once
(data-parallel groups, pipeline sends of all TP ranks) shares the node's adapters: a GPU gets
`Cluster.inter_bw` (the node's bandwidth / GPUs per node). Alpha-beta rings as `comm`.
"""

from __future__ import annotations

from ds_omni.sim import comm
from ds_omni.sim.cluster import Cluster


def intra(cluster: Cluster) -> comm.Link:
    return comm.Link(cluster.intra_latency, cluster.intra_bw)


def inter(cluster: Cluster) -> comm.Link:
    return comm.Link(cluster.inter_latency, cluster.inter_bw)


def split(group: int, per_node: int) -> tuple[int, int]:
    """(ranks of the group on one node, nodes it spans) for a group of `group` ranks placed
    `per_node` to a node."""
    local = max(1, min(group, per_node))
    return local, -(-group // local)


def all_reduce(cluster: Cluster, nbytes: float, group: int, per_node: int) -> float:
    """Hierarchical all-reduce of `nbytes` over `group` ranks, `per_node` of them a node."""
    local, nodes = split(group, per_node)
    t = comm.reduce_scatter(nbytes, local, intra(cluster)) * 2  # and the all-gather back
    return t + comm.all_reduce(nbytes / local, nodes, inter(cluster))


def reduce_scatter(cluster: Cluster, nbytes: float, group: int, per_node: int) -> float:
    """Hierarchical reduce-scatter (an all-gather costs the same, the other way)."""
    local, nodes = split(group, per_node)
    return comm.reduce_scatter(nbytes, local, intra(cluster)) + \
        comm.reduce_scatter(nbytes / local, nodes, inter(cluster))


def p2p(cluster: Cluster, nbytes: float, crosses_nodes: bool) -> float:
    return comm.p2p(nbytes, inter(cluster) if crosses_nodes else intra(cluster))
