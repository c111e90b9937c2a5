"""Deepstack: vision features that the LLM adds to its hidden states between decoder layers, each
level before the layer its encoder's layer map names (Qwen3-VL: after its first layers; Granite 4
Vision: before the layers its config names, `ds_omni.model.deepstack`).

The coverage sweep checks a packed row against HF's own forward (`sweep.RECIPES["qwen3_vl"]`,
`["granite4_vision"]`); these tests check what the sweep cannot see: the layer maps read from the
configs, the levels travel with their rows when LLM sequence parallelism cuts the row into shards
(each item encoded by one rank, its rows sent by one all-to-all, simulated here by looping over the
ranks), training reaches the projectors of the levels HF adds and no others, and the pipeline's
layers carry the levels to the stages that add them.

Dims: T row length (padded to a multiple of sp), S = T / sp, D LLM width, k deepstack levels.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_omni.coverage import sweep
from ds_omni.data.packing import SeqShard, pack
from ds_omni.errors import ModelError
from ds_omni.model import deepstack
from ds_omni.model.deepstack import Deepstack
from ds_omni.parallelize import apply_plan, embedding


def build(folder, model_type: str):
    """(built model, samples): a tiny `model_type` through `build_model`, and the sweep's samples
    (one image, text only, two images of other sizes) plus a long text-only one."""
    from ds_omni.config import ModelConfig
    from ds_omni.data.processing import SampleProcessor
    from ds_omni.model.build import build_model
    from ds_omni.model.families import family_for
    torch.manual_seed(0)
    config, processor = sweep.RECIPES[model_type]()
    family_for(model_type).build_hf(config).save_pretrained(str(folder))
    sweep.save_processor_parts(processor, folder)
    built = build_model(ModelConfig(pretrained=str(folder)))
    proc = SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors, markers={"vision": "<image>"},
                           max_seq_len=4096)
    img = sweep.images()
    samples = [proc(text=t, media={"vision": m} if m else {}, sample_id=str(i), source="s")
               for i, (t, m) in enumerate([("<image> a red circle", [img[0]]),
                                           ("a caption without an image", []),
                                           ("<image><image> which is larger?", img[1:]),
                                           ("a long caption without an image " * 6, [])])]
    return built, samples


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")


@pytest.fixture(scope="module")
def granite4_vision(tmp_path_factory):
    return build(tmp_path_factory.mktemp("granite4_vision"), "granite4_vision")


def test_layer_maps_of_the_configs(qwen3_vl, granite4_vision):
    """Qwen3-VL's k levels go after layers 0..k-1 (before 1..k); Granite 4 Vision's pairs go
    before the layers they name, the later pair winning a layer named twice and no pair kept for
    a layer the LLM lacks (its recipe: pairs at 0, 1, then spatial at 1, 2, 5, 6 with 2 layers)."""
    qwen, granite = qwen3_vl[0], granite4_vision[0]
    assert deepstack.layout(qwen.hf_config) == deepstack.Layout((1, 2))
    assert qwen.model.deepstack_layers == (1, 2)
    assert deepstack.layout(granite.hf_config) == deepstack.Layout(layers=(0, 1), pairs=(0, 2))
    assert granite.model.deepstack_layers == (0, 1)
    assert deepstack.granite_levels([3, -1, 0, 3, 1, 0], 4) == ((3, 4, 5), (3, 1, 0))
    assert deepstack.granite_levels([4, 5], 4) == ((), ())
    assert deepstack.layout(SimpleNamespace(vision_config=None)) == deepstack.Layout()


def dense(hidden: torch.Tensor, deepstack: Deepstack | None, k: int) -> torch.Tensor:
    """[T, (1 + k) D]: each position's embedding and its k levels (zero where it has none)."""
    levels = hidden.new_zeros((hidden.shape[1], k, hidden.shape[2]))  # [T, k, D]
    if deepstack is not None:
        levels[deepstack.positions] = deepstack.levels
    return torch.cat([hidden[0], levels.flatten(1)], dim=1)


class FakeExchange:
    """`ReshardEmbeddings` for sp ranks in one process: a first pass over the ranks records what
    each sends (and gets zeros back), a second delivers what the ranks sent, concatenated by source
    rank as `all_to_all_single` does."""

    def __init__(self):
        self.sent: dict[int, tuple[torch.Tensor, ...]] = {}
        self.deliver = False

    def apply(self, rows: torch.Tensor, plan, group) -> torch.Tensor:
        if not self.deliver:
            order = torch.as_tensor(plan.send_order, dtype=torch.long)
            self.sent[plan.rank] = torch.split(rows[order], plan.send_counts)  # by destination
            return rows.new_zeros((plan.rows_in, rows.shape[1]))
        return torch.cat([self.sent[src][plan.rank] for src in sorted(self.sent)])


@pytest.mark.parametrize("model_type, sp, n", [("qwen3_vl", 2, 4), ("qwen3_vl", 4, 3),
                                                ("granite4_vision", 2, 4)])
