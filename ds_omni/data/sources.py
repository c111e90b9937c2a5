"""Data sources: local files streamed with HF `datasets`, plus random access by locator.

A source is a list of files of one format (parquet, jsonl, arrow, webdataset tar, or one
`save_to_disk` directory), cut into fixed chunks of rows. A data-parallel rank reads its own chunks
sequentially through HF `datasets` streaming (`load_dataset(..., streaming=True)` with media left
undecoded). Every row has a `Locator` (source, file, row), so after grouped reordering the rank a
sample is assigned to reads that one row itself (`Source.fetch`): no payload crosses ranks.

Random access per format: parquet by row group (pyarrow), arrow and save_to_disk through datasets'
memory map, jsonl through a sparse line-offset index, tar through a member index; each index is
built lazily, only for the files a rank touches.
"""

from __future__ import annotations

import bisect
import functools
import glob
import json
import tarfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

from ds_omni.config import SourceConfig
from ds_omni.data import demo
from ds_omni.errors import DataError

FORMAT_BY_SUFFIX = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow",
                    ".tar": "webdataset"}
JSON_INDEX_STRIDE = 256  # jsonl: remember every 256th line start


@dataclass(frozen=True)
class Locator:
    """Where one sample lives."""

    source: str
    file: int  # index into the source's sorted file list
    row: int  # row within that file

    def __str__(self) -> str:
        return f"{self.source}:{self.file}:{self.row}"

    @classmethod
    def parse(cls, text: str) -> "Locator":
        source, file, row = text.rsplit(":", 2)
        return cls(source, int(file), int(row))


@dataclass(frozen=True)
class Chunk:
    """A run of rows of one file: the unit a rank streams and the unit of the data state."""

    file: int
    start: int
    stop: int


def resolve_files(cfg: SourceConfig) -> tuple[str, list[str]]:
    """(format, files) of a source; a `save_to_disk` directory is ("disk", [its path])."""
    path = str(demo.ensure_builtin(cfg.path, "dataset")) if demo.is_builtin(cfg.path) else cfg.path
    p = Path(path)
    if p.is_dir() and (p / "dataset_info.json").exists() and (p / "state.json").exists():
        return "disk", [str(p)]
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
        fmts = {FORMAT_BY_SUFFIX.get(s) for s in suffixes}
        if len(fmts) != 1 or None in fmts:
            raise DataError(f"data source '{cfg.name}': cannot infer one format from "
                            f"{sorted(suffixes)}; set 'format'")
        fmt = fmts.pop()
    return fmt, files


def lookup(row: dict, column: str) -> Any:
    """`row[column]`; "a.b" looks inside nested dicts (webdataset: "json.conversations")."""
    if column in row:
        return row[column]
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


