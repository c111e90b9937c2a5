"""The data worker pool on its own: one reply per map, whichever thread maps, and a worker's
error reaches the caller as that error."""

import threading

import pytest

from ds_omni.data.workers import FEED_WORKERS_PER_GPU, WorkerPool, resolve_workers
from ds_omni.errors import DataError


def _square(x):
    return x * x  # a str job raises TypeError in the worker


def test_maps_from_two_threads_each_get_their_own_reply():
    """The prefetch thread maps while another caller maps too (the loader test does): each
    gets its own results or its own error, never the other's reply or a worker ended under it."""
    pool = WorkerPool(_square, 1, timeout_s=60)
    got = {"good": [], "bad": []}

    def good():
        for i in range(40):
            got["good"].append(pool.map([i, i + 1]))

    def bad():
        for _ in range(40):
            try:
                pool.map(["not a number"])
                got["bad"].append("no error")
            except DataError as e:
                got["bad"].append(str(e))
    threads = [threading.Thread(target=f) for f in (good, bad)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert got["good"] == [[i * i, (i + 1) ** 2] for i in range(40)]
        assert len(got["bad"]) == 40
        assert all(e.startswith("a data worker failed: TypeError") for e in got["bad"]), \
            got["bad"][:3]
    finally:
        pool.close()


def test_a_job_the_worker_cannot_unpickle_is_its_error_not_its_death():
    pool = WorkerPool(_square, 1, timeout_s=60)
    try:
        with pytest.raises(DataError, match="a data worker failed: .*Error"):
            pool.map([_Unloadable()])
        assert pool.map([3]) == [9]  # the worker is still there
    finally:
        pool.close()


class _Unloadable:
    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("this job cannot be rebuilt in the worker")


def test_auto_workers_follow_the_feed_rate_and_the_cores():
    assert resolve_workers(3, cuda=True) == 3 and resolve_workers(0, cuda=True) == 0
    assert resolve_workers("auto", cuda=False, cores=64, local_ranks=1) == 0  # CPU runs, tests
    assert resolve_workers("auto", cuda=True, cores=128, local_ranks=8) == FEED_WORKERS_PER_GPU == 2
    assert resolve_workers("auto", cuda=True, cores=16, local_ranks=8) == 1  # 2 cores a rank
    assert resolve_workers("auto", cuda=True, cores=8, local_ranks=8) == 0  # 1: the trainer's
