"""The simulator's link calibration (`ds_omni/sim/calibrate_comm.py`): the alpha-beta fit
recovers known coefficients from synthetic timings written in `sim/comm.py`'s own formulas (the
oracle: comm.py's ring and all-to-all times, not the fit's `terms`), and a fitted cluster file
is what `cluster()` loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds_omni.errors import ConfigError
from ds_omni.sim import comm
from ds_omni.sim.calibrate_comm import Timing, cluster_fields, fit_alpha_beta, fit_report
from ds_omni.sim.cluster import cluster
from tests import plants

ALPHA, BETA = 4e-4, 6e8  # 0.4 ms a message, 600 MB/s: this machine's order of magnitude


def _synthetic(noise: float = 0.0, seed: int = 0) -> list[Timing]:
    """Timings of every op at 2 and 4 ranks and sizes 4 KiB .. 4 MiB, as comm.py times them."""
    rng = np.random.default_rng(seed)
    link = comm.Link(ALPHA, BETA)
    machines = cluster("cpu", 4, 4, intra_latency=ALPHA, intra_bw=BETA)
    out = []
    for p in (2, 4):
        for n in (2 ** 12, 2 ** 16, 2 ** 19, 2 ** 22):
            sends = np.full((p, p), n / p)  # even all-to-all: each rank sends n (p-1)/p off-rank
            times = {"all_reduce": comm.ring_all_reduce(n, p, link),
                     "all_gather": comm.all_gather(n, p, link),
                     "reduce_scatter": comm.reduce_scatter(n, p, link),
                     "all_to_all": comm.all_to_all(sends, range(p), machines)}
            moved = {"all_to_all": int(n * (p - 1) / p)}
            out += [Timing(op, p, moved.get(op, n), t * (1 + noise * rng.standard_normal()))
                    for op, t in times.items()]
    return out


def test_fit_recovers_known_alpha_and_beta():
    alpha, beta = fit_alpha_beta(_synthetic())
    assert alpha == pytest.approx(ALPHA, rel=1e-9)
    assert beta == pytest.approx(BETA, rel=1e-9)


def test_fit_under_noise_stays_close():
    alpha, beta = fit_alpha_beta(_synthetic(noise=0.05))
    assert alpha == pytest.approx(ALPHA, rel=0.15)
    assert beta == pytest.approx(BETA, rel=0.15)


def _fit_ok() -> bool:
    alpha, beta = fit_alpha_beta(_synthetic())
    return abs(alpha / ALPHA - 1) < 1e-6 and abs(beta / BETA - 1) < 1e-6


@pytest.mark.parametrize("name", plants.for_launch("calibrate_comm"))
def test_plant_is_caught_by_the_fit_test(name):
    assert _fit_ok()
    with plants.applied(name, 0):
        assert not _fit_ok(), f"plant {name} went unseen by the alpha-beta fit test"
    assert _fit_ok()


def test_fit_refuses_too_few_or_shrinking_timings():
    with pytest.raises(ConfigError, match=">= 2 timings"):
        fit_alpha_beta(_synthetic()[:1])
    shrinking = [Timing("all_reduce", 2, 2 ** 12, 1e-2), Timing("all_reduce", 2, 2 ** 22, 1e-3)]
    with pytest.raises(ConfigError, match="no bandwidth term"):
        fit_alpha_beta(shrinking)


def test_fitted_cluster_file_loads(tmp_path):
    report = fit_report(_synthetic())
    assert report["max_rel_error"] < 1e-9
    path = tmp_path / "cpu_cluster.json"
    path.write_text(json.dumps({"cluster": cluster_fields(report)}))
    c = cluster(str(path), 4, 4, flops=1.0)
    assert c.intra_latency == pytest.approx(ALPHA) and c.intra_bw == pytest.approx(BETA)
    assert c.flops == 1.0 and c.name == "cpu"
    path.write_text(json.dumps({"preset": "cpu", "intra_bandwidth": 1.0}))
    with pytest.raises(ConfigError, match="intra_bandwidth"):
        cluster(str(path), 4, 4)
