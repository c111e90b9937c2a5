"""The encoders' split over the TP ranks of a row (parallel.tp), tier 1: the pure plan for every
TP rank, checked by simulating its all-gather in one process (ranks are a loop), and each TP
rank's share `tp_share` cuts from a packed row.

The oracle never reads the plan's internals: each rank's output rows are built the way
`TPEncoders.embed` builds them (its items' embeddings in `plan.order`, then text order), every row
carries its own token position as its value, and after the simulated gather the row must hold,
at every placeholder, exactly that placeholder's position, on every TP rank.

Dims: T row length, N rows of the row, N_r rows TP rank r encodes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_omni.data.packing import pack, tp_share
from ds_omni.parallel.reshard import item_slots
from ds_omni.parallel.tp_encode import assign_tp_items, first_rank, plan_tp_encode
from tests.unit.parallel.test_reshard import PLACEHOLDER, _cost, llava, qwen2_vl, random_row  # noqa: F401


def simulate_gather(slots, plans) -> torch.Tensor:
    """The gathered rows [N] every TP rank receives: rank by rank, each rank's rows built from
    its own items (in `plan.order`, text order) with each row's value its token position."""
    by_key = {(s.encoder, s.index): s.positions for s in slots}
    parts = []
    for p in plans:
        rows = [by_key[(enc, k)] for enc in p.order for k in p.encode.get(enc, [])]
        assert sum(map(len, rows)) == p.rank_rows[p.rank] == sum(p.encode_rows.values())
        parts.append(np.concatenate(rows) if rows else np.zeros(0, np.int64))
    return torch.as_tensor(np.concatenate(parts))


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_every_placeholder_gets_its_own_row_on_every_rank(tp):
    rng = np.random.default_rng(tp)
    for _ in range(80):
        ids, sizes, costs, order = random_row(rng, 1)
        slots = item_slots(ids, PLACEHOLDER, sizes, costs)
        plans = plan_tp_encode(slots, tp, order)
        # each item encoded by exactly one TP rank
        owned = sorted((e, k) for p in plans for e, idx in p.encode.items() for k in idx)
        assert owned == sorted((s.encoder, s.index) for s in slots)
        assert len({tuple(p.positions) for p in plans}) == 1  # one plan: every rank agrees
        assert len({tuple(p.rank_rows) for p in plans}) == 1
        gathered = simulate_gather(slots, plans)
        assert gathered.tolist() == plans[0].positions  # each row lands where it belongs
        row = torch.full((len(ids),), -1, dtype=torch.long)
        row.index_copy_(0, torch.as_tensor(plans[0].positions, dtype=torch.long), gathered)
        held = np.flatnonzero(np.isin(ids, list(PLACEHOLDER.values())))
        assert (row[held] == torch.as_tensor(held)).all()  # every placeholder its own row
        assert (row[np.setdiff1d(np.arange(len(ids)), held)] == -1).all()  # and nothing else


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_assignment_is_balanced_lpt(tp):
    """The busiest TP rank's modelled cost stays <= the mean + the costliest item; equal costs
    spread evenly; the same costs give the same owners (every rank computes them alone)."""
    rng = np.random.default_rng(10 + tp)
    for _ in range(300):
        costs = [float(c) for c in rng.integers(1, 400, size=int(rng.integers(0, 12)))]
        owner = assign_tp_items(costs, tp)
        assert owner == assign_tp_items(list(costs), tp)
        load = np.bincount(owner, weights=costs, minlength=tp) if costs else np.zeros(tp)
        if costs:
            assert load.max() <= sum(costs) / tp + max(costs) + 1e-9
    assert sorted(assign_tp_items([5.0] * (2 * tp), tp)) == sorted(list(range(tp)) * 2)
    # rows of one item: where ties start moves with the row, so the items spread over the ranks
    firsts = [first_rank([f"sample{i}"], tp) for i in range(40)]
    assert [assign_tp_items([3.0], tp, f) for f in firsts] == [[f] for f in firsts]
    assert sorted(set(firsts)) == list(range(tp))


