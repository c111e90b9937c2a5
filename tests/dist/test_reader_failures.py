"""A reader group's reader that dies or hangs (`ds_omni/data/shared_read.py`), over real
processes and gloo: its peer gets a `DataError` naming its rank and the reader's, never a hang.

Two ranks, parallel.tp=2 (one reader group of 2), the loader's own group as training builds it
(`parallel.groups.loader_shard_comm`). The loader's groups take the world's timeout
(`groups.world_timeout`, checked here against the harness's); a hang is shown with it shortened,
so the test does not wait the harness's whole timeout.
- killed: the reader is SIGKILLed before it sends: the peer's receive fails at once (gloo sees
  the connection close), well within the group's timeout;
- hung: the reader is alive and silent: the peer's receive fails when the group's timeout runs
  out (a new group's default would be 30 minutes).
"""

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.harness import RanksFailed, run_on_ranks

HARNESS_TIMEOUT = 90
HANG_TIMEOUT_S = 4.0


def _peer_receives(rank, world, case, out_dir):
    import torch.distributed as dist
    from ds_omni.data import shared_read
    from ds_omni.errors import DataError
    from ds_omni.parallel import groups
    from ds_omni.parallel.plan import ParallelPlan
    assert groups.world_timeout() == timedelta(seconds=HARNESS_TIMEOUT)
    if case == "hung":
        groups.world_timeout = lambda: timedelta(seconds=HANG_TIMEOUT_S)
    comm = groups.loader_shard_comm(ParallelPlan(world_size=2, dp=1, tp=2), rank)
    done = Path(out_dir) / f"{case}.json"
    dist.barrier()  # both made the group: the reader now stops answering
    if rank == 0:
        if case == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        while not done.exists():  # hung: alive and silent until its peer has given up
            time.sleep(0.1)
        return None
    start = time.monotonic()
    try:
        shared_read.receive(comm, dp_rank=0)
        message = None
    except DataError as e:
        message = str(e)
    done.write_text(json.dumps({"message": message, "waited": time.monotonic() - start}))
    return None


def _outcome(case: str, tmp_path) -> dict:
    try:
        run_on_ranks(_peer_receives, 2, args=(case, str(tmp_path)), timeout=HARNESS_TIMEOUT)
    except RanksFailed as e:
        if case != "killed":
            raise
        assert "exit codes [-9" in str(e), str(e)[-2000:]  # the reader was killed, as planned
    return json.loads((tmp_path / f"{case}.json").read_text())


@pytest.mark.dist
@pytest.mark.slow
def test_a_killed_reader_is_a_clear_error_at_once(tmp_path):
    got = _outcome("killed", tmp_path)
    assert got["message"] is not None, "the peer received a batch from a dead reader"
    assert "rank 1 of the reader group of data-parallel rank 0" in got["message"]
    assert "from the group's reader (rank 0)" in got["message"]
    assert "its process is gone" in got["message"]  # gloo says "closed" or "reset" by peer
    assert got["waited"] < HARNESS_TIMEOUT / 3, got  # not the group's timeout: gloo saw it die


@pytest.mark.dist
@pytest.mark.slow
def test_a_hung_reader_is_a_clear_error_after_the_groups_timeout(tmp_path):
    got = _outcome("hung", tmp_path)
    assert got["message"] is not None and "from the group's reader (rank 0)" in got["message"]
    assert "it sent nothing within the group's timeout" in got["message"]
    assert HANG_TIMEOUT_S - 0.5 < got["waited"] < HANG_TIMEOUT_S + 20, got
