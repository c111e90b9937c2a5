"""Adam's moments across plans (`ds_omni.train.moments`), in one process: the cuts that give a rank
its piece of a whole moment invert the joins that made it whole (AutoEP's experts in HF's layout,
AutoTP's uneven shards), a pipeline stage's names map to the model's, and a save, read and
restore continues torch's AdamW exactly where it stopped (no ZeRO: the optimizer's own state).
The real plans: tests/dist/test_checkpoint_plans.py (slow tier)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_omni.model.tp_files import merge_tp
from ds_omni.parallelize.expert_parallel import autoep_piece, hf_expert_state
from ds_omni.parallelize.tensor_parallel import tp_piece
from ds_omni.train import checkpoint, moments
from tests.fake_engine import FakeEngine


def test_autoep_pieces_invert_the_gather_into_hfs_layout():
    """Two EP ranks' experts (2 of 4 each) gathered into HF's fused layout and cut again."""
    head = "backbone.layers.0.mlp."
    ranks = [{head + "experts.w1": torch.randn(2, 3, 5), head + "experts.w3": torch.randn(2, 3, 5),
              head + "experts.w2": torch.randn(2, 5, 3),
              head + "router.gate.weight": torch.randn(4, 5), "backbone.norm.weight": torch.ones(5)}
             for _ in range(2)]

    def gather(t):
        name = next(n for n, v in ranks[0].items() if v is t)
        return [r[name] for r in ranks]
    whole = hf_expert_state(ranks[0], 2, gather)
    assert whole[head + "experts.gate_up_proj"].shape == (4, 6, 5)
    for r, local in enumerate(ranks):
        for name, tensor in local.items():
            piece = autoep_piece(name, whole, slice(2 * r, 2 * r + 2))
            want = ranks[0][name] if "router" in name or "norm" in name else tensor
            assert piece.equal(want), (r, name)


def test_tp_pieces_invert_the_merge_of_uneven_shards():
    """AutoTP's widths can be uneven (fewer KV heads than TP ranks: a zero-width shard)."""
    sizes = [3, 1, 0, 4]
    for dim in (0, 1):
        shards = [{"w": torch.randn(*([n, 5] if dim == 0 else [5, n]))} for n in sizes]
        whole = merge_tp(shards, {"w": {"dim": dim, "sizes": sizes}}, None)["w"]
        for index, shard in enumerate(shards):
            assert tp_piece(whole, (dim, tuple(sizes), index)).equal(shard["w"])


def test_a_pipeline_stage_names_its_parameters_as_the_model():
    stage = SimpleNamespace(omni_prefixes=[
        {"embed_tokens": "backbone.embed_tokens", "encoders": "encoders"},
        {"layer": "backbone.layers.0", "rotary_emb": "backbone.rotary_emb"},
        {"norm": "backbone.norm", "lm_head": "backbone.lm_head"}])
    assert moments.omni_name(stage, "1.layer.mlp.experts.w1") == "backbone.layers.0.mlp.experts.w1"
    assert moments.omni_name(stage, "joint_encoders.vision.w") == "encoders.vision.w"
    assert moments.omni_name(SimpleNamespace(), "backbone.norm.weight") == "backbone.norm.weight"


def _engine(weights: dict | None = None):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    if weights is not None:
        module.load_state_dict(weights)
    opt = torch.optim.AdamW(module.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    return SimpleNamespace(module=module, optimizer=opt, zero_optimization_stage=lambda: 0)


def _steps(engine, inputs: list[torch.Tensor]) -> None:
    for x in inputs:
        engine.optimizer.zero_grad()
        engine.module(x).square().sum().backward()
        engine.optimizer.step()


def test_saved_moments_restored_continue_adam_exactly(tmp_path):
    inputs = [torch.randn(8, 4) for _ in range(4)]
    engine = _engine()
    _steps(engine, inputs[:2])
    moments.save(engine, tmp_path, rank=0)
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    _steps(engine, inputs[2:])
    found = moments.read(tmp_path)
    assert found.step == 2.0 and set(found.tensors["exp_avg"]) == set(weights)

    resumed = _engine(weights)
    assert moments.restore(resumed, found, weights) is None
    _steps(resumed, inputs[2:])
    for (name, p), q in zip(engine.module.named_parameters(), resumed.module.parameters()):
        assert p.equal(q), name
    afresh = _engine(weights)  # the moments left out: the same steps end elsewhere
    _steps(afresh, inputs[2:])
    assert not all(p.equal(q) for p, q in zip(engine.module.parameters(),
                                              afresh.module.parameters()))


def test_a_cut_that_does_not_give_the_weights_back_sets_nothing(tmp_path):
    engine = _engine()
    _steps(engine, [torch.randn(8, 4)])
    moments.save(engine, tmp_path, rank=0)
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    other = _engine({k: v + 1 for k, v in weights.items()})
    problem = moments.restore(other, moments.read(tmp_path), weights)
    assert problem is not None and "0.weight" in problem
    assert not other.optimizer.state  # the optimizer starts afresh
    assert moments.read(tmp_path / "none") is None


@pytest.mark.parametrize("whole", [True, False])
def test_a_save_writes_whole_moments_only_when_asked(tmp_path, whole):
    """`train.save_whole_moments` (`checkpoint.save(whole_moments=)`): the moments file is in the
    checkpoint, readable, or absent (a resume on another plan then restarts Adam's moments)."""
    engine, stepped = FakeEngine(), _engine()
    _steps(stepped, [torch.randn(8, 4)])
    engine.module, engine.optimizer = stepped.module, stepped.optimizer
    engine.zero_optimization_stage = lambda: 0
    saved = checkpoint.save(engine, tmp_path, 1, {"step": 1}, rank=0, whole_moments=whole)
    found = moments.read(saved)
    assert (found is not None) == whole
    if whole:
        assert found.step == 1.0 and set(found.tensors["exp_avg"]) == set(
            dict(stepped.module.named_parameters()))
