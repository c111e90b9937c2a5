"""Adaptive resharding, tier 1: the plan for every SP rank, checked by simulating its all-to-all in
one process (ranks are a loop), and the SP shards `pack` cuts from a packed row.

The oracle for the exchange never reads the plan's internals: each rank's output rows are built the
way `EmbeddingRouter.embed_shard` builds them (its items' embeddings in `plan.order`, then text order),
every row carries its own global token position as its value, and after the simulated exchange a
shard must hold, at every placeholder, exactly that placeholder's position.

Dims: T padded row length, S = T / sp, N_r rows rank r encodes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from ds_omni.batch import IGNORE_INDEX
from ds_omni.data.packing import SeqShard, empty_micro_batch, pack
from ds_omni.parallel.long_short import LongItems, is_long, split_rows
from ds_omni.parallel.row_cut import RowCut
from ds_omni.parallel.reshard import BALANCE_SLACK, ItemSlots, assign_items, bytes_moved, item_slots, plan_reshard

PLACEHOLDER = {"vision": 7, "audio": 9}
TEXT, PAD = 1, 0


# --------------------------------------------------------------------------------- helpers
def random_row(rng: np.random.Generator, sp: int):
    """(input_ids [T], item sizes, item costs, encoder order): text runs and items at random.

    Costs are n^2 of an item's n embeddings, so equal sizes tie; some rows get no item at all.
    """
    ids, sizes, costs = [], {}, {}
    for _ in range(int(rng.integers(0, 9))):
        ids += [TEXT] * int(rng.integers(0, 12))
        enc = ("vision", "audio")[int(rng.integers(2))]
        n = int(rng.integers(1, 20))
        ids += [PLACEHOLDER[enc]] * n
        sizes.setdefault(enc, []).append(n)
        costs.setdefault(enc, []).append(float(n * n))
    ids += [TEXT] * int(rng.integers(1, 6))
    ids += [PAD] * (-len(ids) % sp)
    order = [str(e) for e in rng.permutation(sorted(sizes))]  # the order packing met them in
    return np.array(ids), sizes, costs, order


def plans_of(ids, sizes, costs, order, sp, long_items=None):
    slots = item_slots(ids, PLACEHOLDER, sizes, costs)
    return slots, plan_reshard(slots, sp, len(ids) // sp, order, long_items)


def simulate_exchange(slots: list[ItemSlots], plans, shard_len: int) -> list[torch.Tensor]:
    """Each rank's shard [S] after one simulated all-to-all: a placeholder's slot holds the global
    position of the row that landed there, every other slot -1."""
    sp = len(plans)
    by_key = {(s.encoder, s.index): s.positions for s in slots}
    sent = []  # sent[src][dst]: rows rank src sends rank dst
    for p in plans:
        rows = []  # as the model concatenates them: per encoder, whole items, then its pieces
        for e in p.order:
            rows += [by_key[(e, k)] for k in p.encode.get(e, [])]
            rows += [by_key[(e, k)][bounds[p.rank]:bounds[p.rank + 1]] for k, bounds in p.split.get(e, [])]
        out = torch.as_tensor(np.concatenate(rows) if rows else np.zeros(0, np.int64))  # [N_r]
        assert sorted(p.send_order) == list(range(len(out)))  # a permutation of the rows
        send = out[torch.as_tensor(p.send_order, dtype=torch.long)]  # [N_r] grouped by destination
        sent.append(torch.split(send, p.send_counts))
    shards = []
    for dst, p in enumerate(plans):
        recv = torch.cat([sent[src][dst] for src in range(sp)])  # concatenated by source rank
        shard = torch.full((shard_len,), -1, dtype=torch.long)
        where = torch.as_tensor(p.recv_positions, dtype=torch.long)
        shards.append(shard.index_copy(0, where, recv))  # as OmniModel puts them into its shard
    return shards


def owners(plans) -> dict[tuple[str, int], int]:
    """(encoder, item index) -> the rank that encodes it; each item must appear once."""
    out = {}
    for p in plans:
        for enc, idx in p.encode.items():
            assert idx == sorted(idx), "a rank's items are collated in text order"
            for k in idx:
                assert (enc, k) not in out, f"{enc} item {k}: ranks {out[(enc, k)]} and {p.rank}"
                out[(enc, k)] = p.rank
    return out


# ----------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_every_placeholder_gets_its_row_once(sp):
    rng = np.random.default_rng(sp)
    for _ in range(60):
        ids, sizes, costs, order = random_row(rng, sp)
        slots, plans = plans_of(ids, sizes, costs, order, sp)
        s = len(ids) // sp
        for src, p in enumerate(plans):  # the split sizes the two sides of all_to_all_single give
            assert [q.recv_counts[src] for q in plans] == p.send_counts
        shards = simulate_exchange(slots, plans, s)
        expect = torch.as_tensor(np.where(np.isin(ids, list(PLACEHOLDER.values())),
                                          np.arange(len(ids)), -1))  # [T]
        assert torch.equal(torch.cat(shards), expect)
        for r, p in enumerate(plans):  # duplicates would have been overwritten above: count them
            assert p.rows_in == int((expect[r * s:(r + 1) * s] >= 0).sum())


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_every_item_is_encoded_by_one_rank(sp):
    rng = np.random.default_rng(100 + sp)
    for _ in range(60):
        ids, sizes, costs, order = random_row(rng, sp)
        _, plans = plans_of(ids, sizes, costs, order, sp)
        owner = owners(plans)
        assert sorted(owner) == sorted((e, k) for e, ns in sizes.items() for k in range(len(ns)))
        for p in plans:
            assert p.encode_rows == {e: sum(sizes[e][k] for k in idx)
                                     for e, idx in p.encode.items()}
            assert p.group_rows == sum(map(sum, sizes.values()))


def test_an_item_cut_by_shard_boundaries_goes_to_each_shard():
    ids = np.array([TEXT] * 5 + [PLACEHOLDER["vision"]] * 14 + [TEXT] * 5)  # 5..18 over S=8, sp=3
    slots, plans = plans_of(ids, {"vision": [14]}, {"vision": [1.0]}, ["vision"], 3)
    encoder = plans[owners(plans)[("vision", 0)]]
    assert encoder.rank == 1  # a tie in load: the rank holding most of it (8 of 14)
    assert encoder.send_counts == [3, 8, 3] and encoder.rows_moved() == 6
    assert [p.recv_positions for p in plans] == [[5, 6, 7], list(range(8)), [0, 1, 2]]
    assert torch.equal(torch.cat(simulate_exchange(slots, plans, 8))[5:19], torch.arange(5, 19))


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_a_row_without_items_exchanges_nothing(sp):
    ids = np.full(8, TEXT)
    slots = item_slots(ids, PLACEHOLDER, {"vision": []}, {"vision": []})
    plans = plan_reshard(slots, sp, 8 // sp, ["vision"])
    assert slots == []
    for p in plans:
        assert (p.encode, p.group_rows, p.rows_out, p.rows_in) == ({}, 0, 0, 0)
        assert p.send_counts == p.recv_counts == [0] * sp
    assert bytes_moved(plans, hidden=64, dtype_bytes=2) == {"reshard": 0, "all_gather": 0}


def test_ties_keep_each_item_on_the_rank_that_holds_it():
    """Three equal items wholly on shards 1, 2, 3 (shard 0 is text): each is encoded where it sits
    (not by rank 0 first, as plain LPT would), and nothing moves."""
    ids = np.array([TEXT] * 8 + ([TEXT] * 3 + [PLACEHOLDER["vision"]] * 5) * 3)  # T = 32, S = 8
    slots, plans = plans_of(ids, {"vision": [5] * 3}, {"vision": [25.0] * 3}, ["vision"], 4)
    assert [owners(plans)[("vision", k)] for k in range(3)] == [1, 2, 3]
    assert all(p.rows_moved() == 0 for p in plans)
    assert bytes_moved(plans, hidden=64, dtype_bytes=2)["reshard"] == 0


def test_balance_beats_locality():
    """Two items on shard 0, one costly: the cheap one is encoded by the idle rank and moves."""
    ids = np.array([PLACEHOLDER["vision"]] * 6 + [TEXT] * 10)  # S = 8: both items on shard 0
    slots, plans = plans_of(ids, {"vision": [4, 2]}, {"vision": [16.0, 4.0]}, ["vision"], 2)
    assert owners(plans) == {("vision", 0): 0, ("vision", 1): 1}
    assert plans[1].send_counts == [2, 0] and plans[1].rows_moved() == 2


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_lpt_bounds_the_busiest_encoder(sp):
    """Greedy onto a rank near the least loaded: max load <= mean + the costliest item + slack."""
    rng = np.random.default_rng(200 + sp)
    for _ in range(100):
        n = int(rng.integers(1, 30))
        costs = rng.pareto(1.5, n) + 0.01  # heavy-tailed, as image sizes are
        slots = [ItemSlots("vision", k, np.array([k]), float(c)) for k, c in enumerate(costs)]
        load = np.bincount(assign_items(slots, sp, shard_len=n), weights=costs, minlength=sp)
        mean = costs.sum() / sp
        assert load.max() <= mean * (1 + BALANCE_SLACK) + costs.max() + 1e-9


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_bytes_moved_counts_rows_off_their_encoder(sp):
    rng = np.random.default_rng(300 + sp)
    for _ in range(30):
        ids, sizes, costs, order = random_row(rng, sp)
        slots, plans = plans_of(ids, sizes, costs, order, sp)
        s, owner = len(ids) // sp, owners(plans)
        moved = sum(int((sl.positions // s != owner[(sl.encoder, sl.index)]).sum()) for sl in slots)
        rows = sum(len(sl.positions) for sl in slots)
        got = bytes_moved(plans, hidden=16, dtype_bytes=2)
        assert got == {"reshard": moved * 32, "all_gather": (sp - 1) * rows * 32}
        assert got["reshard"] <= got["all_gather"] or sp == 1


@pytest.mark.parametrize("sp", [2, 4])
def test_counts_of_rows_moved_are_the_rows_off_their_encoder(sp):
    """`SPCounts` (the metrics sp_rows_sent / sp_rows_received): over the group, the rows sent
    are the rows received, and both are the rows whose placeholder is off their encoding rank."""
    from ds_omni.parallel.evidence import SPCounts
    rng = np.random.default_rng(400 + sp)
    for _ in range(30):
        ids, sizes, costs, order = random_row(rng, sp)
        slots, plans = plans_of(ids, sizes, costs, order, sp)
        s, owner = len(ids) // sp, owners(plans)
        moved = sum(int((sl.positions // s != owner[(sl.encoder, sl.index)]).sum()) for sl in slots)
        counts = [SPCounts() for _ in plans]
        for c, plan in zip(counts, plans):
            c.resharded(plan)
        assert sum(c.rows_sent for c in counts) == sum(c.rows_received for c in counts) == moved
        assert counts[0].as_metrics()["sp_reshard_exchanges"] == 1


def test_placeholder_count_must_match_the_items():
    ids = np.array([PLACEHOLDER["vision"]] * 5 + [TEXT])
    with pytest.raises(ValueError, match=r"row has 5 placeholder tokens but its items yield 6"):
        item_slots(ids, PLACEHOLDER, {"vision": [3, 3]}, {"vision": [1.0, 1.0]})


# ------------------------------------------------------------------------- packing shards
def _cost(encoder: str, item) -> float:
    return float(sum(n * n for n in item.cost_seqs()))


@pytest.fixture(scope="module")
def llava():
    """(family, item processors, samples): the tiny composed LLaVA, one image sample per kind."""
    from ds_omni.config import ModelConfig, from_dict
    from ds_omni.model.build import build_model
    from tests.family_checks import processor_for
    from tests.fixtures import TINY_LLAMA, TINY_VISION
    built = build_model(from_dict(ModelConfig, {"tokenizer": "builtin:shapes",
                                                "vision": {"config": dict(TINY_VISION)},
                                                "llm": {"config": dict(TINY_LLAMA)}}))
    return built.family, built.item_processors, _samples(processor_for(built), [(32, 32)] * 3)


@pytest.fixture(scope="module")
def qwen2_vl():
    """(family, item processors, samples) of a tiny Qwen2-VL from its config alone (no weights):
    3-D M-RoPE positions and images of different sizes."""
    from transformers import Qwen2VLConfig
    from ds_omni.data.processing import SampleProcessor
    from ds_omni.model.families import family_for
    from tests.family_dirs import MERGE, PATCH, QWEN_TOKENS, qwen_tokenizer
    tok = qwen_tokenizer()
    ids = dict(zip(QWEN_TOKENS, tok.convert_tokens_to_ids(QWEN_TOKENS)))
    config = Qwen2VLConfig(
        vision_config={"depth": 1, "embed_dim": 32, "num_heads": 4, "hidden_size": 64,
                       "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2},
        text_config={"hidden_size": 64, "num_attention_heads": 4, "vocab_size": len(tok)},
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    family = family_for("qwen2_vl")
    processors = family.item_processors(config, None, tokenizer=tok)
    proc = SampleProcessor(tokenizer=tok, family=family, item_processors=processors,
                           markers={"vision": "<image>"}, max_seq_len=4096)
    return family, processors, _samples(proc, [(32, 32), (84, 56), (40, 24)])


def _samples(proc, sizes):
    """One image, plain text, two images, one image again (sizes: the three images' w x h)."""
    from PIL import Image
    from ds_omni.data.demo import shapes_rows
    rows = shapes_rows(3, seed=5)
    img = [Image.open(io.BytesIO(r["image"]["bytes"])).convert("RGB").resize(wh)
           for r, wh in zip(rows, sizes)]
    two = [{"from": "human", "value": "<image> or <image>?"}, {"from": "gpt", "value": "left"}]
    texts = [rows[0]["conversations"], "a plain text sample", two, rows[1]["conversations"]]
    media = [[img[0]], [], [img[1], img[2]], [img[2]]]
    return [proc(text=t, media={"vision": m} if m else {}, sample_id=sid, source="s")
            for t, m, sid in zip(texts, media, "abcd")]


def assert_shards_rebuild_the_row(samples, processors, sp: int) -> int:
    """The sp shards `pack` cuts are the unsharded row plus padding; returns the items cut."""
    whole = pack(samples, processors)
    t = whole.input_ids.shape[1]
    pad = -t % sp
    shards = [pack(samples, processors, SeqShard(r, sp, _cost)) for r in range(sp)]
    ids = torch.cat([m.input_ids for m in shards], dim=1)  # [1, T + pad]
    assert torch.equal(ids[:, :t], whole.input_ids)
    assert not set(ids[0, t:].tolist()) & {p.placeholder_id for p in processors.values()}
    targets = torch.cat([m.targets for m in shards], dim=1)
    assert torch.equal(targets[:, :t], whole.targets)
    assert bool((targets[:, t:] == IGNORE_INDEX).all())  # padding predicts nothing
    positions = torch.cat([m.position_ids for m in shards], dim=-1)  # [1, T+pad] / [3, 1, T+pad]
    assert torch.equal(positions[..., :t], whole.position_ids)
    assert torch.equal(positions[..., t:], torch.arange(pad).expand_as(positions[..., t:]))
    cu = whole.cu_seqlens.tolist() + ([t + pad] if pad else [])  # padding: one more sample
    s = (t + pad) // sp
    for r, m in enumerate(shards):
        assert m.cu_seqlens.tolist() == cu and m.input_ids.shape[1] == s
        assert m.max_seqlen == max(whole.max_seqlen, pad) and m.sample_ids == whole.sample_ids
        assert m.num_tokens == min(s, max(0, t - r * s))  # real tokens of [r*S, (r+1)*S)
    assert sum(m.num_tokens for m in shards) == whole.num_tokens == t
    assert sum(m.num_targets for m in shards) == whole.num_targets
    return _assert_items_split(samples, processors, shards)


def _assert_items_split(samples, processors, shards) -> int:
    """Each item is collated by one shard; each shard receives a row per placeholder it holds."""
    items = {}
    for s in samples:
        for enc, item in s.items:
            items.setdefault(enc, []).append(item)
    owner = owners([m.route.reshard for m in shards])
    assert sorted(owner) == sorted((e, k) for e, its in items.items() for k in range(len(its)))
    for m in shards:
        plan = m.route.reshard
        assert sorted(m.encoder_inputs) == sorted(plan.encode)
        for enc, idx in plan.encode.items():
            want = processors[enc].collate([items[enc][k] for k in idx])
            assert all(torch.equal(m.encoder_inputs[enc][key], want[key]) for key in want)
        placeholders = torch.tensor([p.placeholder_id for p in processors.values()])
        held = torch.isin(m.input_ids[0], placeholders)  # [S]
        assert sorted(plan.recv_positions) == held.nonzero().flatten().tolist()
    return _items_cut(torch.cat([m.input_ids for m in shards], 1)[0].numpy(), items, processors,
                      shards[0].input_ids.shape[1])


def _items_cut(ids, items, processors, shard_len: int) -> int:
    """How many items of the padded row [T] have placeholders on two shards or more."""
    slots = item_slots(ids, {e: processors[e].placeholder_id for e in items},
                       {e: [it.num_embeddings for it in its] for e, its in items.items()},
                       {e: [0.0] * len(its) for e, its in items.items()})
    return sum(int(sl.positions[0] // shard_len != sl.positions[-1] // shard_len) for sl in slots)


@pytest.mark.parametrize("sp", [2, 3])
@pytest.mark.parametrize("model", ["llava", "qwen2_vl"])
def test_shards_rebuild_the_packed_row(model, sp, request):
    family, processors, samples = request.getfixturevalue(model)
    assert samples[0].position_ids.dim() == (2 if model == "qwen2_vl" else 1)  # M-RoPE: [3, L]
    cut = sum(assert_shards_rebuild_the_row(samples[:n], processors, sp) for n in (1, 2, 3, 4))
    assert cut > 0, "the samples should put some item across a shard boundary"


@pytest.mark.parametrize("sp", [2, 3])
@pytest.mark.parametrize("model", ["llava", "qwen2_vl"])
def test_empty_micro_batch_pads_to_sp(model, sp, request):
    family, processors, _ = request.getfixturevalue(model)
    shards = [empty_micro_batch(family, processors, SeqShard(r, sp, _cost)) for r in range(sp)]
    whole = empty_micro_batch(family, processors)
    for m in shards:
        assert m.input_ids.shape == (1, 1)
        assert m.position_ids.shape == whole.position_ids.shape  # [1, 1] or [3, 1, 1]
        assert (m.num_tokens, m.num_targets, m.encoder_inputs) == (0, 0, {})
        assert m.route.reshard.group_rows == 0 and m.cu_seqlens.tolist() == [0, 1, sp]
    assert whole.num_tokens == 0 and whole.num_targets == 0


def test_near_ties_stay_local_within_the_balance_slack():
    """Loads 4.05 vs 4.0 when a small item on shard 0 comes up: plain LPT (slack 0) sends it to the
    other rank and its rows move; within the slack it stays on the rank that holds it."""
    v = PLACEHOLDER["vision"]
    ids = np.array([v] * 3 + [v] * 1 + [TEXT] * 4 + [v] * 3 + [TEXT] * 5)  # S = 8
    slots = item_slots(ids, PLACEHOLDER, {"vision": [3, 1, 3]}, {"vision": [4.05, 0.3, 4.0]})
    assert assign_items(slots, 2, shard_len=8, slack=0.0) == [0, 1, 1]
    assert assign_items(slots, 2, shard_len=8) == [0, 0, 1]


# ------------------------------------------------------------------- long items (long-short SP)
EVERY = LongItems(threshold=0.0, heads={"vision": 4, "audio": 4})  # every item with >= sp rows
AUTO = LongItems(threshold=None, heads={"vision": 4, "audio": 4})


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("policy", [EVERY, AUTO], ids=["every", "auto"])
def test_long_items_every_placeholder_gets_its_row_once(sp, policy):
    rng = np.random.default_rng(200 + sp)
    split = 0
    for _ in range(60):
        ids, sizes, costs, order = random_row(rng, sp)
        slots, plans = plans_of(ids, sizes, costs, order, sp, policy)
        shards = simulate_exchange(slots, plans, len(ids) // sp)
        expect = np.where(np.isin(ids, list(PLACEHOLDER.values())), np.arange(len(ids)), -1)
        assert torch.equal(torch.cat(shards), torch.as_tensor(expect))
        long = {(e, k) for e, items in plans[0].split.items() for k, _ in items}
        assert all(p.split == plans[0].split for p in plans)  # every rank runs the same pieces
        assert not long & set(owners(plans)), "a long item is also encoded whole"
        assert set(owners(plans)) | long == {(e, k) for e, ns in sizes.items() for k in range(len(ns))}
        for p in plans:  # rows: whole items' plus its piece of each long item
            want = {e: sum(sizes[e][k] for k in idx) for e, idx in p.encode.items()}
            for e, items in p.split.items():
                want[e] = want.get(e, 0) + sum(b[p.rank + 1] - b[p.rank] for _, b in items)
            assert p.encode_rows == want
        split += len(long)
    assert split > 20  # the cases above really split items


def test_one_long_item_is_split_evenly_over_the_group():
    ids = np.array([TEXT] * 3 + [PLACEHOLDER["vision"]] * 10 + [TEXT] * 3)
    _, plans = plans_of(ids, {"vision": [10]}, {"vision": [100.0]}, ["vision"], 4, AUTO)
    assert [p.split for p in plans] == [{"vision": [(0, (0, 3, 6, 8, 10))]}] * 4
    assert [p.encode for p in plans] == [{}] * 4
    assert [p.encode_rows["vision"] for p in plans] == [3, 3, 2, 2]


def test_auto_splits_only_what_no_placement_can_balance():
    ids = np.array([PLACEHOLDER["vision"]] * 12 + [TEXT] * 4)
    # two equal items on 2 ranks: one each is balanced, nothing is split
    _, plans = plans_of(ids, {"vision": [6, 6]}, {"vision": [36.0, 36.0]}, ["vision"], 2, AUTO)
    assert plans[0].split == {}
    # one item costs more than a rank's share: it alone is split, the small one runs whole
    _, plans = plans_of(ids, {"vision": [10, 2]}, {"vision": [100.0, 4.0]}, ["vision"], 2, AUTO)
    assert plans[0].split == {"vision": [(0, (0, 5, 10))]}
    assert sorted(owners(plans)) == [("vision", 1)]
    # a number: items above it are split
    limit = LongItems(threshold=50.0, heads={"vision": 4})
    _, plans = plans_of(ids, {"vision": [6, 6]}, {"vision": [36.0, 64.0]}, ["vision"], 2, limit)
    assert plans[0].split == {"vision": [(1, (0, 3, 6))]}


def test_items_that_cannot_be_split_stay_whole():
    ids = np.array([PLACEHOLDER["vision"]] * 8 + [PLACEHOLDER["audio"]] * 3 + [TEXT])
    sizes, costs = {"vision": [8], "audio": [3]}, {"vision": [64.0], "audio": [9.0]}
    # vision: 6 heads do not split over 4 ranks; audio: 3 rows for 4 ranks
    policy = LongItems(threshold=0.0, heads={"vision": 6, "audio": 4})
    _, plans = plans_of(ids, sizes, costs, ["vision", "audio"], 4, policy)
    assert plans[0].split == {} and len(owners(plans)) == 2
    # an encoder that cannot encode a piece at all (no heads given) keeps every item whole
    _, plans = plans_of(ids, sizes, costs, ["vision", "audio"], 2, LongItems(0.0, {"audio": 4}))
    assert plans[0].split == {"audio": [(0, (0, 2, 3))]}


def test_split_rows_and_threshold_math():
    assert split_rows(10, 4) == [0, 3, 6, 8, 10]
    assert split_rows(4, 4) == [0, 1, 2, 3, 4]
    assert not is_long(5.0, rows=3, size=4, threshold=0.0, group_cost=5.0)  # fewer rows than ranks
    assert not is_long(5.0, rows=8, size=1, threshold=0.0, group_cost=5.0)  # no group
    assert is_long(5.1, rows=8, size=2, threshold=None, group_cost=10.0)
    assert not is_long(5.0, rows=8, size=2, threshold=None, group_cost=10.0)


@pytest.mark.parametrize("sp,cp", [(1, 2), (2, 2), (1, 3)])
@pytest.mark.parametrize("model", ["llava", "qwen2_vl"])
def test_ring_shards_are_the_zigzag_row(model, sp, cp, request):
    """Under parallel.cp the sp x cp shards are the padded row in its zigzag order: tokens,
    targets and (M-RoPE) positions travel together, padding predicts nothing, and each shard
    receives an embedding row for each placeholder it holds."""
    family, processors, samples = request.getfixturevalue(model)
    whole = pack(samples, processors)
    t = whole.input_ids.shape[1]
    shards = [pack(samples, processors, SeqShard(r, sp * cp, _cost, cut=RowCut(sp * cp, zigzag=cp)))
              for r in range(sp * cp)]
    index = shards[0].route.row_index  # [cp, C]
    assert all((m.route.row_index == index).all() for m in shards)
    order = torch.from_numpy(index.reshape(-1))  # the row position of each slot
    for field in ("input_ids", "targets", "position_ids"):
        laid = torch.cat([getattr(m, field) for m in shards], dim=-1)
        row = torch.empty_like(laid)
        row[..., order] = laid
        assert torch.equal(row[..., :t], getattr(whole, field)), field
    targets = torch.cat([m.targets for m in shards], dim=-1)
    assert int((targets != IGNORE_INDEX).sum()) == whole.num_targets
    assert sum(m.num_tokens for m in shards) == t
    _assert_items_split(samples, processors, shards)
