"""Decoder layers whose token mixing is not attention (linear attention, short convolutions) run
once per sample of a packed row (`ds_omni.model.per_sample`): no state flows from one sample into
the next, training on a packed row equals HF on each sample alone, and sequence parallelism,
which would cut samples, is refused."""

import pytest
import torch
from torch import nn

from ds_omni.coverage import sweep
from ds_omni.errors import ModelError
from ds_omni.model import per_sample
from ds_omni.model.families import family_for


class RunningSum(nn.Module):
    """A recurrence over time: each token's output is the sum of every earlier input (plus the
    rotary cos it is handed, so a wrongly cut table shows)."""

    ds_omni_per_sample = "linear_attention"

    def __init__(self):
        super().__init__()
        self.blocks = []  # the bidirectional spans each call was handed

    def forward(self, hidden, position_embeddings=None, position_ids=None, **kwargs):
        blocks = kwargs.get("ds_omni_blocks")
        self.blocks.append(None if blocks is None else blocks.tolist())
        cos, _ = position_embeddings
        return hidden.cumsum(dim=1) + cos[..., :1] + position_ids[..., None]


def _row(lengths):
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    hidden = torch.randn(1, total, 4)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, T]
    cos = torch.randn(1, total, 2)
    return hidden, dict(cu_seqlens=cu, max_seqlen=max(lengths), position_ids=positions,
                        position_embeddings=(cos, cos.clone()), attention_mask=None)


def test_a_recurrent_layer_runs_once_per_sample():
    """Each sample's output is the layer's on that sample alone, and it is handed its own
    bidirectional spans; over the whole row (the planted error) the state of the first sample
    flows into the second."""
    layer = RunningSum()
    hidden, kwargs = _row([3, 5, 2])
    out = per_sample.run_per_sample(layer, hidden, {**kwargs, "ds_omni_blocks": torch.tensor(
        [[4, 6]])})
    assert layer.blocks == [None, [[1, 3]], None]
    for a, b in ((0, 3), (3, 8), (8, 10)):
        cos = kwargs["position_embeddings"][0][:, a:b]
        alone = layer(hidden[:, a:b], position_embeddings=(cos, cos),
                      position_ids=kwargs["position_ids"][:, a:b])
        torch.testing.assert_close(out[:, a:b], alone, rtol=0, atol=0)
    whole = layer(hidden, position_embeddings=kwargs["position_embeddings"],
                  position_ids=kwargs["position_ids"])
    assert not torch.allclose(whole[:, 3:], out[:, 3:])


def test_a_sequence_shard_is_refused():
    class Sharded:
        sp_group = object()

    hidden, kwargs = _row([3, 5])
    with pytest.raises(ModelError, match="linear_attention.*parallel.sp"):
        per_sample.run_per_sample(RunningSum(), hidden, {**kwargs, "ds_omni_attention": Sharded()})


def test_sequence_parallel_config_is_refused_before_training(tmp_path):
    from ds_omni.config import ModelConfig
    from ds_omni.model.build import check_sequence_parallel
    sweep.config_for("qwen3_5").save_pretrained(str(tmp_path))  # the config alone
    with pytest.raises(ModelError, match=r"(?s)parallel.sp=2.*gated delta net.*set parallel.sp"):
        check_sequence_parallel(ModelConfig(pretrained=str(tmp_path)), 2)


class PlainEngine:
    """What `train_step` calls on an engine, over the real model with plain SGD (one process,
    no DeepSpeed: the optimizer is not what this test is about)."""

    device = "cpu"

    def __init__(self, model):
        self.module = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def __call__(self, mb):
        return self.module(mb)

    def backward(self, loss, scale_wrt_gas=True):
        loss.backward()

    def step(self):
        self.optimizer.step()

    def zero_optimization_stage(self):
        return 0


def _hf_loss_and_grads(hf, processor, built, samples, media):
    """HF's summed token loss over the samples, each run alone, and its gradients."""
    import torch.nn.functional as F
    from ds_omni.data.packing import sample_targets
    hf.zero_grad()
    total = 0.0
    for s in samples:
        logits = hf(**sweep.hf_inputs(processor, built, s, media[s.sample_id])).logits[0]
        loss = F.cross_entropy(logits, sample_targets(s), reduction="sum", ignore_index=-100)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}


