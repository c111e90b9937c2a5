"""Changing mixing weights while a run trains: edit `<output_dir>/mix_weights.json`.

    echo '{"captions": 1.0, "ocr": 3.0}' > outputs/run/mix_weights.json

Before each step rank 0 looks at the file's modification time; a new version is broadcast to every
rank and applied from the next global batch (`OmniLoader.set_weights`), so all ranks switch at the
same step. A file that does not parse or names unknown sources is reported and ignored: a typo
must not end a long run. The weights in force are part of the checkpointed data state.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from ds_omni.errors import DataError

FILE_NAME = "mix_weights.json"


class WeightsFile:
    def __init__(self, output_dir: str | Path, rank: int):
        self.path = Path(output_dir) / FILE_NAME
        self.rank = rank
        self.seen = self._mtime()

    def _mtime(self) -> float | None:
        return self.path.stat().st_mtime if self.path.exists() else None

    def _read(self):
        """(weights or None, message) on rank 0."""
        mtime = self._mtime()
        if mtime is None or mtime == self.seen:
            return None, None
        self.seen = mtime
        try:
            weights = json.loads(self.path.read_text())
        except json.JSONDecodeError as e:
            return None, f"ignored {self.path}: not valid JSON ({e})"
        if not isinstance(weights, dict):
            return None, f"ignored {self.path}: expected an object of source name -> weight"
        return weights, None

    def poll(self, loader) -> dict | None:
        """Apply a changed file on every rank (collective); the new weights, or None."""
        weights, message = self._read() if self.rank == 0 else (None, None)
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [weights]
            dist.broadcast_object_list(box, src=0)
            weights = box[0]
        if message and self.rank == 0:
            print(f"ds-omni: {message}")
        if weights is None:
            return None
        try:
            loader.set_weights({k: float(v) for k, v in weights.items()})
        except (DataError, TypeError, ValueError) as e:
            if self.rank == 0:
                print(f"ds-omni: ignored {self.path}: {e}")
            return None
        if self.rank == 0:
            print(f"ds-omni: mixing weights from step {loader.step}: {weights}")
        return weights
