"""Planted errors of the train layer: the watchdog and the compute calibration
(tests/unit/train/)."""

from tests.plants.registry import patched, plant


# ------------------------------------------------- the watchdog (tests/unit/train/test_watchdog.py)
@plant("watchdog_explain_at_once", "after a failed collective, the watchdog names a peer only "
       "from what it had seen when the error came (no fresh read, no second look)", "watchdog")
def _watchdog_explain_at_once(rank: int):
    from ds_omni.train.watchdog import Watchdog
    yield from patched(Watchdog, "explain", lambda f: lambda self, error: self.diagnose())


# -------------------- the simulator's compute calibration (tests/unit/train/test_calibrate_rate.py)
@plant("rate_fit_no_overhead", "the FLOP/s fit leaves out the fixed cost of a micro-batch (all of "
       "its seconds charged to FLOPs)", "calibrate_rate")
def _rate_fit_no_overhead(rank: int):
    import numpy as np
    from ds_omni.train import calibrate

    def make(nnls):
        return lambda a, y: np.array([nnls(a[:, :1], y)[0], 0.0])
    yield from patched(calibrate, "nnls", make)