def test_sharded_embedding_carries_the_levels_like_the_whole_row(request, monkeypatch,
                                                                 model_type, sp, n):
    """The SP shards' embeddings and deepstack levels, put side by side, are the whole row's; a
    rank that encoded nothing still sends rows of the levels' width, and one whose shard holds no
    image token receives none (the first n samples in one row)."""
    built, samples = request.getfixturevalue(model_type)
    samples = samples[:n]
    model, k = built.model, built.model.deepstack
    assert k == 2
    whole = pack(samples, built.item_processors)
    with torch.no_grad():
        want = dense(*model.embed_deepstack(whole), k)  # [T, (1 + k) D]
        shards = [pack(samples, built.item_processors,
                       SeqShard(r, sp, lambda enc, item: float(item.num_embeddings)))
                  for r in range(sp)]
        exchange = FakeExchange()
        monkeypatch.setattr(embedding, "ReshardEmbeddings", exchange)
        apply_plan(model)  # the plan's routing embeds the shards (no group: the fake exchange)
        for shard in shards:
            model.embed_deepstack(shard)
        exchange.deliver = True
        got = torch.cat([dense(*model.embed_deepstack(shard), k) for shard in shards])
    t = want.shape[0]
    assert torch.equal(got[:t], want)
    if n == 3:  # 3 items on 4 ranks: one encodes nothing, yet receives rows of its shard
        assert any(not s.route.reshard.encode and s.route.reshard.rows_in for s in shards)
    else:  # the long text-only sample fills the last shard: it receives no row
        assert shards[-1].route.reshard.encode and not shards[-1].route.reshard.rows_in
    assert (want[:, 32:] != 0).any(dim=1).sum() == sum(
        it.num_embeddings for s in samples for _, it in s.items)  # levels on every image token


def test_training_reaches_the_deepstack_mergers(qwen3_vl):
    """Level 0 (added after the first of the two LLM layers) gets gradients; the last level, added
    after the last layer, reaches only the image positions, which predict no target (as in HF)."""
    built, samples = qwen3_vl
    model = built.model
    model.zero_grad()
    model(pack(samples, built.item_processors)).loss_sum.backward()
    first, last = model.encoders["vision"].tower["visual"].deepstack_merger_list
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in first.parameters())
    assert all(not p.grad.any() for p in last.parameters())


def test_training_reaches_the_projectors_of_the_pairs_hf_adds(granite4_vision):
    """Granite 4 Vision (its recipe's map: `test_layer_maps_of_the_configs`): the projectors of the
    pairs added before layers 0 and 1 get gradients; the pair for layer 1 that a later one
    replaces, and those aimed at layers the LLM lacks, get none, as in HF."""
    built, samples = granite4_vision
    model = built.model
    model.zero_grad()
    model(pack(samples, built.item_processors)).loss_sum.backward()
    projectors = model.encoders["vision"].projector.modules_
    layerwise, spatial = projectors["layerwise_projectors"], projectors["spatial_projectors"]

    def reached(module):
        return any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())
    assert [reached(m) for m in (*layerwise, *spatial)] == [True, False, True, False, False, False]


def test_pipeline_stages_carry_the_levels(qwen3_vl):
    """The pipeline's layers run one after another in one process (what the stages compute,
    without the engine) give the model's loss and gradients, deepstack mergers included: the
    levels travel after the row's index to the layers that add them (level 0 before layer 1,
    level 1 before the norm: the head) and no further. `embed` alone refuses the model."""
    from ds_omni.parallelize.pipeline import StepInputs, pipeline_layers
    built, samples = qwen3_vl
    model, batch = built.model, pack(samples, built.item_processors)
    model.zero_grad()
    want_loss = model(batch).loss_sum
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    inputs = StepInputs()
    layers = pipeline_layers(model, inputs)
    inputs.batches = [batch]
    carried = (torch.tensor([0]), batch.position_ids, batch.cu_seqlens)
    widths = []
    for layer in layers[:-1]:
        carried = layer(carried)
        widths.append(len(carried))
    assert widths == [6, 6, 6]  # hidden, position_ids, cu_seqlens, index, positions, levels
    loss = layers[-1](carried)
    loss.backward()
    assert torch.equal(loss, want_loss)
    assert inputs.deep_carry.levels_added == 2
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=0, msg=name)
    with pytest.raises(ModelError, match="deepstack"):
        model.embed(batch)


def test_rows_of_another_width_than_the_levels_declared_are_an_error(qwen3_vl, monkeypatch):
    """An adapter that declares fewer levels than its tower returns is told so, not run with the
    levels dropped."""
    built, samples = qwen3_vl
    monkeypatch.setattr(built.model.encoders["vision"], "deepstack_layers", (1,))
    with pytest.raises(ModelError,
                       match=r"width 96.*1 deepstack levels makes 64.*`deepstack_layers`"):
        built.model.logits(pack(samples, built.item_processors))
