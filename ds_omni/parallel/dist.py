"""Thin wrappers over the process group: start-up from any launcher, and a few collectives.

Works under `deepspeed`, `torchrun` and `accelerate launch` (all set RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT) and as a plain single process (one is made up here, on a free port).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_omni.errors import LaunchError


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# gloo's words when a peer's process is gone (which one it says depends on when it looked)
PEER_GONE_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_gone(error: BaseException) -> bool:
    """Whether a failed collective says that the connection to a peer closed: its process died."""
    return any(w in str(error) for w in PEER_GONE_WORDS)


BACKENDS = {"cuda": "nccl", "cpu": "gloo"}  # accelerator -> process-group backend


def backend_for(device_type: str, accelerator_default: str) -> str:
    """The process-group backend: NCCL on CUDA GPUs, gloo on CPU, else the accelerator's own."""
    return BACKENDS.get(device_type, accelerator_default)


def local_device_index(device_type: str, local_rank: int, device_count: int) -> int:
    """The accelerator this process drives: its LOCAL_RANK; a rank with no device of its own is
    an error, not a second process on device 0."""
    if local_rank >= device_count:
        raise LaunchError(f"LOCAL_RANK={local_rank} but this node has {device_count} {device_type} "
                          f"device(s) visible; start at most {device_count} processes per node "
                          "(e.g. deepspeed --num_gpus / torchrun --nproc_per_node), or check "
                          "CUDA_VISIBLE_DEVICES")
    return local_rank


def timeout_s() -> float:
    """How long a collective (or a loader process) may keep a rank waiting: the environment's
    `DS_OMNI_DIST_TIMEOUT` in seconds, 1800 unset."""
    return float(os.environ.get("DS_OMNI_DIST_TIMEOUT", 1800.0))


def init_distributed(timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join (or, alone, create) the default process group; returns (rank, world size).

    The backend follows the accelerator DeepSpeed picked (`backend_for`), with no user setting;
    on a GPU the process first takes its own device, so the collectives that run before
    `deepspeed.initialize` (barriers, token counts) do not all land on GPU 0. `timeout_s` bounds
    every collective, so one failed rank cannot keep the others waiting long.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    accel = get_accelerator()
    kind = accel.device_name()
    if kind != "cpu":
        accel.set_device(local_device_index(kind, int(os.environ.get("LOCAL_RANK", "0")),
                                            accel.device_count()))
    else:
        skip_shm_op()
    if not dist.is_initialized():
        deepspeed.init_distributed(backend_for(kind, accel.communication_backend_name()),
                                   timeout=timedelta(seconds=timeout_s), verbose=False)
    return dist.get_rank(), dist.get_world_size()


def skip_shm_op() -> None:
    """On CPU, DeepSpeed's process-group wrapper JIT-compiles a shared-memory all-reduce op at
    start-up (30-60 s, the first time on a machine) that only its *inference* all-reduce uses;
    ZeRO and the pipeline engine never call it. Marked unavailable, start-up skips the build and
    every collective goes through torch.distributed (gloo), as it does anyway in training."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum a few numbers over `group` (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


def all_reduce_max(values: list[float], group=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def comm_device() -> torch.device:
    """The device collectives run on: the accelerator DeepSpeed picked (CPU under gloo)."""
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
