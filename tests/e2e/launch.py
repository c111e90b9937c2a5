"""Run a real launcher (deepspeed, torchrun, accelerate, or ds-omni alone) with a hard timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ds_omni.parallel.dist import free_port
from tests.fixtures import ds_config, tiny_config_dict

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def write_configs(tmp_path: Path, stage: int = 2, **train) -> tuple[str, str, str]:
    """(config path, DeepSpeed config path, output dir) of a tiny run."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "run"
    cfg, ds = tmp_path / "cfg.json", tmp_path / "ds.json"
    cfg.write_text(json.dumps(tiny_config_dict(str(out), **{"log_samples": True, **train})))
    ds.write_text(json.dumps(ds_config(stage)))
    return str(cfg), str(ds), str(out)


def launcher_cmd(kind: str, nproc: int) -> list[str]:
    port = str(free_port())
    if kind == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port,
                "--module", "ds_omni"]
    if kind == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port,
                "-m", "ds_omni"]
    if kind == "accelerate":
        return [str(BIN / "accelerate"), "launch", "--config_file",
                str(REPO / "launch" / "accelerate_zero2.yaml"), "--num_processes", str(nproc),
                "--main_process_port", port, "-m", "ds_omni"]
    if kind == "single":
        return [str(BIN / "ds-omni")]
    raise ValueError(kind)


def run(cmd: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; on timeout kill the group and fail with its output."""
    full_env = {**os.environ, "DS_OMNI_DIST_TIMEOUT": "120", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout}s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def train(kind: str, nproc: int, config: str, ds: str | None, *extra: str,
          timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = launcher_cmd(kind, nproc) + ["train", "--config", config, *extra]
    if ds is not None:
        cmd += ["--deepspeed", ds]
    return run(cmd, timeout)
