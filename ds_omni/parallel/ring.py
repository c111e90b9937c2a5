"""The ring of parallel.cp: key/value blocks passed to the next rank, point to point.

`RingGroup` is one rank's place in its ring (the cp ranks that hold the same Ulysses rank of
every cp shard, `ParallelPlan.cp_group_ranks`). `RingPass` is the autograd-aware step: forward
sends a tensor to the next rank and receives the previous rank's (one `batch_isend_irecv`);
backward sends the gradient the other way. Every rank of the ring runs the same passes in the
same order, so the pairs always match (torch.distributed P2P; gloo on CPU, NCCL on GPUs).
`pass_on` starts one such step and returns it pending (the ring's own backward,
`ds_omni.model.ring_attention.RingAttention`, overlaps it with a block's kernel); a ring with a
`transport` (the rings simulated in one process by the tests) answers it without torch.distributed.
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
    transport: object = None  # (tensor, send_to, recv_from, tag) -> Pending, not torch.distributed

    @classmethod
    def of(cls, group, members: list[int], rank: int) -> "RingGroup":
        """The ring of global rank `rank` over `members` (global ranks, in ring order)."""
        i = members.index(rank)
        return cls(group=group, rank=i, size=len(members), members=members,
                   prev=members[(i - 1) % len(members)], next=members[(i + 1) % len(members)])


class Pending:
    """A started ring step: `wait()` gives the received tensor."""

    def __init__(self, out: torch.Tensor, requests=(), sent: torch.Tensor | None = None):
        self.out, self.requests, self.sent = out, list(requests), sent  # `sent` kept alive

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        self.requests, self.sent = [], None
        return self.out


def _start(tensor: torch.Tensor, send_to: int, recv_from: int, group, tag: int = 0) -> Pending:
    """Start sending `tensor` to `send_to` and receiving one like it from `recv_from` (global
    ranks); `tag` keeps two steps in flight to the same peer apart (gloo; NCCL keeps order)."""
    out, sent = torch.empty_like(tensor), tensor.contiguous()
    ops = [dist.P2POp(dist.isend, sent, send_to, group, tag),
           dist.P2POp(dist.irecv, out, recv_from, group, tag)]
    return Pending(out, dist.batch_isend_irecv(ops), sent)


def _exchange(tensor: torch.Tensor, send_to: int, recv_from: int, ring: RingGroup,
              tag: int = 0) -> Pending:
    """Start sending `tensor` to `send_to`, receiving from `recv_from` (global ranks of `ring`)."""
    if ring.transport is not None:
        return ring.transport(tensor, send_to, recv_from, tag)
    return _start(tensor, send_to, recv_from, ring.group, tag)


def pass_on(tensor: torch.Tensor, ring: RingGroup, tag: int = 0) -> Pending:
    """Start one ring step, not differentiated: `tensor` to the next rank, the previous rank's
    back (pending)."""
    return _exchange(tensor, ring.next, ring.prev, ring, tag)


class RingPass(torch.autograd.Function):
    """tensor on this rank -> the previous rank's tensor; gradients go back the other way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, ring: RingGroup) -> torch.Tensor:
        ctx.ring = ring
        return _exchange(tensor, ring.next, ring.prev, ring).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ring = ctx.ring
        return _exchange(grad, ring.prev, ring.next, ring).wait(), None
