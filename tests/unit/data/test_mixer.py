"""Mixing weights: realised shares, schedules with ramps, live changes, exhausted sources."""

import collections

import pytest

from ds_omni.config import WeightPoint
from ds_omni.data.mixer import Mixer, MixSchedule
from ds_omni.errors import DataError


def _shares(picks):
    counts = collections.Counter(picks)
    return {k: v / len(picks) for k, v in counts.items()}


def test_realised_share_within_one_point_over_10k_samples():
    weights = {"caption": 5.0, "ocr": 3.0, "speech": 1.5, "video": 0.5}
    mixer = Mixer(MixSchedule(weights))
    picks = [p for step in range(625) for p in mixer.pick(step, 16)]  # 10,000 samples
    total = sum(weights.values())
    for name, share in _shares(picks).items():
        assert abs(share - weights[name] / total) < 0.01, name


def test_schedule_steps_and_linear_ramps():
    sched = MixSchedule({"a": 1.0, "b": 0.0}, [
        WeightPoint(step=10, weights={"a": 1.0, "b": 1.0}),
        WeightPoint(step=20, weights={"a": 0.0, "b": 1.0}, ramp="linear")])
    assert sched.weights_at(0) == {"a": 1.0, "b": 0.0}
    assert sched.weights_at(9) == {"a": 1.0, "b": 0.0}
    assert sched.weights_at(10) == {"a": 1.0, "b": 1.0}
    assert sched.weights_at(15) == pytest.approx({"a": 0.5, "b": 1.0})
    assert sched.weights_at(25) == {"a": 0.0, "b": 1.0}


def test_set_weights_applies_from_the_given_step_and_mix_follows():
    sched = MixSchedule({"a": 1.0, "b": 1.0})
    mixer = Mixer(sched)
    first = [p for s in range(50) for p in mixer.pick(s, 10)]
    sched.set_weights({"a": 9.0}, from_step=50)
    assert sched.weights_at(49) == {"a": 1.0, "b": 1.0} and sched.weights_at(50)["a"] == 9.0
    later = [p for s in range(50, 150) for p in mixer.pick(s, 10)]
    assert abs(_shares(first)["a"] - 0.5) < 0.01 and abs(_shares(later)["a"] - 0.9) < 0.01
    with pytest.raises(DataError, match="unknown source"):
        sched.set_weights({"zzz": 1.0}, from_step=3)


def test_dropped_source_leaves_the_mix_and_others_renormalise():
    mixer = Mixer(MixSchedule({"a": 1.0, "b": 1.0, "c": 2.0}))
    mixer.drop("c")
    picks = [p for s in range(100) for p in mixer.pick(s, 10)]
    assert "c" not in picks and abs(_shares(picks)["a"] - 0.5) < 0.01
    mixer.drop("a")
    mixer.drop("b")
    with pytest.raises(DataError, match="no data source left"):
        mixer.pick(100, 1)


def test_state_round_trip_reproduces_the_sequence():
    import json
    sched = MixSchedule({"a": 2.0, "b": 1.0, "c": 1.0})
    m1 = Mixer(sched)
    m1.pick(0, 7)
    state = json.loads(json.dumps(m1.state_dict()))
    m2 = Mixer(MixSchedule({"a": 2.0, "b": 1.0, "c": 1.0}))
    m2.load_state_dict(state)
    assert [m1.pick(s, 5) for s in range(1, 20)] == [m2.pick(s, 5) for s in range(1, 20)]
