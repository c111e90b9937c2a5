"""Mixing weights that change during training, and which source fills each sample slot.

`MixSchedule` gives the weights at any step: the base weights of the sources, changed by
`data.schedule` points (a jump, or a linear ramp from the previous point), and by `set_weights`
calls made while training (curriculum), which take effect from the next global batch.

`Mixer` turns weights into a sequence of sources by smooth weighted round robin: each source
earns its weight in credit per slot and the richest source takes the slot. Over n slots each
source's share is within one slot of its target (random draws would be off by ~sqrt(n)), and it is
deterministic, so the state is a few floats.
"""

from __future__ import annotations

from ds_omni.config import WeightPoint
from ds_omni.errors import DataError


class MixSchedule:
    """Weights by step: base weights, schedule points, and live overrides."""

    def __init__(self, base: dict[str, float], points: list[WeightPoint] | None = None):
        self.names = list(base)
        # each point: (step, weights, ramp); overrides from set_weights are "step" points
        self.points = [(0, dict(base), "step")]
        for p in points or []:
            self.points.append((p.step, dict(p.weights), p.ramp))

    def set_weights(self, weights: dict[str, float], from_step: int) -> None:
        """Change weights from `from_step` on (the next global batch when called between steps)."""
        unknown = sorted(set(weights) - set(self.names))
        if unknown:
            raise DataError(f"set_weights: unknown source(s) {unknown}; sources are {self.names}")
        if any(w < 0 for w in weights.values()):
            raise DataError(f"set_weights: weights must be >= 0, got {weights}")
        self.points = [p for p in self.points if p[0] < from_step] + [(from_step, dict(weights), "step")]

    def weights_at(self, step: int) -> dict[str, float]:
        current = dict(self.points[0][1])
        prev_step, prev = 0, dict(current)
        for at, weights, ramp in self.points[1:]:
            target = {**current, **weights}
            if step >= at:
                current, prev_step, prev = target, at, target
                continue
            if ramp == "linear" and step > prev_step:
                frac = (step - prev_step) / (at - prev_step)
                current = {n: prev[n] + frac * (target[n] - prev[n]) for n in self.names}
            break
        return current

    def state_dict(self) -> list:
        return [[at, weights, ramp] for at, weights, ramp in self.points]

    def load_state_dict(self, state: list) -> None:
        self.points = [(int(at), dict(w), ramp) for at, w, ramp in state]


class Mixer:
    """Which source each of a rank's sample slots comes from."""

    def __init__(self, schedule: MixSchedule):
        self.schedule = schedule
        self.credit = {n: 0.0 for n in schedule.names}
        self.dropped: set[str] = set()  # sources that left the mix (exhausted, policy "drop")

    def pick(self, step: int, n: int) -> list[str]:
        """Sources of the next `n` slots of global step `step`."""
        weights = {k: w for k, w in self.schedule.weights_at(step).items()
                   if w > 0 and k not in self.dropped}
        total = sum(weights.values())
        if total <= 0:
            raise DataError(f"no data source left to mix at step {step}: all weights are 0 or their "
                            f"sources are exhausted ({sorted(self.dropped)})")
        out = []
        for _ in range(n):
            for k, w in weights.items():
                self.credit[k] += w / total
            best = max(weights, key=lambda k: (self.credit[k], -self.schedule.names.index(k)))
            self.credit[best] -= 1.0
            out.append(best)
        return out

    def drop(self, name: str) -> None:
        self.dropped.add(name)
        self.credit[name] = 0.0

    def state_dict(self) -> dict:
        return {"credit": dict(self.credit), "dropped": sorted(self.dropped)}

    def load_state_dict(self, state: dict) -> None:
        self.credit = {n: float(state["credit"].get(n, 0.0)) for n in self.schedule.names}
        self.dropped = set(state["dropped"])
