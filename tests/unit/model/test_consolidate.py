"""A pipeline x tensor-parallel checkpoint (pp2 x tp2) made whole for the HF export, in one
process: the files DeepSpeed's pipeline engine writes (one per pipeline layer and TP rank,
`layer_03-model_01-model_states.pt`, AutoTP's shards in them) are faked from a model with known
weights, and `consolidate_checkpoint` must give those weights back exactly. The real files of
pp2 x tp2, pp2 x ep2 and ep2 x tp2 runs are checked in the slow tier
(tests/dist/test_checkpoint_plans.py). Planted errors (`tests/plants/checkpoint.py`): a TP shard
joined on the wrong dim, a stage's layer index offset; each must fail the check."""

import pytest
import torch

from tests import plants
from tests.fixtures import tiny_config

TP = 2
SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 0, "up_proj": 0,
         "down_proj": 1}  # AutoTP's: column-parallel output rows, row-parallel input columns


def _fake_pp_tp_checkpoint(tmp_path):
    """(checkpoint root, the model whose weights it holds, their state) of a pp x tp run."""
    from ds_omni.model.build import build_model
    from ds_omni.model.layer_files import layer_file
    from ds_omni.model.tp_files import save_tp_layout
    from ds_omni.parallelize.pipeline import StepInputs, pipeline_layers
    model = build_model(tiny_config(str(tmp_path / "run")).model).model
    with torch.no_grad():  # weights no fresh build has, each tensor its own
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn_like(p) + i)
    names = {id(t): n for n, t in model.state_dict(keep_vars=True).items()}
    layout = {}
    for n, p in model.named_parameters():
        dim = SPLIT.get(n.split(".")[-2]) if n.startswith("backbone.layers.") else None
        if dim is not None:
            layout[n] = {"dim": dim, "sizes": [p.shape[dim] // TP] * TP}
    root, tag = tmp_path / "checkpoints", "step00000001"
    (root / tag).mkdir(parents=True)
    (root / "model").mkdir()
    save_tp_layout(root / "model", layout)
    for i, layer in enumerate(pipeline_layers(model, StepInputs())):
        for t in range(TP):  # what PipelineModule.save_state_dict writes on TP rank t
            state = {}
            for key, value in layer.state_dict(keep_vars=True).items():
                split = layout.get(names[id(value)])
                value = value.detach()
                if split is not None:
                    value = value.chunk(TP, dim=split["dim"])[t]
                state[key] = value.clone()
            torch.save(state, layer_file(root / tag, i, t))
    return root, tag, model


def check_consolidated(tmp_path) -> None:
    from ds_omni.model.convert import consolidate_checkpoint
    root, tag, model = _fake_pp_tp_checkpoint(tmp_path)
    want = model.state_dict()
    got = consolidate_checkpoint(root, tag, model)
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:5]
    for key, value in want.items():
        assert got[key].shape == value.shape and torch.equal(got[key], value), \
            f"export of {key}: not the trained weight"


def test_a_pipeline_tensor_parallel_checkpoint_consolidates_to_the_trained_weights(tmp_path):
    check_consolidated(tmp_path)


@pytest.mark.parametrize("plant", plants.for_launch("ckpt_export"))
def test_plant_is_caught(plant, tmp_path):
    with plants.applied(plant, 0), pytest.raises(AssertionError, match="export of"):
        check_consolidated(tmp_path)
