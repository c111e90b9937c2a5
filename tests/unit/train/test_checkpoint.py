"""ds_omni's part of a checkpoint, with a stand-in for DeepSpeed's engine (its files are DeepSpeed's)."""

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_omni.errors import LaunchError
from ds_omni.train import checkpoint, fingerprint
from tests.fake_engine import FakeEngine


def _draws():
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)],
            float(np.random.randn()), random.gauss(0, 1))


def test_every_rng_resumes_where_it_was(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.randn(), random.gauss(0, 1)  # leave a cached gaussian behind in both
    checkpoint.save(FakeEngine(), tmp_path, 5, {"step": 5}, rank=0)
    expected = _draws()
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    step, state = checkpoint.load(FakeEngine(), tmp_path, rank=0)
    assert (step, state) == (5, {"step": 5})
    assert _draws() == expected
    saved = torch.load(tmp_path / "checkpoints" / "step00000005" / "rng_rank0.pt", weights_only=True)
    assert {"torch", "numpy", "python"} <= set(saved)


# One process imports once, then forks a child per point: the child saves step 1, then is killed
# (SIGKILL, as a dying node) at that point of saving step 2. The parent prints how each child ended.
_DIE_WHILE_SAVING = """
import os, signal, sys
from ds_omni.train import checkpoint, fingerprint
from tests.fake_engine import FakeEngine

def die(*_, **__):
    os.kill(os.getpid(), signal.SIGKILL)

class DiesWriting(FakeEngine):
    def save_checkpoint(self, root, tag, save_latest=True):
        with open(os.path.join(root, tag, "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"half a tens")
            f.flush()
            die()

def save_and_die(out, point):
    checkpoint.save(FakeEngine(), out, 1, {"step": 1}, rank=0)
    if point == "publish":
        checkpoint._publish = die
    elif point == "latest":
        checkpoint._write_latest = die
    checkpoint.save(DiesWriting() if point == "engine" else FakeEngine(), out, 2, {"step": 2}, rank=0)

root = sys.argv[1]
for point in sys.argv[2:]:
    pid = os.fork()
    if pid == 0:
        try:
            save_and_die(os.path.join(root, point), point)
        finally:
            os._exit(0)  # reached only if the save was not killed
    status = os.waitpid(pid, 0)[1]
    print(point, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)
"""


def test_a_rank_killed_in_the_middle_of_a_save_leaves_a_usable_checkpoint(tmp_path):
    import subprocess
    import sys
    from tests.harness import REPO
    points = {"engine": 1, "publish": 1, "latest": 2}  # the step a resume finds
    res = subprocess.run([sys.executable, "-c", _DIE_WHILE_SAVING, str(tmp_path), *points],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [w for p in points for w in (p, "True")]  # each child was killed
    for point, step in points.items():
        assert checkpoint.load(FakeEngine(), tmp_path / point, rank=0) == (step, {"step": step}), point
        checkpoint.save(FakeEngine(), tmp_path / point, 2, {"step": 2}, rank=0)  # saving again works
        assert checkpoint.load(FakeEngine(), tmp_path / point, rank=0)[0] == 2
        assert not list((tmp_path / point / "checkpoints").glob(".step*")), point


def test_a_corrupted_or_incomplete_newest_checkpoint_is_named_and_passed_over(tmp_path, capsys):
    for step in (1, 2, 3):
        checkpoint.save(FakeEngine(), tmp_path, step, {"step": step}, rank=0)
    root = tmp_path / "checkpoints"
    weights = root / "step00000003" / "mp_rank_00_model_states.pt"
    data = bytearray(weights.read_bytes())
    data[10] ^= 1  # one flipped bit, same size
    weights.write_bytes(bytes(data))
    (root / "step00000002" / "rng_rank0.pt").unlink()
    assert checkpoint.load(FakeEngine(), tmp_path, rank=0) == (1, {"step": 1})
    out = capsys.readouterr().out
    assert "step00000003: mp_rank_00_model_states.pt fails its sha256 checksum" in out
    assert "step00000002: rng_rank0.pt is missing" in out
    (root / "step00000001" / "manifest.json").unlink()
    with pytest.raises(LaunchError, match=r"no complete checkpoint in .*step00000001: no manifest"):
        checkpoint.load(FakeEngine(), tmp_path, rank=0)


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for step in range(1, 5):
        checkpoint.save(FakeEngine(), tmp_path, step, {"step": step}, rank=0, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step00000003", "step00000004"]
    assert (root / "latest").read_text() == "step00000004"


def test_resume_with_another_model_or_zero_stage_says_what_differs(tmp_path):
    """Before DeepSpeed reads anything (its own error is a traceback from inside, or a silent
    partial load with strict=False)."""
    checkpoint.save(FakeEngine(), tmp_path, 1, {"step": 1}, rank=0)
    wider = FakeEngine()
    wider.module = torch.nn.Linear(2, 1)
    with pytest.raises(LaunchError) as e:
        checkpoint.load(wider, tmp_path, rank=0)
    assert "was written by a different run: 1 parameter(s) of another shape (e.g. weight: [1, 1] " \
           "in the checkpoint, [1, 2] now)" in str(e.value)
    renamed = FakeEngine()
    renamed.module = torch.nn.Sequential(torch.nn.Linear(1, 1))
    renamed.zero_optimization_stage = lambda: 2
    message = str(pytest.raises(LaunchError, checkpoint.load, renamed, tmp_path, rank=0).value)
    assert "2 parameter(s) only in the checkpoint (e.g. bias, weight)" in message
    assert "2 parameter(s) only in this model (e.g. 0.bias, 0.weight)" in message
    assert "ZeRO stage 0 in the checkpoint, 2 now" in message
    assert checkpoint.load(FakeEngine(), tmp_path, rank=0) == (1, {"step": 1})  # the same run


def test_fingerprint_differences_of_family_and_ranks():
    run = {"family": "llava", "params": {"w": [2]}, "zero_stage": 2, "world_size": 2}
    assert fingerprint.fingerprint_differences(None, run) == []  # a checkpoint from before
    assert fingerprint.fingerprint_differences(run, dict(run)) == []
    other = {**run, "family": "qwen2_vl", "world_size": 1}
    assert fingerprint.fingerprint_differences(run, other) == [
        "model family 'llava' in the checkpoint, 'qwen2_vl' now"]  # ranks: resharded at load
    assert fingerprint.fingerprint_differences({**run, "zero_stage": 0},
                                              {**run, "zero_stage": 0, "world_size": 4}) == []


def test_a_checkpoint_resumes_at_the_tp_and_ep_that_wrote_it(tmp_path):
    """tp and ep cut the parameters: another degree is refused, naming both degrees and the way
    on (export to HF's layout, start from it); a checkpoint from before the degrees were
    recorded, or at the same ones, passes."""
    run = {"family": "llava", "params": {"w": [2]}, "zero_stage": 2, "world_size": 2,
           "tp": 2, "ep": 1}
    where = tmp_path / "checkpoints" / "step00000003"
    fingerprint.check_model_parallel(run, dict(run), where)
    fingerprint.check_model_parallel({k: v for k, v in run.items() if k not in ("tp", "ep")},
                                    {**run, "tp": 1}, where)  # written before: tp 1 assumed
    for key, now in (("tp", 1), ("ep", 2)):
        message = str(pytest.raises(LaunchError, fingerprint.check_model_parallel, run,
                                    {**run, key: now}, where).value)
        assert f"parallel.{key}={run[key]}, this run has parallel.{key}={now}" in message
        assert f"ds-omni convert --checkpoint {tmp_path / 'checkpoints'}" in message
    assert fingerprint.model_parallel_degrees(torch.nn.Linear(2, 2)) == (1, 1)


def test_a_checkpoint_sharded_for_another_number_of_ranks_is_resharded(tmp_path):
    """The ranks that wrote the optimizer shards are counted from DeepSpeed's file names (ZeRO
    1-2, ZeRO-3, bf16 without ZeRO); only sharded state written by another count needs the
    universal conversion (whole state, in the model file, loads on any number of ranks)."""
    names = {"zero1": [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)],
             "zero3": ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                       "zero_pp_rank_1_mp_rank_00_model_states.pt",
                       "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                       "zero_pp_rank_1_mp_rank_00_optim_states.pt"],
             "bf16": ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
             "whole": ["mp_rank_00_model_states.pt"],
             # a pipeline of 2 stages, dp 1: one shard per stage (mp_rank), both dp rank 0
             "pp2": ["zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_0_mp_rank_01_optim_states.pt"]}
    for kind, files in names.items():
        (tmp_path / kind).mkdir()
        for name in files + ["rng_rank0.pt", "loader_state.json"]:
            (tmp_path / kind / name).write_bytes(b"x")
    ranks = {kind: checkpoint.shard_ranks(tmp_path / kind) for kind in names}
    assert ranks == {"zero1": 4, "zero3": 2, "bf16": 1, "whole": 0, "pp2": 2}
    assert checkpoint.resharding_needed(4, 2) and checkpoint.resharding_needed(1, 2)
    assert not checkpoint.resharding_needed(2, 2) and not checkpoint.resharding_needed(0, 8)


def test_a_failed_universal_conversion_says_how_to_resume(tmp_path):
    """Not a traceback from inside DeepSpeed's converter, and nothing left half-written."""
    step = tmp_path / "step00000001"
    step.mkdir()
    (step / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a checkpoint")
    (step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(LaunchError, match=r"converting .*step00000001' to a universal checkpoint "
                                          r"\(to load it on another number of ranks\) failed: "
                                          r".*Resume with the number of ranks that wrote it \(2\)"):
        checkpoint.universal_tag(tmp_path, "step00000001", rank=0)
    assert sorted(p.name for p in step.iterdir()) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_a_damaged_loader_state_is_named(tmp_path):
    """Bytes that still match the manifest (a checkpoint written by a buggy or older writer):
    unreadable JSON, or JSON that lacks what the loader needs."""
    from ds_omni.train.loop import restore_loader
    checkpoint.save(FakeEngine(), tmp_path, 1, {"step": 1}, rank=0)
    step_dir = tmp_path / "checkpoints" / "step00000001"
    (step_dir / "manifest.json").unlink()  # a checkpoint from before manifests, named by latest
    (step_dir / "loader_state.json").write_text('{"step": 1, "ranks": [')
    with pytest.raises(LaunchError, match=r"loader_state.json' cannot be read \(Expecting value.*"
                                          r"move step00000001 out of"):
        checkpoint.load(FakeEngine(), tmp_path, rank=0)

    class Loader:
        def load_state_dict(self, state):
            return state["ranks"][0]["cursors"]
    with pytest.raises(LaunchError, match=r"loader_state.json is damaged \(KeyError: 'ranks'\)"):
        restore_loader(Loader(), {"step": 1})


def test_a_pipeline_checkpoint_on_another_number_of_ranks_says_what_to_do(tmp_path):
    """DeepSpeed's loading cannot re-partition a pipeline checkpoint: one written by 4 ranks
    (2 stages x dp 2) and loaded on 1 rank without ds_omni's consolidation (`--resume` runs it
    first: `ds_omni.train.reshard`) is refused, before DeepSpeed reads a byte."""
    class PipelineStage(torch.nn.Linear):
        def whole_model_shapes(self):
            return {"0.weight": [1, 1], "0.bias": [1]}

    class PipelineEngine(FakeEngine):
        def __init__(self):
            super().__init__()
            self.module = PipelineStage(1, 1)

        def save_checkpoint(self, root, tag, save_latest=True):
            super().save_checkpoint(root, tag, save_latest)
            for dp, stage in ((0, 0), (1, 0), (0, 1), (1, 1)):
                (Path(root) / tag / f"zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt"
                 ).write_bytes(b"x")

    checkpoint.save(PipelineEngine(), tmp_path, 3, {"step": 3}, rank=0)
    with pytest.raises(LaunchError, match="4 rank.*wrote the pipeline checkpoint step00000003, "
                                          "this run has 1.*consolidates it first"):
        checkpoint.load(PipelineEngine(), tmp_path, rank=0)
