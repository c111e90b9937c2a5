"""Which resumes go through ds_omni's consolidation (`ds_omni.train.reshard`): another pp, tp or
ep, or a pipeline on another number of ranks; the rest keep DeepSpeed's loading (the real
resumes: tests/dist/test_checkpoint_plans.py, slow tier)."""

from types import SimpleNamespace

import torch

from ds_omni.train.reshard import needs_reshard, saved_layout


def _plan(pp=1, tp=1, ep=1, world_size=4):
    return SimpleNamespace(pp=pp, tp=tp, ep=ep, world_size=world_size)


def test_another_model_parallel_layout_or_a_resized_pipeline_is_resharded():
    saved = {"pp": 2, "tp": 2, "ep": 1, "world_size": 4}
    assert not needs_reshard(saved, _plan(pp=2, tp=2))
    for other in (_plan(tp=2), _plan(pp=2), _plan(), _plan(tp=4), _plan(pp=2, tp=2, world_size=8)):
        assert needs_reshard(saved, other), other
    plain = {"pp": 1, "tp": 1, "ep": 1, "world_size": 4}
    assert not needs_reshard(plain, _plan(world_size=2))  # DeepSpeed's universal checkpoint
    assert needs_reshard({**plain, "ep": 2}, _plan(world_size=4))


def test_the_saved_layout_is_read_from_the_run_and_deepspeeds_record(tmp_path):
    torch.save({"checkpoint_parallel_dimensions": {"pp_degree": 2, "tp_degree": 2}},
               tmp_path / "mp_rank_00_model_states.pt")
    assert saved_layout(tmp_path, {"tp": 2, "ep": 1, "world_size": 4}) == \
        {"pp": 2, "tp": 2, "ep": 1, "world_size": 4}
    assert saved_layout(tmp_path, None)["tp"] == 1


def test_a_zero3_checkpoint_without_model_states_is_no_pipeline(tmp_path):
    """ZeRO-3 writes no mp_rank_00_model_states.pt (and never runs with pp)."""
    assert saved_layout(tmp_path, {"tp": 1, "ep": 1, "world_size": 2})["pp"] == 1
