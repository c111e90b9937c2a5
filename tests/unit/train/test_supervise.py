"""`ds-omni supervise` with stand-in runs: what it restarts, from where, what it logs, when it stops.
(Real launches under the supervisor, with a killed and a stopped rank: tests/e2e/test_resume.py.)"""

import json
import sys

from ds_omni.cli import main
from ds_omni.train import checkpoint
from ds_omni.train.supervise import Attempt, failure_cause, supervise
from tests.fake_engine import FakeEngine
from tests.fixtures import tiny_config_dict

CMD = ["deepspeed", "--module", "ds_omni", "train", "--config", "c.json"]


class Runs:
    """Stand-in attempts: each call saves a checkpoint (or not) and ends as scripted."""

    def __init__(self, out, script):
        self.out, self.script, self.commands = out, list(script), []

    def __call__(self, command):
        self.commands.append(command)
        code, tail, save_step = self.script.pop(0)
        if save_step is not None:
            checkpoint.save(FakeEngine(), self.out, save_step, {"step": save_step}, rank=0)
        return Attempt(code, tail)


def test_restarts_resume_from_the_newest_complete_checkpoint_and_are_logged(tmp_path, capsys):
    runs = Runs(tmp_path, [
        (1, ["RuntimeError: crash before any save"], None),
        (-9, ["ds-omni: rank 0: rank 1 is gone: pid 7 on this host has exited"], 10),
        (3, ["ds-omni: watchdog: rank 1: rank 0 sent no heartbeat for 9 s (killed, ...)"], 20),
        (0, [], None)])
    waits = []
    assert supervise(CMD, tmp_path, max_restarts=3, backoff=2, run=runs, sleep=waits.append) == 0
    assert runs.commands == [CMD, CMD, CMD + ["--resume"], CMD + ["--resume"]]
    assert waits == [2, 4, 8]  # doubling back-off
    log = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [e["resume_from"] for e in log] == [None, "step00000010", "step00000020"]
    assert [e["cause"] for e in log] == [
        "RuntimeError: crash before any save",
        "rank 0: rank 1 is gone: pid 7 on this host has exited",
        "rank 1: rank 0 sent no heartbeat for 9 s (killed, ...)"]
    err = capsys.readouterr().err
    assert "restart 3/3 in 8 s, from checkpoint step00000020" in err
    assert "succeeded after 3 restart(s)" in err


def test_gives_up_after_max_restarts_and_not_on_an_input_error(tmp_path, capsys):
    runs = Runs(tmp_path, [(1, ["Traceback", "OSError: disk"], None)] * 3)
    assert supervise(CMD, tmp_path, max_restarts=2, backoff=0, run=runs, sleep=lambda s: None) == 1
    assert len(runs.commands) == 3
    assert "giving up after 2 restart(s) (--max-restarts 2); last failure: OSError: disk" in \
        capsys.readouterr().err
    runs = Runs(tmp_path, [(2, ["ds-omni: error: data.sources[0].path 'x' does not exist"], None)])
    assert supervise(CMD, tmp_path, max_restarts=2, backoff=0, run=runs, sleep=lambda s: None) == 2
    assert len(runs.commands) == 1
    assert "not restarting" in capsys.readouterr().err


def test_failure_causes():
    assert failure_cause(["x", "ValueError: bad"], 1) == "ValueError: bad"
    assert failure_cause(["ds-omni: error: bad", "ValueError: later"], 2) == "bad"
    assert failure_cause([], -9) == "killed by SIGKILL"
    assert failure_cause(["nothing useful"], 7) == "exit code 7"


def test_the_command_line_runs_and_restarts_a_real_command(tmp_path, capsys):
    """Through `ds-omni supervise`: the output dir comes from the command's --config and --set;
    a command that fails once (a marker file) then succeeds is restarted once."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(tiny_config_dict(str(tmp_path / "ignored"))))
    out = tmp_path / "run"
    marker = tmp_path / "failed-once"
    script = ("import pathlib, sys; m = pathlib.Path(sys.argv[1]); "
              "m.exists() or (m.touch(), sys.exit('RuntimeError: first attempt fails'))")
    command = [sys.executable, "-c", script, str(marker), "--config", str(cfg),
               "--set", f'train.output_dir="{out}"']
    assert main(["supervise", "--backoff", "0", "--", *command]) == 0
    log = [json.loads(x) for x in (out / "restarts.jsonl").read_text().splitlines()]
    assert len(log) == 1 and log[0]["cause"] == "RuntimeError: first attempt fails"
    assert main(["supervise", "--"]) == 2
    assert "no command" in capsys.readouterr().err


def test_a_command_without_config_needs_output_dir(capsys):
    assert main(["supervise", "--", "true"]) == 2
    assert "pass --output-dir" in capsys.readouterr().err


def test_the_cause_survives_a_long_teardown_after_it():
    """A rank says why it ends, then the launcher and the other ranks print more than the tail
    holds (tracebacks, teardown logs): the cause is still the rank's line."""
    import sys
    from ds_omni.train.supervise import run_attempt
    script = ("import sys; print('step 3'); "
              "print('ds-omni: rank 1: terminated (SIGTERM); rank 0 is gone: has exited', "
              "file=sys.stderr); [print(f'teardown {i}') for i in range(200)]; sys.exit(247)")
    attempt = run_attempt([sys.executable, "-c", script], tail_lines=60)
    assert attempt.returncode == 247 and "teardown 199" in attempt.tail[-1]
    assert attempt.cause == "rank 1: terminated (SIGTERM); rank 0 is gone: has exited"
    assert attempt.retryable
