"""Output folders and resumes: a run never loses another run's checkpoints to a missing
--resume, --resume never mixes two runs in one folder (and says which it follows), and a disk
that fills during a checkpoint is named as such, its temporary folder removed, the previous
checkpoint kept."""

import errno
import json
from pathlib import Path

import pytest

from ds_omni.errors import LaunchError
from ds_omni.train import checkpoint, runs
from ds_omni.train.supervise import resume_command
from tests.bad_input.common import config, refused, says, snapshot, train, write
from tests.fake_engine import FakeEngine


def _saved(out: Path, *steps: int) -> Path:
    """`out` holding complete checkpoints of `steps` (one run)."""
    for step in steps:
        checkpoint.save(FakeEngine(), out, step, {"step": step}, rank=0)
    return out


def _incomplete(out: Path, step: int) -> Path:
    (out / "checkpoints" / checkpoint.tag_for(step)).mkdir(parents=True)  # a save cut short
    return out


def _legacy(out: Path, step: int) -> Path:
    """A checkpoint from before manifests and run ids: named by `latest`."""
    _saved(out, step)
    tag = out / "checkpoints" / checkpoint.tag_for(step)
    (tag / checkpoint.MANIFEST).unlink()
    state = json.loads((tag / "trainer_state.json").read_text())
    del state["run_id"]
    (tag / "trainer_state.json").write_text(json.dumps(state))
    (out / runs.RUN_FILE).unlink()
    return out


START_CASES = {  # name: (make the output dir, extra args, overwrite, refusal words or "started")
    "holds_checkpoints": (lambda o: _saved(o, 1, 3), [], False,
                          ["already holds the checkpoints of a run", "newest: step00000003, step 3",
                           "Pass --resume", "another folder", "train.overwrite_output_dir: true"]),
    "holds_a_legacy_checkpoint": (lambda o: _legacy(o, 2), [], False,
                                  ["already holds the checkpoints", "step00000002"]),
    "holds_checkpoints_overwrite": (lambda o: _saved(o, 1), [], True, "started"),
    "holds_checkpoints_resume": (lambda o: _saved(o, 1), ["--resume"], False, "started"),
    "holds_only_a_save_cut_short": (lambda o: _incomplete(o, 2), [], False, "started"),
    "exists_empty": (lambda o: o.mkdir(parents=True) or o, [], False, "started"),
    "resume_with_nothing": (lambda o: o, ["--resume"], False,
                            ["--resume: no checkpoint in", "start without --resume"]),
    "resume_with_a_save_cut_short": (lambda o: _incomplete(o, 2), ["--resume"], False,
                                     ["no complete checkpoint in", "step00000002",
                                      "no manifest.json"]),
}


@pytest.mark.parametrize("name", sorted(START_CASES))
def test_starting_in_an_output_folder(tmp_path, capsys, no_training, name):
    make, extra, overwrite, words = START_CASES[name]
    out = tmp_path / "out"
    make(out)
    before = snapshot(out)
    cfg = config(out, overwrite_output_dir=overwrite)
    if words == "started":
        assert train(capsys, *write(tmp_path, cfg), *extra)[0] == "started"
    else:
        says(refused(capsys, *write(tmp_path, cfg), *extra), *words)
    assert snapshot(out) == before  # the checks write nothing: the earlier run is untouched


