"""Data sources: local files read with HF `datasets`, and the schema that maps their columns.

A source resolves its path (a file, a glob, a directory of shards, a `save_to_disk` directory, or
"builtin:shapes"), fails at start-up if nothing is there, and hands out rows by index as
(text, media, sample id) through its schema.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from ds_omni.config import SourceConfig
from ds_omni.data import demo
from ds_omni.data.processing import load_image
from ds_omni.errors import DataError

FORMAT_BY_SUFFIX = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow",
                    ".tar": "webdataset"}


def resolve_files(cfg: SourceConfig) -> tuple[str, list[str] | str]:
    """(format, files) of a source; a `save_to_disk` directory is ("disk", its path)."""
    path = str(demo.ensure_builtin(cfg.path, "dataset")) if demo.is_builtin(cfg.path) else cfg.path
    p = Path(path)
    if p.is_dir() and (p / "dataset_info.json").exists() and (p / "state.json").exists():
        return "disk", str(p)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.suffix in FORMAT_BY_SUFFIX)
    else:
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path] * p.is_file()
    if not files:
        raise DataError(f"data source '{cfg.name}': no data at {path!r} (resolved to "
                        f"{str(p.resolve())!r}); give a file, a glob, a directory of parquet/jsonl/"
                        "arrow/tar shards, a save_to_disk directory, or builtin:shapes")
    fmt = cfg.format
    if fmt == "auto":
        suffixes = {Path(f).suffix for f in files}
        fmts = {FORMAT_BY_SUFFIX[s] for s in suffixes if s in FORMAT_BY_SUFFIX}
        if len(fmts) != 1:
            raise DataError(f"data source '{cfg.name}': cannot infer one format from {sorted(suffixes)}; "
                            "set 'format'")
        fmt = fmts.pop()
    return fmt, files


class Source:
    """One source as indexable rows, with its schema applied."""

    def __init__(self, cfg: SourceConfig, cache_dir: str | None = None):
        import datasets
        self.cfg = cfg
        self.name = cfg.name
        fmt, files = resolve_files(cfg)
        cache_dir = cache_dir or str(demo.default_cache_dir() / "hf_datasets")
        if fmt == "disk":
            self.dataset = datasets.load_from_disk(files)
        else:
            self.dataset = datasets.load_dataset(fmt, data_files=files, split="train",
                                                 cache_dir=cache_dir)
        self._check_columns()

    def _check_columns(self) -> None:
        schema = self.cfg.schema
        wanted = [c for c in (schema.text, schema.image, schema.audio) if c]
        missing = [c for c in wanted if c not in self.dataset.column_names]
        if missing:
            raise DataError(f"data source '{self.name}': column(s) {missing} not found; it has "
                            f"{self.dataset.column_names}. Fix data.sources[].schema")

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_id(self, index: int, row: dict | None = None) -> str:
        col = self.cfg.schema.id
        if col and col in self.dataset.column_names:
            row = row if row is not None else self.dataset[index]
            return f"{self.name}/{row[col]}"
        return f"{self.name}/{index}"

    def read(self, index: int) -> tuple[Any, dict[str, list], str]:
        """Row `index` as (text, {"vision": [PIL images], "audio": [clips]}, sample id)."""
        row = self.dataset[index]
        sid = self.sample_id(index, row)
        schema = self.cfg.schema
        media: dict[str, list] = {}
        if schema.image and row.get(schema.image) is not None:
            images = row[schema.image]
            images = images if isinstance(images, list) else [images]
            media["vision"] = [load_image(x, schema.root, f"source '{self.name}' sample {sid}")
                               for x in images]
        if schema.audio and row.get(schema.audio) is not None:
            clips = row[schema.audio]
            media["audio"] = clips if isinstance(clips, list) else [clips]
        return row[schema.text], media, sid