def test_a_training_step_on_a_packed_row_equals_hf_per_sample(tmp_path):
    """Qwen3.5 (gated delta net + attention layers) through `train_step` on one packed row of
    three samples: the step's loss is HF's summed per-sample loss over the row's targets, the
    gradients are HF's, and the layers recomputed in backward give the same loss."""
    from ds_omni.config import ModelConfig
    from ds_omni.data.loader import StepBatch
    from ds_omni.data.packing import pack
    from ds_omni.data.processing import SampleProcessor
    from ds_omni.model.build import build_model
    from ds_omni.parallel.groups import rank_groups
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.step import train_step
    torch.manual_seed(0)
    config, processor = sweep.RECIPES["qwen3_5"]()
    hf = family_for("qwen3_5").build_hf(config)
    hf.save_pretrained(str(tmp_path))
    sweep.save_processor_parts(processor, tmp_path)
    built = build_model(ModelConfig(pretrained=str(tmp_path)))
    assert [per_sample.runs_per_sample(layer) for layer in built.model.backbone.layers] == [
        True, False]
    img = sweep.images()
    media = {"a": [img[1]], "b": [], "c": [img[0], img[2]]}
    texts = {"a": [{"from": "human", "value": "<image> what is it?"},
                   {"from": "gpt", "value": "a red circle"}],
             "b": "a caption without an image", "c": "<image><image> two shapes"}
    proc = SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors, markers={"vision": "<image>"},
                           max_seq_len=4096)
    samples = [proc(text=texts[k], media={"vision": media[k]} if media[k] else {}, sample_id=k,
                    source="t") for k in media]
    mb = pack(samples, built.item_processors)
    ref_loss, ref_grads = _hf_loss_and_grads(hf, processor, built, samples, media)
    keys = built.model.hf_key_map()
    grads = {}
    built.model.backbone.checkpoint_layers = True  # the per-sample layer under recompute too
    step = StepBatch(step=0, micro_batches=[mb], keys=list(media))
    result = train_step(PlainEngine(built.model), step,
                        rank_groups(ParallelPlan(world_size=1, dp=1), 0, prefetch=False),
                        on_reduced_grads=lambda e: grads.update(
                            {k: p.grad.clone() for k, p in e.module.named_parameters()
                             if p.grad is not None}))
    assert result.targets == mb.num_targets > 0
    assert result.loss == pytest.approx(ref_loss / mb.num_targets, rel=1e-5)
    linear = [k for k in ref_grads if "linear_attn" in k]
    assert linear and ref_grads.keys() == {k for k in keys if keys[k] in grads}
    for name, g in ref_grads.items():  # ours are d(loss sum)/targets: HF's summed ones, scaled
        torch.testing.assert_close(grads[keys[name]] * mb.num_targets, g, rtol=1e-4, atol=1e-6,
                                   msg=name)
    _pipeline_stages_run_it_too(built.model, mb)


def _pipeline_stages_run_it_too(model, mb):
    """The pipeline engine's decoder stages (one layer each, the whole row) give the backbone's
    hidden states."""
    from ds_omni.parallelize.pipeline import DecoderStage
    with torch.no_grad():
        hidden = model.embed(mb)
        whole = model.backbone(hidden, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        for i in range(len(model.backbone.layers)):
            hidden, *_ = DecoderStage(model, i)((hidden, mb.position_ids, mb.cu_seqlens,
                                                 torch.tensor([0])))
    torch.testing.assert_close(model.backbone.norm(hidden), whole, rtol=0, atol=0)


def test_an_indexed_layer_attends_to_its_top_k_pick_only():
    """A per-sample call that hands a mask and a top-k pick (`indices`, as DeepSeek-V3.2-style
    layers do for kernels other than eager / SDPA) attends to the picked earlier keys only; with
    the pick ignored (the planted error) later queries see more keys."""
    from types import SimpleNamespace
    from ds_omni.model.attention import packed_attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))  # [1, H, L, D]
    picks = torch.tensor([[[0, 0], [0, 1], [1, 2], [0, 3], [2, 4]]])  # [1, L, 2]
    module = SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    call = dict(scaling=0.5, ds_omni_cu_seqlens=torch.tensor([0, 5]), ds_omni_max_seqlen=5)
    out, _ = packed_attention(module, q, k, v, per_sample.causal_mask(5, "cpu"), indices=picks,
                              **call)
    allowed = torch.zeros(5, 5, dtype=torch.bool)
    allowed[torch.arange(5)[:, None], picks[0]] = True
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~allowed, float("-inf"))
    want = (scores.softmax(-1) @ v).transpose(1, 2)  # [1, L, H, D]
    torch.testing.assert_close(out, want)
    causal, _ = packed_attention(module, q, k, v, per_sample.causal_mask(5, "cpu"), **call)
    assert not torch.allclose(causal[:, 2:], want[:, 2:])
