"""The ring of parallel.cp: key/value blocks passed to the next rank, point to point.

`RingGroup` is one rank's place in its ring (the cp ranks that hold the same Ulysses rank of
every cp shard, `ParallelPlan.cp_group_ranks`). `RingPass` is the autograd-aware step: forward
sends a tensor to the next rank and receives the previous rank's (one `batch_isend_irecv`);
backward sends the gradient the other way. Every rank of the ring runs the same passes in the
same order, so the pairs always match (torch.distributed P2P; gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class RingGroup:
    """One rank's ring: its group, its place `rank` of `size`, and the global ranks of the
    ranks before and after it."""

    group: object
    rank: int
    size: int
    prev: int
    next: int
    members: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, group, members: list[int], rank: int) -> "RingGroup":
        """The ring of global rank `rank` over `members` (global ranks, in ring order)."""
        i = members.index(rank)
        return cls(group=group, rank=i, size=len(members), members=members,
                   prev=members[(i - 1) % len(members)], next=members[(i + 1) % len(members)])


def _exchange(tensor: torch.Tensor, send_to: int, recv_from: int, group) -> torch.Tensor:
    """Send `tensor` to `send_to` and receive one like it from `recv_from` (global ranks)."""
    out = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), send_to, group),
           dist.P2POp(dist.irecv, out, recv_from, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


class RingPass(torch.autograd.Function):
    """tensor on this rank -> the previous rank's tensor; gradients go back the other way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, ring: RingGroup) -> torch.Tensor:
        ctx.ring = ring
        return _exchange(tensor, ring.next, ring.prev, ring.group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ring = ctx.ring
        return _exchange(grad, ring.prev, ring.next, ring.group), None
