"""The loader of one data-parallel rank: global batches planned identically on every rank.

Every rank computes the same plan of the global batch (which source, which row) from the seed and
the global stream state; each rank then reads and preprocesses only its own share. The state is
global (not per rank), plain JSON and versioned, so a run resumes exactly, also under another
data-parallel size.

Plan of step k: each of the B slots picks a source by the mixing weights (a generator seeded with
(seed, k)); each source hands out rows in a per-epoch permutation (seeded with (seed, source, epoch))
and starts a new epoch when it runs out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_omni.data.packing import MicroBatch, pack
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.sources import Source
from ds_omni.errors import DataError

LOADER_STATE_VERSION = 1


@dataclass(frozen=True)
class SampleRef:
    """Where a sample lives: source name and row index."""

    source: str
    index: int

    def __str__(self) -> str:
        return f"{self.source}:{self.index}"


@dataclass
class StepBatch:
    """What one rank trains on in one optimizer step."""

    step: int
    micro_batches: list[MicroBatch]
    global_refs: list[SampleRef]  # the whole global batch, in plan order (same on every rank)


class GlobalPlanner:
    """Pure planning of global batches from the stream state (no I/O)."""

    def __init__(self, sizes: dict[str, int], weights: dict[str, float], seed: int):
        if not any(w > 0 for w in weights.values()):
            raise DataError("all data source weights are 0; give at least one a positive weight")
        self.names = list(sizes)
        self.sizes = sizes
        w = np.array([weights[n] for n in self.names], dtype=np.float64)
        self.probs = w / w.sum()
        self.seed = seed
        self._perm_cache: dict[tuple[str, int], np.ndarray] = {}
        self.state = {"step": 0, "sources": {n: {"epoch": 0, "cursor": 0} for n in self.names}}

    def _permutation(self, name: str, epoch: int) -> np.ndarray:
        key = (name, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 2 * len(self.names):
                self._perm_cache.clear()
            src = self.names.index(name)
            self._perm_cache[key] = np.random.default_rng([self.seed, src, epoch]).permutation(
                self.sizes[name])
        return self._perm_cache[key]

    def next(self, batch_size: int) -> list[SampleRef]:
        """The next global batch; advances the state."""
        rng = np.random.default_rng([self.seed, 1_000_003, self.state["step"]])
        choices = rng.choice(len(self.names), size=batch_size, p=self.probs)
        refs = []
        for c in choices:
            name = self.names[c]
            st = self.state["sources"][name]
            refs.append(SampleRef(name, int(self._permutation(name, st["epoch"])[st["cursor"]])))
            st["cursor"] += 1
            if st["cursor"] == self.sizes[name]:
                st["epoch"], st["cursor"] = st["epoch"] + 1, 0
        self.state["step"] += 1
        return refs


def rank_share(refs: list, dp_rank: int, dp_size: int) -> list:
    """Loader-order assignment: rank r takes the r-th contiguous block of the global batch."""
    per_rank = len(refs) // dp_size
    return refs[dp_rank * per_rank:(dp_rank + 1) * per_rank]


class OmniLoader:
    """Global batches -> this rank's packed micro-batches, with a JSON state."""

    def __init__(self, sources: list[Source], processors: dict[str, SampleProcessor], *,
                 global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int):
        self.sources = {s.name: s for s in sources}
        self.processors = processors  # source name -> its sample processor
        self.item_processors = next(iter(processors.values())).item_processors
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.planner = GlobalPlanner({s.name: len(s) for s in sources},
                                     {s.name: s.cfg.weight for s in sources}, seed)

    def next_step(self) -> StepBatch:
        step = self.planner.state["step"]
        refs = self.planner.next(self.global_batch_size)
        mine = rank_share(refs, self.dp_rank, self.dp_size)
        samples = [self._read(r) for r in mine]
        mbs = self.micro_batch_size
        micro = [pack(samples[i:i + mbs], self.item_processors)
                 for i in range(0, len(samples), mbs)]
        return StepBatch(step=step, micro_batches=micro, global_refs=refs)

    def _read(self, ref: SampleRef):
        source = self.sources[ref.source]
        text, media, sid = source.read(ref.index)
        return self.processors[ref.source](text=text, media=media, sample_id=sid, source=ref.source)

    # ------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Plain JSON: where the global stream stands, and the DP size it was written under."""
        return {"version": LOADER_STATE_VERSION, "dp_size": self.dp_size, "seed": self.planner.seed,
                "step": self.planner.state["step"],
                "sources": {n: dict(s) for n, s in self.planner.state["sources"].items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise DataError(f"loader state version {state.get('version')} is not supported "
                            f"(expected {LOADER_STATE_VERSION})")
        missing = sorted(set(self.planner.names) - set(state["sources"]))
        if missing:
            raise DataError(f"loader state has no position for source(s) {missing}; it was written "
                            "for other sources")
        self.planner.state = {"step": state["step"],
                              "sources": {n: dict(state["sources"][n]) for n in self.planner.names}}
