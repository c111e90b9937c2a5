"""The loader's first phase: read and measure this rank's samples from its sources.

The mixer picks a source for each of this rank's slots; each source's cursor streams this rank's
chunks (each read from its own position: a parquet row group, a jsonl byte offset); each row is
*measured* (tokens, encoder sequence lengths, modelled cost) without decoding its media. Bad rows
are skipped or raised by their source's policy, and counted; the rows read stay in memory until
the step loads them (or learns another rank does).
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from ds_omni.config import DataConfig
from ds_omni.data.cost import CostModel
from ds_omni.data.mixer import Mixer
from ds_omni.data.problems import kind_of
from ds_omni.data.processing import SampleProcessor, SampleSize
from ds_omni.data.rank_place import RankPlace
from ds_omni.data.sources import Locator, Source
from ds_omni.data.stream import SourceCursor
from ds_omni.data.workers import SampleFailure
from ds_omni.errors import DataError


@dataclass(frozen=True)
class Measured:
    """One read sample as the group sees it (no payload)."""

    key: str  # "<epoch>/<source>:<file>:<row>": unique while the sample is in flight
    tokens: int
    cost: float


@dataclass
class ReadCounts:
    """What this rank's loader read and processed since it was built: with one reader per SP
    group (`ds_omni.data.shared_read`) the peers' stay at zero, the evidence that only the
    reader did the work."""

    rows: int = 0  # rows read (streamed to be measured, or fetched to be loaded)
    bytes: int = 0  # their payload: text and media bytes (a media path counts its characters)
    items: int = 0  # encoder items processed: images, clips, videos decoded

    def read(self, row) -> None:
        self.rows += 1
        self.bytes += payload_bytes(row)


def payload_bytes(value) -> int:
    """Bytes of the text and media a row holds."""
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    return getattr(value, "nbytes", 0)


def key_locator(key: str) -> Locator:
    return Locator.parse(key.split("/", 1)[1])


class SampleReader:
    """This rank's streams, its mixer and its skipped samples. `problem` holds what stopped the
    current step's reading ("stop" or "error"), kept rather than raised: the group's all-gather
    still needs this rank."""

    def __init__(self, sources: dict[str, Source], processors: dict[str, SampleProcessor],
                 cost_model: CostModel, mixer: Mixer, cfg: DataConfig, place: RankPlace):
        self.sources, self.processors = sources, processors
        self.cost_model, self.mixer, self.cfg = cost_model, mixer, cfg
        self.dp_rank, self.dp_size = place.dp_rank, place.dp_size
        self.cursors = self.make_cursors()
        self.problem: dict[str, str] = {}
        self.rows: dict[str, dict] = {}  # rows this rank read that are still in flight
        self.skipped: dict[str, int] = {n: 0 for n in self.sources}
        self.skip_log: list[dict] = []  # skipped samples not yet written (see take_skipped)
        self._bad_run: dict[str, int] = {n: 0 for n in self.sources}  # bad rows in a row
        self.counts = ReadCounts()

    def make_cursors(self) -> dict[str, SourceCursor]:
        return {s.name: SourceCursor(s, i, self.dp_rank, self.dp_size, self.cfg.seed)
                for i, s in enumerate(self.sources.values())}

    def read(self, n: int, step: int) -> list[Measured]:
        """Measure up to `n` new samples of global step `step` from this rank's streams (skipping
        bad ones by policy).

        Fewer come back when every source has run dry, or after a problem, which is kept in
        `problem` rather than raised: the group's all-gather still needs this rank.
        """
        sized: list[tuple[str, SampleSize]] = []
        try:
            self._read_into(sized, n, step)
        except _StopData as e:
            self.problem.setdefault("stop", str(e))
        except Exception as e:
            self.problem.setdefault("error", self.failure(e, "reading samples"))
        costs = self._costs([size for _, size in sized])
        return [Measured(key, size.tokens, c) for (key, size), c in zip(sized, costs)]

    def _read_into(self, out: list, n: int, step: int) -> None:
        if self.problem:
            return
        for name in self._pick(n, step):
            while name is not None:
                got = self._read_one(name, step)
                if got is not None:
                    out.append(got)
                    break
                if name in self.mixer.dropped:  # exhausted and left the mix: another source
                    name = next(iter(self._pick(1, step)), None)

    def _pick(self, n: int, step: int) -> list[str]:
        if self._dry():
            return []
        return self.mixer.pick(step, n)

    def _dry(self) -> bool:
        """Every source has left the mix (on_exhausted="drop")."""
        return len(self.mixer.dropped) == len(self.sources)

    def _read_one(self, name: str, step: int) -> tuple[str, SampleSize] | None:
        cursor, source = self.cursors[name], self.sources[name]
        got = cursor.next()
        if got is None:
            self._exhausted(name)
            return None
        loc, row = got
        self.counts.read(row)
        try:
            text, media, sid = source.parts(row, loc)
            size = self.processors[name].measure(text=text, media=media, sample_id=sid, source=name)
        except DataError as e:
            self.bad(name, source.sample_id(row, loc), source.explain(e, row), str(loc), step)
            self._bad_run[name] += 1
            bound = min(self.cfg.max_bad_run, len(source))
            if self._bad_run[name] >= bound:
                raise DataError(f"data source '{name}' gave {self._bad_run[name]} bad samples in a "
                                f"row and no good one (data.max_bad_run={self.cfg.max_bad_run}, "
                                f"{len(source)} rows); the last: {e}. Run `ds-omni data check` "
                                "to see every problem of the source") from None
            return None
        self._bad_run[name] = 0
        key = f"{cursor.epoch}/{loc}"
        self.rows[key] = row
        return key, size

    def bad(self, name: str, sample_id: str, error: DataError, locator: str, step: int) -> None:
        """A bad sample: raise under on_bad_sample="error", else count and log it."""
        if self.sources[name].cfg.on_bad_sample == "error":
            raise DataError(f"{error}. To skip such samples instead, set data.sources[{name}]."
                            "on_bad_sample to \"skip\" (their ids then go to "
                            "<output_dir>/skipped.jsonl)") from None
        self.skipped[name] += 1
        self.skip_log.append({"id": sample_id, "source": name, "locator": locator,
                              "step": step, "kind": kind_of(error), "reason": str(error)})

    def take_skipped(self) -> list[dict]:
        """The samples skipped since the last call (id, source, step, kind, reason)."""
        out, self.skip_log = self.skip_log, []
        return out

    def _costs(self, sizes: list[SampleSize]) -> list[float]:
        """Modelled cost of each sample, in one vectorised call."""
        if not sizes:
            return []
        passes = [(i, enc, n) for i, size in enumerate(sizes) for enc, n in size.encoder_seqs]
        return self.cost_model.sample_costs(
            np.array([size.tokens for size in sizes]), np.array([i for i, _, _ in passes], dtype=np.int64),
            np.array([e for _, e, _ in passes], dtype=str),
            np.array([n for _, _, n in passes], dtype=np.int64)).tolist()

    def _exhausted(self, name: str) -> None:
        policy = self.sources[name].cfg.on_exhausted
        if policy == "repeat":
            self.cursors[name].next_epoch()
        elif policy == "drop":
            self.mixer.drop(name)
        else:
            raise _StopData(f"data source '{name}' is exhausted (on_exhausted='stop')")

    def forget(self, keys) -> None:
        """Drop rows read here that another rank loads (it reads them itself)."""
        for k in keys:
            self.rows.pop(k, None)

    def local_state(self) -> dict:
        """This rank's cursors, chunking, mixer and skip counts (plain data)."""
        return {"cursors": {n: c.state_dict() for n, c in self.cursors.items()},
                "chunk_rows": {n: s.chunk_rows for n, s in self.sources.items()},
                "mixer": self.mixer.state_dict(), "skipped": dict(self.skipped)}

    def failure(self, e: Exception | SampleFailure, doing: str) -> str:
        """The message of an exception raised while `doing`, for every rank; an unexpected one
        (not a DataError) also prints its traceback here, on the rank where it happened (a
        `SampleFailure` brings that of the process it happened in)."""
        if isinstance(e, DataError):
            return str(e)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        who = f"the data loader of rank {rank} (data-parallel rank {self.dp_rank})"
        failed = isinstance(e, SampleFailure)
        print(f"ds-omni: {who} failed while {doing}:\n"
              f"{e.traceback if failed else traceback.format_exc()}", file=sys.stderr, flush=True)
        what = e.message if failed else f"{type(e).__name__}: {e}"
        return f"{who} failed while {doing}: {what} (traceback in that rank's log)"


class _StopData(Exception):
    """A source is exhausted under on_exhausted="stop"."""
