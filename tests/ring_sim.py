"""Ring attention's cp ranks simulated in one process: one thread a rank, their ring steps
answered through in-process queues (`LocalRing`, a `RingGroup.transport`), so the ring's own
backward (`RingAttention`: key/value blocks and their gradient accumulators going around again)
runs as on real ranks. `simulate` gives the whole row's output and q/k/v gradients. On CUDA,
autograd runs every rank's backward on its one device thread, where the first rank to wait for a
step would block the others: there `simulate` calls `RingAttention`'s forward and backward itself
(`direct`), in each rank's thread."""

from __future__ import annotations

import queue
import threading
from collections import defaultdict

import torch

from ds_omni.model import ring_attention as ra
from ds_omni.parallel.ring import RingGroup

TIMEOUT_S = 30  # a rank waiting longer: the ranks' steps no longer match (a bug, not slowness)


class _Received:
    def __init__(self, box: queue.Queue):
        self.box = box

    def wait(self) -> torch.Tensor:
        return self.box.get(timeout=TIMEOUT_S)


class LocalRing:
    """First-in first-out boxes per (sender, receiver, tag), as torch.distributed's P2P."""

    def __init__(self):
        self.lock = threading.Lock()
        self.boxes: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes[src, dst, tag]

    def group(self, rank: int, cp: int) -> RingGroup:
        def transport(tensor, send_to, recv_from, tag):
            self.box(rank, send_to, tag).put(tensor.detach().clone())
            return _Received(self.box(recv_from, rank, tag))
        return RingGroup(group=None, rank=rank, size=cp, prev=(rank - 1) % cp,
                         next=(rank + 1) % cp, members=list(range(cp)), transport=transport)


class _Ctx:
    """What `RingAttention` keeps between its forward and backward, called directly."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _direct(q, k, v, index, ring, cu, dout, window=None, blocks=None, kernel=None):
    """`RingAttention`'s forward and backward called in this thread (no autograd engine)."""
    spec = ra.ring_spec(q, index, ring, cu, None, window, blocks, kernel=kernel)
    ctx = _Ctx()
    with torch.no_grad():
        out = ra.RingAttention.forward(ctx, q[0], k[0], v[0], spec)
        grads = ra.RingAttention.backward(ctx, dout[0].to(out.dtype))[:3]
    return out.unsqueeze(0), [g.unsqueeze(0) for g in grads]


def simulate(q, k, v, index, cu, weights, direct=None, **kwargs):
    """Each cp rank (row `index[rank]` of row positions) runs `ring_attention` on its tokens of
    q [1, T, h, D], k/v [1, T, hkv, D] and backward from (out x weights).sum(), in its own
    thread -> (out [1, T, h, D], (dq, dk, dv)) over the whole row, in row order. `direct`
    (default: on CUDA): `_direct` in place of autograd."""
    cp, local = len(index), LocalRing()
    results, errors = [None] * cp, []
    direct = q.is_cuda if direct is None else direct

    def rank_main(rank):
        try:
            mine, ring = index[rank], local.group(rank, cp)
            parts = [t.detach()[:, mine].clone().requires_grad_() for t in (q, k, v)]
            if direct:
                results[rank] = _direct(*parts, index, ring, cu, weights[:, mine], **kwargs)
                return
            out = ra.ring_attention(*parts, index, ring, cu, None, **kwargs)
            (out * weights[:, mine]).sum().backward()
            results[rank] = (out.detach(), [p.grad for p in parts])
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            errors.append(error)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(cp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    out = torch.empty_like(q.detach())
    grads = [torch.empty_like(t.detach()) for t in (q, k, v)]
    for rank, (got, parts) in enumerate(results):
        out[:, index[rank]] = got
        for grad, part in zip(grads, parts):
            grad[:, index[rank]] = part
    return out, tuple(grads)