class Source:
    """One source: its files, their row counts and chunks, streaming and random access."""

    def __init__(self, cfg: SourceConfig, chunk_rows: int = 1024):
        self.cfg = cfg
        self.name = cfg.name
        self.fmt, self.files = resolve_files(cfg)
        self.chunk_rows = chunk_rows
        self._readers: dict[int, Any] = {}
        self._streams: dict[int, Any] = {}  # file -> its HF IterableDataset (built once)

    # ----------------------------------------------------------------------------- layout
    @cached_property
    def file_rows(self) -> list[int]:
        """Rows per file, from metadata where the format has it (nothing stays open)."""
        return [self._count(i) for i in range(len(self.files))]

    def _count(self, f: int) -> int:
        if self.fmt == "parquet":
            import pyarrow.parquet as pq
            try:
                return pq.read_metadata(self.files[f]).num_rows
            except (OSError, ValueError) as e:
                raise DataError(f"data source '{self.name}': cannot read {self.files[f]!r} as "
                                f"parquet ({e})") from None
        return self._reader(f).num_rows

    def set_chunk_rows(self, chunk_rows: int) -> None:
        self.chunk_rows = chunk_rows
        self.__dict__.pop("chunks", None)

    def fit_chunks(self, dp: int, per_rank: int = 4) -> None:
        """Smaller chunks for a small source, so every rank of `dp` gets about `per_rank` of them."""
        self.set_chunk_rows(max(1, min(self.chunk_rows, len(self) // (dp * per_rank))))

    @cached_property
    def chunks(self) -> list[Chunk]:
        """Every chunk of every file, in file order (each at most `chunk_rows` rows)."""
        out = []
        for f, rows in enumerate(self.file_rows):
            out += [Chunk(f, s, min(s + self.chunk_rows, rows)) for s in range(0, rows, self.chunk_rows)]
        if not out:
            raise DataError(f"data source '{self.name}' has no rows ({len(self.files)} files)")
        return out

    def __len__(self) -> int:
        return sum(self.file_rows)

    # ----------------------------------------------------------------------------- reading
    def stream(self, chunk: Chunk, start: int) -> Iterator[tuple[Locator, dict]]:
        """Rows `start..chunk.stop` of `chunk`, through HF datasets streaming (media undecoded)."""
        rows = self._stream(chunk.file).skip(start).take(chunk.stop - start)
        for i, row in enumerate(rows, start=start):
            yield Locator(self.name, chunk.file, i), row

    def _stream(self, f: int):
        if f not in self._streams:
            import datasets
            if self.fmt == "disk":
                ds = datasets.load_from_disk(self.files[0]).to_iterable_dataset()
            else:
                ds = datasets.load_dataset(self.fmt, data_files=[self.files[f]], split="train",
                                           streaming=True)
            self._streams[f] = ds.decode(False)
        return self._streams[f]

    def fetch(self, loc: Locator) -> dict:
        """One row by locator (random access), in the same form `stream` gives."""
        return self._reader(loc.file).row(loc.row)

    def parts(self, row: dict, loc: Locator) -> tuple[Any, dict[str, list], str]:
        """(text, {"vision": [raw images], "audio": [raw clips]}, sample id) through the schema."""
        schema = self.cfg.schema
        sid = lookup(row, schema.id) if schema.id else None
        sid = f"{self.name}/{sid if sid is not None else loc}"
        media: dict[str, list] = {}
        for encoder, column in (("vision", schema.image), ("audio", schema.audio)):
            value = lookup(row, column) if column else None
            if value is not None:
                items = value if isinstance(value, list) else [value]
                media[encoder] = [self._rooted(x) for x in items]
        return lookup(row, schema.text), media, sid

    def _rooted(self, item):
        """A relative media path is relative to `schema.root`."""
        root = self.cfg.schema.root
        if root and isinstance(item, str) and not Path(item).is_absolute():
            return str(Path(root) / item)
        if root and isinstance(item, dict) and not item.get("bytes") and item.get("path") \
                and not Path(item["path"]).is_absolute():
            return {**item, "path": str(Path(root) / item["path"])}
        return item

    def _reader(self, f: int):
        if f not in self._readers:
            cls = {"parquet": ParquetRows, "json": JsonRows, "arrow": ArrowRows,
                   "webdataset": TarRows, "disk": DiskRows}[self.fmt]
            try:
                self._readers[f] = cls(self.files[f])
            except (OSError, ValueError) as e:
                raise DataError(f"data source '{self.name}': cannot read {self.files[f]!r} as "
                                f"{self.fmt} ({e})") from None
        return self._readers[f]


# ------------------------------------------------------------------------- random access
class ParquetRows:
    """Row i of a parquet file: parquet's unit of reading is the row group, so the last few row
    groups read stay cached (the rows a rank fetches come in runs from other ranks' chunks).
    Files with small row groups (hundreds of rows, as `datasets` writes media) fetch cheaply."""

    def __init__(self, path: str):
        import pyarrow.parquet as pq
        self.file = pq.ParquetFile(path)
        meta = self.file.metadata
        self.num_rows = meta.num_rows
        self.starts = [0]
        for g in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
        self._group = functools.lru_cache(maxsize=4)(self.file.read_row_group)

    def row(self, i: int) -> dict:
        g = bisect.bisect_right(self.starts, i) - 1
        return self._group(g).slice(i - self.starts[g], 1).to_pylist()[0]


class ArrowRows:
    """Row i of a datasets .arrow file, through datasets' memory map."""

    def __init__(self, path: str):
        import datasets
        self.ds = datasets.Dataset.from_file(path)
        self.num_rows = len(self.ds)

    def row(self, i: int) -> dict:
        return _undecoded(self.ds, i)


class DiskRows(ArrowRows):
    def __init__(self, path: str):
        import datasets
        self.ds = datasets.load_from_disk(path)
        self.num_rows = len(self.ds)


def _undecoded(ds, i: int) -> dict:
    """Row i with media as stored (bytes/path dicts), as streaming with decode(False) gives it."""
    return ds.with_format("arrow")[i].to_pylist()[0]


class JsonRows:
    """Line i of a jsonl file: seek to the nearest remembered line start, read forward."""

    def __init__(self, path: str):
        self.path = path
        self.offsets = []  # byte offset of every JSON_INDEX_STRIDE-th non-empty line
        n, pos = 0, 0
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    if n % JSON_INDEX_STRIDE == 0:
                        self.offsets.append(pos)
                    n += 1
                pos += len(line)
        self.num_rows = n

    def row(self, i: int) -> dict:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[i // JSON_INDEX_STRIDE])
            skip = i % JSON_INDEX_STRIDE
            for line in f:
                if not line.strip():
                    continue
                if skip == 0:
                    return json.loads(line)
                skip -= 1
        raise IndexError(i)


MEDIA_EXTENSIONS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tiff", "wav", "flac", "mp3",
                    "ogg", "m4a"}


class TarRows:
    """Sample i of a webdataset tar: members grouped by key, as HF's webdataset builder does."""

    def __init__(self, path: str):
        self.path = path
        self.samples: list[tuple[str, list[tarfile.TarInfo]]] = []
        with tarfile.open(path) as tf:
            for member in tf:
                if not member.isfile():
                    continue
                key = member.name.split(".", 1)[0]
                if not self.samples or self.samples[-1][0] != key:
                    self.samples.append((key, []))
                self.samples[-1][1].append(member)
        self.num_rows = len(self.samples)

    def row(self, i: int) -> dict:
        key, members = self.samples[i]
        out: dict[str, Any] = {"__key__": key, "__url__": self.path}
        with tarfile.open(self.path) as tf:
            for m in members:
                ext = m.name.split(".", 1)[1].lower() if "." in m.name else ""
                out[ext] = _tar_value(ext, tf.extractfile(m).read(), m.name)
        return out


def _tar_value(ext: str, data: bytes, name: str):
    if ext.endswith("json"):
        return json.loads(data)
    if ext in ("txt", "text", "cls"):
        return data.decode("utf-8")
    if ext in MEDIA_EXTENSIONS:
        return {"bytes": data, "path": name}
    return data