def test_gather_backward_and_grad_sum_equal_one_process():
    """The gradient argument of `ds_omni.parallelize.tp_encoders`, in one process: TP ranks
    that each encode their items, gather, and see the whole (same) gradient at the embeddings,
    give the single-process encoder gradient when each takes its own rows' slice and the
    encoder gradients are summed over the ranks; a sum in the gather's backward would not."""
    torch.manual_seed(0)
    enc = torch.nn.Linear(3, 4)
    items = [torch.randn(n, 3) for n in (2, 5, 1, 4)]
    head = torch.randn(12, 4)  # a fixed "LLM": loss = sum(head * embeddings)
    (head * enc(torch.cat(items))).sum().backward()
    want = enc.weight.grad.clone()
    tp = 2
    owner = assign_tp_items([float(len(x) ** 2) for x in items], tp)
    starts = np.cumsum([0] + [len(x) for x in items])
    per_rank = []
    for r in range(tp):
        enc.weight.grad = None
        mine = [i for i in range(len(items)) if owner[i] == r]
        rows = enc(torch.cat([items[i] for i in mine]))  # [N_r, 4]
        where = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in mine])
        rows.backward(head[where])  # the whole gradient at the embeddings: this rank's slice
        per_rank.append(enc.weight.grad.clone())
    assert 0 < owner.count(0) < len(items)  # both ranks encode some
    assert torch.allclose(sum(per_rank), want, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(per_rank[0], want)  # one rank's part alone is not the gradient
    assert not torch.allclose(tp * sum(per_rank), want)  # a sum in the gather: tp x


@pytest.mark.slow  # the two tiny models' fixtures take ~20 s on a loaded machine
@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("model", ["llava", "qwen2_vl"])
def test_tp_share_collates_each_ranks_items(model, tp, request):
    """Every TP rank's share of a packed row holds the row whole, the inputs of its own items
    only (as the family's collate makes them), and together the ranks hold every item once."""
    family, processors, samples = request.getfixturevalue(model)
    whole = pack(samples, processors)
    shares = [tp_share(whole, processors, r, tp, _cost) for r in range(tp)]
    owned = []
    for m in shares:
        plan = m.route.tp_encode
        assert torch.equal(m.input_ids, whole.input_ids) and m.items is whole.items
        assert sorted(m.encoder_inputs) == sorted(plan.encode)
        for enc, idx in plan.encode.items():
            want = processors[enc].collate([whole.items[enc][k] for k in idx])
            assert all(torch.equal(m.encoder_inputs[enc][key], want[key]) for key in want)
            owned += [(enc, k) for k in idx]
    assert sorted(owned) == sorted((e, k) for e, its in whole.items.items()
                                   for k in range(len(its)))
    assert all(m.route.tp_encode.items for m in shares)  # 4 images: every rank some
    placeholders = torch.tensor([p.placeholder_id for p in processors.values()])
    held = torch.isin(whole.input_ids[0], placeholders).nonzero().flatten().tolist()
    assert sorted(shares[0].route.tp_encode.positions) == held


def test_encoder_stream_keeps_the_shared_stream_in_step():
    """TP ranks that draw different amounts inside their encoders (different items, dropout)
    leave the stream they share where the others leave it, and their encoder streams differ."""
    from ds_omni.parallelize.tp_encoders import _encoder_rng
    after, inside = [], []
    for tp_rank, draws in ((0, 3), (1, 1000)):
        torch.manual_seed(7)  # the stream the TP ranks of a row share
        with _encoder_rng(torch.device("cpu"), tp_rank):
            inside.append(torch.rand(draws)[:3])
        after.append(torch.rand(4))
    assert torch.equal(after[0], after[1])
    assert not torch.equal(inside[0], inside[1])
