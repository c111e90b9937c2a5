"""Collective times by the alpha-beta model: n bytes over a link cost alpha + n / beta.

A group on one node uses the intra-node link; one that spans nodes is held to the inter-node link.
Rings (p ranks, n bytes): all-reduce 2 (p - 1) alpha + 2 (p - 1) / p * n / beta; reduce-scatter and
all-gather (p - 1) alpha + (p - 1) / p * n / beta (n: the whole buffer). Tree all-reduce:
2 ceil(log2 p) (alpha + n / beta), better for small messages. All-to-all with uneven splits
(`sends` [p, p]): a rank's intra- and inter-node traffic go over their links in parallel; it
finishes after alpha per peer plus its larger bytes over a link divided by that link's bandwidth,
and the collective ends with the slowest rank. p2p (pipeline sends): alpha + n / beta.
More: docs/simulator.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ds_omni.sim.cluster import Cluster


# DeepSpeed's `DistributedAttention` (Ulysses) sends q, k, v and the output by one all-to-all
# each: 4 calls a layer, each paying its latencies (on gloo ~0.7 ms a call: the latency, not the
# bytes, is most of a small model's Ulysses time)
ULYSSES_CALLS = 4


@dataclass(frozen=True)
class Link:
    latency: float
    bandwidth: float


def link_of(cluster: Cluster, ranks) -> Link:
    """The link a group of global `ranks` is held to: intra-node if they share one node."""
    # the simulator asks this about a million times in a 1,024-GPU search, mostly of the same
    # few groups: the answer is kept per group (by its ranks' bytes)
    return _link(cluster.gpus_per_node, cluster.hierarchical, cluster.intra_latency,
                 cluster.intra_bw, cluster.inter_latency, cluster.inter_bw,
                 np.asarray(ranks, dtype=np.int64).tobytes())


@functools.lru_cache(maxsize=1 << 16)
def _link(per_node: int, hierarchical: bool, intra_latency: float, intra_bw: float,
          inter_latency: float, inter_bw: float, ranks: bytes) -> Link:
    """`link_of` by the cluster's link fields and the ranks' int64 bytes (a Link is frozen)."""
    if _one_node(per_node, ranks):
        return Link(intra_latency, intra_bw)
    share = _per_node(per_node, ranks) if hierarchical else 1
    return Link(inter_latency, min(intra_bw, share * inter_bw))


@functools.lru_cache(maxsize=1 << 16)
def _per_node(gpus_per_node: int, ranks: bytes) -> int:
    """The most ranks (int64 bytes) of the group on one node."""
    r = np.frombuffer(ranks, dtype=np.int64) // gpus_per_node
    return int(np.unique(r, return_counts=True)[1].max())


@functools.lru_cache(maxsize=1 << 16)
def _one_node(gpus_per_node: int, ranks: bytes) -> bool:
    """Whether the ranks (int64 bytes) share one node (`Cluster.node_of`: rank // per node)."""
    r = np.frombuffer(ranks, dtype=np.int64)
    return r.size <= 1 or int(r.min()) // gpus_per_node == int(r.max()) // gpus_per_node


def ring_all_reduce(nbytes: float, p: int, link: Link) -> float:
    if p < 2 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * nbytes / link.bandwidth


def links_each(cluster: Cluster, groups: np.ndarray) -> Link:
    """`link_of` of every row of `groups` [G, p] at once: a Link of [G] latencies and
    bandwidths (the 1,024-GPU search asks it of ~10^6 groups)."""
    g = np.asarray(groups, dtype=np.int64)
    one = g.min(axis=1) // cluster.gpus_per_node == g.max(axis=1) // cluster.gpus_per_node
    inter = np.full(len(g), cluster.inter_bw)
    if cluster.hierarchical and g.size:  # ranks a node over the nodes a group spans (even)
        nodes = np.sort(g // cluster.gpus_per_node, axis=1)
        spans = 1 + (np.diff(nodes, axis=1) != 0).sum(axis=1)
        inter = np.minimum(cluster.intra_bw, g.shape[1] // spans * cluster.inter_bw)
    return Link(np.where(one, cluster.intra_latency, cluster.inter_latency),
                np.where(one, cluster.intra_bw, inter))


def all_reduce_each(nbytes: np.ndarray, p: int, link: Link) -> np.ndarray:
    """`all_reduce` of every element of `nbytes` (the same arithmetic, in array operations)."""
    n = np.asarray(nbytes, dtype=np.float64)
    if p < 2:
        return np.zeros_like(n)
    ring = 2 * (p - 1) * link.latency + 2 * (p - 1) / p * n / link.bandwidth
    tree = 2 * math.ceil(math.log2(p)) * (link.latency + n / link.bandwidth)
    return np.where(n > 0, np.minimum(ring, tree), 0.0)


def even_all_to_all_each(bytes_per_rank: np.ndarray, p: int, link: Link,
                         calls: int = 1, call_s: float = 0.0) -> np.ndarray:
    """`even_all_to_all` of every element of `bytes_per_rank`."""
    n = np.asarray(bytes_per_rank, dtype=np.float64)
    if p < 2:
        return np.zeros_like(n)
    return np.where(n > 0, (p - 1) * (calls * link.latency + n / p / link.bandwidth)
                    + calls * call_s, 0.0)


def reduce_scatter(nbytes: float, p: int, link: Link) -> float:
    if p < 2 or nbytes <= 0:
        return 0.0
    return (p - 1) * link.latency + (p - 1) / p * nbytes / link.bandwidth


def all_gather(nbytes: float, p: int, link: Link) -> float:
    return reduce_scatter(nbytes, p, link)  # the same ring, the other way


def tree_all_reduce(nbytes: float, p: int, link: Link) -> float:
    if p < 2 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * (link.latency + nbytes / link.bandwidth)


def all_reduce(nbytes: float, p: int, link: Link) -> float:
    """The faster of ring and tree (NCCL picks by size the same way)."""
    return min(ring_all_reduce(nbytes, p, link), tree_all_reduce(nbytes, p, link))


def p2p(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth if nbytes > 0 else 0.0


def p2p_each(nbytes: np.ndarray, link: Link) -> np.ndarray:
    """`p2p` of every element of `nbytes` (the same arithmetic, in one array operation)."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    return np.where(nbytes > 0, link.latency + nbytes / link.bandwidth, 0.0)


def all_to_all_ranks(sends: np.ndarray, ranks, cluster: Cluster) -> np.ndarray:
    """[p] seconds each rank of the group (global `ranks` [p]) spends in an all-to-all whose
    rank i sends `sends[i, j]` bytes to rank j (uneven splits; the diagonal is a local copy)."""
    sends = np.asarray(sends, dtype=np.float64)
    ranks = np.asarray(ranks, dtype=np.int64)
    src, dst = np.nonzero(sends)
    times = all_to_all_pairs(ranks[src], ranks[dst], sends[src, dst], cluster)
    return times[ranks]


def all_to_all_pairs(src, dst, nbytes, cluster: Cluster) -> np.ndarray:
    """[gpus] seconds each rank of the cluster spends in an all-to-all given as messages
    (src [K], dst [K], nbytes [K]; several messages of one pair add up). Ranks that send and
    receive nothing spend 0."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    keep = (src != dst) & (nbytes > 0)  # a rank's rows to itself are a local copy
    src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
    w = cluster.gpus
    inter = (src // cluster.gpus_per_node) != (dst // cluster.gpus_per_node)  # [K]
    out = np.zeros((2, w))  # [intra / inter, W] bytes out of each rank
    inn = np.zeros((2, w))
    np.add.at(out, (inter.astype(np.int64), src), nbytes)
    np.add.at(inn, (inter.astype(np.int64), dst), nbytes)
    pairs = np.unique(np.concatenate([np.stack([src, dst], 1), np.stack([dst, src], 1)]), axis=0)
    peers = np.bincount(pairs[:, 0], minlength=w) if pairs.size else np.zeros(w)
    crosses = np.zeros(w, dtype=bool)
    crosses[src[inter]] = True
    crosses[dst[inter]] = True
    latency = np.where(crosses, cluster.inter_latency, cluster.intra_latency)
    wire = np.maximum(np.maximum(out[0], inn[0]) / cluster.intra_bw,
                      np.maximum(out[1], inn[1]) / cluster.inter_bw)  # [W]
    return peers * latency + wire


def all_to_all(sends: np.ndarray, ranks, cluster: Cluster) -> float:
    """Seconds of the whole all-to-all: its slowest rank (`all_to_all_ranks`)."""
    times = all_to_all_ranks(sends, ranks, cluster)
    return float(times.max()) if times.size else 0.0


def even_all_to_all(bytes_per_rank: float, p: int, link: Link, calls: int = 1,
                    call_s: float = 0.0) -> float:
    """An all-to-all in which every rank sends `bytes_per_rank` in all, split evenly over the
    p ranks (Ulysses' head/sequence swap): (p - 1) messages of bytes_per_rank / p. `calls`:
    the bytes go in that many all-to-alls (each its own (p - 1) latencies); `call_s`: a
    rank's own seconds a call beyond the wire (`Cluster.a2a_call_s`)."""
    if p < 2 or bytes_per_rank <= 0:
        return 0.0
    return (p - 1) * (calls * link.latency + bytes_per_rank / p / link.bandwidth) \
        + calls * call_s
