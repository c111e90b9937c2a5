"""Long-short SP for encoders, checked encoder by encoder: a long item encoded by a group of ranks
(each rank its piece, Ulysses attention inside the tower) yields the same embedding rows and the
same parameter gradients as the item encoded whole by one process.

`check_pieces` runs on every rank of a launch (tests/dist/test_sequence_parallel.py starts it);
the reference is the same module encoding the whole item with its ordinary attention, in the same
process, from a copy of the weights, so no part of the split path takes part in it.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ds_omni.parallel.long_short import split_rows


def item_inputs(built, processor: str, raw) -> dict[str, torch.Tensor]:
    """Encoder inputs of one raw item, collated as a micro-batch of one."""
    items = built.item_processors[processor]
    return items.collate([items.process(raw)])


def check_pieces(built, encoder: str, raw, group=None, checkpointed: bool = False,
                 frozen: bool = False, processor: str | None = None) -> dict:
    """Encode `raw` split over `group` (all ranks: the default) and whole; return the largest
    differences of rows and gradients (the caller asserts on them) and the row counts.
    `checkpointed`: the tower's layers recompute in backward; `frozen`: the tower is frozen (only
    the projector has gradients, and the split tower's backward exchanges nothing); `processor`:
    the item processor that makes the item (default: the encoder's name; "video" for a video)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    module = built.model.encoders[encoder]
    module.zero_grad(set_to_none=True)
    module.tower.requires_grad_(not frozen)
    inputs = item_inputs(built, processor or encoder, raw)
    whole_module = copy.deepcopy(module)
    whole = whole_module(inputs)  # [n, D]
    weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(7))
    (whole * weights).sum().backward()

    if checkpointed:
        from ds_omni.model.recompute import recompute_in_backward
        recompute_in_backward(module.tower)
    bounds = tuple(split_rows(whole.shape[0], size))
    piece = module.forward_piece(inputs, bounds, group, rank)  # [rows_r, D]
    (piece * weights[bounds[rank]:bounds[rank + 1]]).sum().backward()
    # every rank's rows, in order (gloo gathers equal sizes: pad each piece to the longest)
    longest = max(bounds[r + 1] - bounds[r] for r in range(size))
    padded = torch.zeros(longest, whole.shape[1])
    padded[:piece.shape[0]] = piece.detach()
    gathered = [torch.zeros_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    rows = torch.cat([g[:bounds[r + 1] - bounds[r]] for r, g in enumerate(gathered)])
    grad_diff, grad_scale = 0.0, 0.0
    for p, q in zip(module.parameters(), whole_module.parameters()):
        if q.grad is None:
            continue
        g = p.grad.clone()
        dist.all_reduce(g, group=group)  # each rank holds its piece's share of the gradient
        grad_diff = max(grad_diff, float((g - q.grad).abs().max()))
        grad_scale = max(grad_scale, float(q.grad.abs().max()))
    return {"rows": whole.shape[0], "piece_rows": piece.shape[0],
            "row_diff": float((rows - whole.detach()).abs().max()),
            "row_scale": float(whole.detach().abs().max()), "grad_diff": grad_diff,
            "grad_scale": grad_scale}
