"""The global planner: deterministic, resumable from JSON, elastic over the data-parallel size."""

import json

import pytest

from ds_omni.data.loader import GlobalPlanner, rank_share
from ds_omni.errors import DataError


def _planner(seed=0, weights=None):
    sizes = {"a": 50, "b": 7}
    return GlobalPlanner(sizes, weights or {"a": 3.0, "b": 1.0}, seed)


def test_same_seed_same_stream_and_every_row_once_per_epoch():
    p, q = _planner(), _planner()
    stream = [r for _ in range(10) for r in p.next(8)]
    assert stream == [r for _ in range(10) for r in q.next(8)]
    b_rows = [r.index for r in stream if r.source == "b"]
    for epoch_start in range(0, len(b_rows) - 7, 7):  # b (7 rows) cycles through whole epochs
        assert sorted(b_rows[epoch_start:epoch_start + 7]) == list(range(7))
    assert stream != [r for _ in range(10) for r in _planner(seed=1).next(8)]


def test_state_is_json_and_resumes_exactly():
    p = _planner()
    for _ in range(5):
        p.next(8)
    saved = json.loads(json.dumps(p.state))
    expected = [p.next(8) for _ in range(5)]
    q = _planner()
    q.state = saved
    assert [q.next(8) for _ in range(5)] == expected


def test_mixing_follows_weights():
    p = _planner(weights={"a": 3.0, "b": 1.0})
    stream = [r for _ in range(500) for r in p.next(20)]
    share_b = sum(r.source == "b" for r in stream) / len(stream)
    assert abs(share_b - 0.25) < 0.01


def test_rank_shares_partition_the_global_batch():
    refs = _planner().next(12)
    for dp in (1, 2, 3, 4, 6):
        shares = [rank_share(refs, r, dp) for r in range(dp)]
        assert [x for s in shares for x in s] == refs


def test_zero_weights_rejected():
    with pytest.raises(DataError, match="weights are 0"):
        GlobalPlanner({"a": 3}, {"a": 0.0}, 0)