@pytest.mark.parametrize("where", ["a_file", "below_a_file"])
def test_output_folder_that_cannot_be_written(tmp_path, capsys, no_training, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if where == "a_file" else blocker / "run"
    says(refused(capsys, *write(tmp_path, config(out)), "--resume"), "output directory",
         "is not writable", "set train.output_dir")
    assert blocker.read_text() == "x"


def _two_runs(out: Path) -> None:
    """Run A saved steps 1-4; run B, started there with train.overwrite_output_dir, steps 1-2."""
    _saved(out, 1, 2, 3, 4)
    checkpoint.start_run(out)
    _saved(out, 1, 2)


def test_resume_follows_the_current_run_not_the_highest_step(tmp_path, capsys):
    _two_runs(tmp_path)
    run_b = (tmp_path / runs.RUN_FILE).read_text()
    assert checkpoint.load(FakeEngine(), tmp_path, rank=0) == (2, {"step": 2})
    out = capsys.readouterr().out
    says(out, "passing over checkpoint step00000004: written by an earlier run",
         f"resuming run {run_b} from", "step00000002' (step 2)")
    assert resume_command(["ds-omni", "train"], tmp_path)[1] == "step00000002"  # supervise too


def test_resume_follows_latest_where_no_run_file_says(tmp_path, capsys):
    """A folder whose run_id file is gone: the run of the checkpoint `latest` names."""
    _two_runs(tmp_path)
    (tmp_path / runs.RUN_FILE).unlink()
    assert checkpoint.load(FakeEngine(), tmp_path, rank=0)[0] == 2


def test_resume_of_a_new_run_without_checkpoints_does_not_take_the_old_runs(tmp_path, capsys):
    _saved(tmp_path, 1, 2)
    checkpoint.start_run(tmp_path)
    with pytest.raises(LaunchError) as e:
        checkpoint.load(FakeEngine(), tmp_path, rank=0)
    says(str(e.value), "no complete checkpoint", "step00000002: written by an earlier run")


def test_resume_of_checkpoints_from_before_run_ids(tmp_path, capsys):
    _legacy(tmp_path, 3)
    assert checkpoint.load(FakeEngine(), tmp_path, rank=0)[0] == 3
    run = (tmp_path / runs.RUN_FILE).read_text()  # the run goes on under an id from now on
    _saved(tmp_path, 4)
    assert checkpoint.load(FakeEngine(), tmp_path, rank=0)[0] == 4
    assert runs.checkpoint_run(tmp_path / "checkpoints" / "step00000004") == run


class _Engine(FakeEngine):
    def __init__(self, fail: BaseException | None):
        super().__init__()
        self.fail = fail

    def save_checkpoint(self, root, tag, save_latest=True):
        if self.fail is not None:
            (Path(root) / tag / "mp_rank_00_model_states.pt").write_bytes(b"half")
            raise self.fail
        super().save_checkpoint(root, tag, save_latest)


DISK_FULL = {  # name: (what the save raises, where)
    "enospc_from_deepspeed": (OSError(errno.ENOSPC, "No space left on device"), "engine"),
    "edquot_from_deepspeed": (OSError(errno.EDQUOT, "Disk quota exceeded"), "engine"),
    "torch_unexpected_pos": (RuntimeError("[enforce fail at inline_container.cc:664] . "
                                          "unexpected pos 3200 vs 3136"), "engine"),
    "enospc_from_rng_file": (OSError(errno.ENOSPC, "No space left on device"), "torch.save"),
}


@pytest.mark.parametrize("name", sorted(DISK_FULL))
def test_a_full_disk_during_a_checkpoint_is_named(tmp_path, monkeypatch, name):
    error, where = DISK_FULL[name]
    _saved(tmp_path, 1)
    before = snapshot(tmp_path / "checkpoints")
    engine = _Engine(error if where == "engine" else None)
    if where == "torch.save":
        def full(*args, **kwargs):
            raise error
        monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(LaunchError) as e:
        checkpoint.save(engine, tmp_path, 2, {"step": 2}, rank=0)
    root = tmp_path / "checkpoints"
    says(str(e.value), f"no space left on device at {str(root)!r}",
         "the checkpoint needs about 1 MB", "Free space", "--resume")
    assert not (root / ".step00000002.tmp").exists()  # not left holding the space
    assert snapshot(root) == before  # the last complete checkpoint and `latest` untouched


def test_another_os_error_during_a_checkpoint_is_not_called_a_full_disk(tmp_path):
    with pytest.raises(PermissionError):
        checkpoint.save(_Engine(PermissionError(errno.EACCES, "Permission denied")), tmp_path, 1,
                        {"step": 1}, rank=0)
