"""Visual indicator tokens (Ovis2): besides its image tokens, the model's forward replaces the
indicator tokens an image is written with (start, grid, column, row, end marks) by rows of its
visual table. The generic adapter makes them part of the image's rows, in text order.

The coverage sweep checks a packed row against HF's forward (`sweep.RECIPES["ovis2"]`); these
tests check the arrangement itself and that, under LLM sequence parallelism, the shards count the
indicator tokens as the item's placeholders and receive their rows where they sit.

Dims: n image rows of an item, m indicators, L tokens its rows replace, D LLM width.
"""

from __future__ import annotations

import pytest
import torch

from ds_omni.data.packing import SeqShard, pack
from ds_omni.errors import ModelError
from ds_omni.model.families.generic import with_indicators
from ds_omni.model.families.hf_processor import INDICATOR_SLOTS
from ds_omni.parallelize import apply_plan, embedding
from tests.unit.model.test_deepstack import FakeExchange, build


def test_rows_follow_the_slots():
    rows = torch.arange(2.0)[:, None].expand(2, 3)  # [n, D]: image rows 0, 1
    table = 10 + torch.arange(3.0)[:, None].expand(3, 3)  # [m, D]: indicators 10, 11, 12
    got = with_indicators(rows, table, torch.tensor([0, -1, 2, -1, 1]))
    assert got[:, 0].tolist() == [10, 0, 12, 1, 11]
    with pytest.raises(ModelError, match="yields 2 embeddings but its tokens hold 1 image"):
        with_indicators(rows, table, torch.tensor([0, -1, 2]))


@pytest.fixture(scope="module")
def ovis2(tmp_path_factory):
    return build(tmp_path_factory.mktemp("ovis2"), "ovis2")


def test_indicator_tokens_get_the_visual_table_and_ride_with_the_shards(ovis2, monkeypatch):
    """Whole row: each indicator token holds its row of the visual table, each image its slots;
    SP = 2: the shards' embeddings, side by side, are the whole row's."""
    built, samples = ovis2
    model, ids = built.model, built.hf_config.visual_indicator_token_ids
    item = samples[2].items[0][1]  # the wide image: cut into tiles, with grid / column marks
    slots = item.inputs[INDICATOR_SLOTS]
    assert {1, 2} <= set(slots.tolist()) and (slots == -1).sum() < len(slots)
    whole = pack(samples, built.item_processors)
    shards = [pack(samples, built.item_processors,
                   SeqShard(r, 2, lambda enc, it: float(it.num_embeddings))) for r in range(2)]
    with torch.no_grad():
        want = model.embed(whole)[0]  # [T, D]
        table = model.hf_model.model.visual_embeddings_table
        last = table.weight.shape[0] - len(ids)
        for i, token in enumerate(ids):
            at = (whole.input_ids[0] == token).nonzero().squeeze(1)
            assert len(at) and torch.equal(want[at], table.weight[last + i].expand(len(at), -1))
        exchange = FakeExchange()
        monkeypatch.setattr(embedding, "ReshardEmbeddings", exchange)
        apply_plan(model)  # the plan's routing embeds the shards (no group: the fake exchange)
        for shard in shards:
            model.embed(shard)
        exchange.deliver = True
        got = torch.cat([model.embed(shard)[0] for shard in shards])
    assert torch.equal(got[:want.shape[0]], want)
