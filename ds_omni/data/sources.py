"""Data sources: local files read by chunk and by locator, with media left undecoded.

A source is a list of files of one format (parquet, jsonl, arrow, webdataset tar, a `save_to_disk`
directory), cut into fixed chunks of rows. A rank streams its own chunks (`Source.stream`); every
row has a `Locator` (source, file, row), so after reordering the rank a sample goes to reads that
row itself (`Source.fetch`). One reader per file makes a chunk cost its own rows (HF streaming's
`skip(start)` reads every skipped row): parquet by row group, arrow and save_to_disk by memory map,
jsonl and JSON arrays through sparse offset indexes (`json_docs.py`, `index.py`), tar through a
member index. Rows come as `datasets` streaming with `decode(False)` gives them (a jsonl row is
what `json.loads` makes of its line). Relative media paths resolve against `schema.root`, else the
data file's folder (LLaVA's convention). More: docs/data.md, "Several sources".
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
from ds_omni.data import demo, index
from ds_omni.data.hub_folder import hub_configs, hub_files
from ds_omni.data.json_docs import JsonDocument, open_document
from ds_omni.data.layouts import Layout, columns, detect, lookup, to_turns
from ds_omni.data.problems import MALFORMED, SampleError, malformed_line
from ds_omni.errors import DataError

FORMAT_BY_SUFFIX = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow",
                    ".tar": "webdataset"}
FIELD_OF_KIND = {"vision": "image", "audio": "audio", "video": "video"}  # schema field per kind
JSON_INDEX_STRIDE = 256  # jsonl: remember every 256th line start
STREAM_BATCH = 256  # rows made into Python objects at a time when a chunk is read
LAYOUT_ROWS = 16  # rows of the first file the layout is found from


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
        if cfg.config or hub_configs(p) or (not files and (p / "README.md").is_file()):
            files = hub_files(cfg, p)  # a hub snapshot: its configs, or data/<split>-* shards
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


WEBDATASET_HINT = ("webdataset samples are keyed by file extension: images under 'jpg' or 'png', "
                   "text inside a json member as 'json.conversations', the sample id as '__key__'")


def missing_column(source: "Source", field: str, column: str, row: dict,
                   one_row: bool = False) -> str:
    """The message for a schema column a row does not have: the columns it does have."""
    hint = f"; {WEBDATASET_HINT}" if source.fmt == "webdataset" else ""
    whose = "this row" if one_row else "its rows"
    return (f"schema.{field}={column!r} is not a column of {'this row of ' if one_row else ''}"
            f"source '{source.name}'; {whose} {'has' if one_row else 'have'} {columns(row)}. "
            f"If that is not right, set data.sources[{source.name}].schema.{field}{hint}")


class Source:
    """One source: its files, their row counts and chunks, streaming and random access."""

    def __init__(self, cfg: SourceConfig, chunk_rows: int = 1024):
        self.cfg = cfg
        self.name = cfg.name
        self.fmt, self.files = resolve_files(cfg)
        self.chunk_rows = chunk_rows
        self._readers: dict[int, Any] = {}

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
        """Rows `start..chunk.stop` of `chunk`, read from `start` on (media undecoded)."""
        rows = self._reader(chunk.file).rows(start, chunk.stop)
        for i, row in enumerate(rows, start=start):
            yield Locator(self.name, chunk.file, i), row

    def fetch(self, loc: Locator) -> dict:
        """One row by locator (random access), in the same form `stream` gives."""
        return self._reader(loc.file).row(loc.row)

    def sample_id(self, row: dict, loc: Locator) -> str:
        sid = lookup(row, self.cfg.schema.id) if self.cfg.schema.id else None
        return f"{self.name}/{sid if sid is not None else loc}"

    @cached_property
    def layout(self) -> Layout:
        """The rows' layout and the columns it is read from (`layouts.detect` on the first
        rows of the first file)."""
        rows = [self.fetch(Locator(self.name, 0, i))
                for i in range(min(LAYOUT_ROWS, self.file_rows[0]))] if self.files else []
        return detect(self.cfg.schema, rows, f"data source '{self.name}'")

    def parts(self, row: dict, loc: Locator) -> tuple[Any, dict[str, list], str]:
        """(text, {"vision": [raw images], "audio": [raw clips], "video": [raw videos]}, sample id)
        through the layout: the text a conversation with a marker where each item stands.

        A missing text column, or a relative media path that names no file, is a `DataError`
        naming the sample (a bad sample: the source's on_bad_sample policy applies)."""
        if MALFORMED in row:
            raise SampleError(f"sample {loc}: {row[MALFORMED]}", "malformed")
        layout = self.layout
        sid = self.sample_id(row, loc)
        text = lookup(row, layout.text)
        if text is None:
            raise SampleError(f"sample {sid}: {missing_column(self, 'text', layout.text, row)}",
                              "column")
        pools: dict[str, list] = {}
        for kind, column in layout.media.items():
            value = lookup(row, column) if column else None
            if value is not None:
                items = value if isinstance(value, list) else [value]
                pools[kind] = [self._rooted(x, loc, sid) for x in items]
        text, media = to_turns(layout, text, pools, self.cfg.schema.markers(), f"sample {sid}",
                               lambda item: self._rooted(item, loc, sid))
        return text, media, sid

    def media_root(self, file: int) -> Path:
        """What relative media paths of rows of file `file` are relative to."""
        if self.cfg.schema.root:
            return Path(self.cfg.schema.root)
        return Path(self.files[file]).resolve().parent

    def _rooted(self, item, loc: Locator, sid: str):
        """A relative media path, resolved against `media_root`; it must name a file."""
        path = item if isinstance(item, str) else item.get("path") if isinstance(item, dict) and \
            not item.get("bytes") and item.get("array") is None else None
        if not path or Path(path).is_absolute():
            return item
        full = self.media_root(loc.file) / path
        if not full.is_file():
            how = (f"schema.root={self.cfg.schema.root!r}" if self.cfg.schema.root else
                   "the folder of the data file, as schema.root is not set")
            raise SampleError(f"sample {sid}: media file {path!r} not found: resolved against "
                            f"{str(self.media_root(loc.file))!r} ({how}) to {str(full)!r}. If the "
                            f"paths are relative to another folder, set data.sources[{self.name}]"
                            ".schema.root to it", "media_missing")
        return str(full) if isinstance(item, str) else {**item, "path": str(full)}

    def explain(self, error: DataError, row: dict) -> DataError:
        """`error` with the column hint added when markers found no items because the schema's
        media column is not in the row (a wrong schema.image / schema.audio)."""
        if not isinstance(error, SampleError) or error.kind != "markers" or error.encoder is None:
            return error
        field = FIELD_OF_KIND.get(error.encoder, error.encoder)
        column = self.layout.media.get(error.encoder, getattr(self.cfg.schema, field, None))
        if column and lookup(row, column) is not None:
            return error
        hint = missing_column(self, field, column, row, one_row=True) if column else \
            f"schema.{field} is null; set it to the column holding the {field}s"
        return SampleError(f"{error}. {hint}", error.kind, error.encoder)

    def _reader(self, f: int):
        if f not in self._readers:
            cls = {"parquet": ParquetRows, "json": JsonRows, "arrow": ArrowRows,
                   "webdataset": TarRows, "disk": DiskRows}[self.fmt]
            kw = {"key": self.cfg.json_field, "row_hint": self.cfg.schema.text} \
                if self.fmt == "json" else {}
            try:
                self._readers[f] = cls(self.files[f], **kw)
            except (OSError, ValueError, tarfile.TarError) as e:
                why = str(e).replace(":\n", ": ").replace("\n", "; ")
                raise DataError(f"data source '{self.name}': cannot read {self.files[f]!r} as "
                                f"{self.fmt} ({why})") from None
        return self._readers[f]


# ------------------------------------------------------------------------- random access
class ParquetRows:
    """Rows of a parquet file by row group, parquet's unit of reading.

    `row(i)`: the last few row groups read stay cached (the rows a rank fetches come in runs from
    other ranks' chunks); files with small row groups (hundreds of rows, as `datasets` writes
    media) fetch cheaply. `rows(start, stop)`: decodes the row groups that hold them, batch by
    batch, through a handle of its own, and makes Python rows of `start..stop` only; a chunk
    inside one huge row group (pyarrow's default is 1Mi rows) still decodes that group up to
    `stop`, in Arrow's C++, not row by row."""

    def __init__(self, path: str):
        import pyarrow.parquet as pq
        self.path = path
        self.meta = meta = pq.read_metadata(path)  # parsed once: each chunk's handle reuses it
        self.num_rows = meta.num_rows
        self.starts = [0]
        for g in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
        self._group = functools.lru_cache(maxsize=4)(self._read_group)

    @cached_property
    def file(self):
        import pyarrow.parquet as pq
        return pq.ParquetFile(self.path, metadata=self.meta)

    def _read_group(self, g: int):
        return self.file.read_row_group(g)

    def row(self, i: int) -> dict:
        g = bisect.bisect_right(self.starts, i) - 1
        return self._group(g).slice(i - self.starts[g], 1).to_pylist()[0]

    def rows(self, start: int, stop: int) -> Iterator[dict]:
        import pyarrow.parquet as pq
        if start >= stop:
            return
        first = bisect.bisect_right(self.starts, start) - 1
        last = bisect.bisect_right(self.starts, stop - 1) - 1
        pos = self.starts[first]  # the row the next batch begins at
        with pq.ParquetFile(self.path, metadata=self.meta) as f:
            for batch in f.iter_batches(batch_size=STREAM_BATCH, row_groups=range(first, last + 1),
                                        use_threads=False):
                lo, hi = max(start - pos, 0), min(stop - pos, batch.num_rows)
                if lo < hi:
                    yield from batch.slice(lo, hi - lo).to_pylist()
                pos += batch.num_rows
                if pos >= stop:
                    return


class ArrowRows:
    """Rows of a datasets .arrow file, through datasets' memory map."""

    def __init__(self, path: str):
        import datasets
        self.ds = datasets.Dataset.from_file(path)
        self.num_rows = len(self.ds)

    def row(self, i: int) -> dict:
        return _undecoded(self.ds, i)

    def rows(self, start: int, stop: int) -> Iterator[dict]:
        table = self.ds.with_format("arrow")
        for a in range(start, stop, STREAM_BATCH):
            yield from table[a:min(a + STREAM_BATCH, stop)].to_pylist()


class DiskRows(ArrowRows):
    def __init__(self, path: str):
        import datasets
        self.ds = datasets.load_from_disk(path)
        self.num_rows = len(self.ds)


def _undecoded(ds, i: int) -> dict:
    """Row i with media as stored (bytes/path dicts), as streaming with decode(False) gives it."""
    return ds.with_format("arrow")[i].to_pylist()[0]


class JsonRows:
    """Line i of a jsonl file: seek to the nearest remembered line start, read forward; or row i
    of a JSON document (an array, or an object holding a list) through its element index. The
    index is built once per file version and shared (`index.py`)."""

    def __init__(self, path: str, key: str | None = None, row_hint: str | None = None):
        self.path = path
        data = index.load_or_build(path, "json", lambda: _json_index(path, key, row_hint),
                                   params={"key": key, "row_hint": row_hint}, valid=_json_valid)
        self.offsets, self.num_rows = data["offsets"], data["num_rows"]
        self.doc: JsonDocument | None = None
        if data["layout"] == "document":
            self.doc = JsonDocument(path, data["key"], self.offsets, self.num_rows)

    def row(self, i: int) -> dict:
        if self.doc is not None:
            return self.doc.row(i)
        return next(self.rows(i, i + 1))

    def rows(self, start: int, stop: int) -> Iterator[dict]:
        """Lines start..stop-1: seek to the nearest remembered line start, skip unparsed lines."""
        if self.doc is not None:
            yield from self.doc.rows(start, stop)
            return
        if start >= stop:
            return
        if start >= self.num_rows:
            raise IndexError(start)
        with open(self.path, "rb") as f:
            f.seek(pos := self.offsets[start // JSON_INDEX_STRIDE])
            i = start - start % JSON_INDEX_STRIDE
            for line in f:
                pos += len(line)
                if not line.strip():
                    continue
                if i >= start:  # a line that does not parse is a bad sample, by file and line
                    try:
                        row = json.loads(line.rstrip())
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        row = malformed_line(self.path, pos - len(line), e)
                    yield row
                i += 1
                if i >= stop:
                    return


def _json_index(path: str, key: str | None, row_hint: str | None) -> dict:
    """A JSON file's index: its document's element offsets, or its jsonl line offsets (every
    JSON_INDEX_STRIDE-th non-empty line's start)."""
    doc = open_document(path, key, row_hint)
    if doc is not None:
        return {"layout": "document", "key": doc.key, "offsets": doc.offsets,
                "num_rows": doc.num_rows}
    offsets, n, pos = [], 0, 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                if n % JSON_INDEX_STRIDE == 0:
                    offsets.append(pos)
                n += 1
            pos += len(line)
    return {"layout": "lines", "key": None, "offsets": offsets, "num_rows": n}


def _json_valid(data: dict, size: int) -> bool:
    return (data["layout"] in ("document", "lines") and isinstance(data["key"], (str, type(None)))
            and index.offsets_cover(data, JSON_INDEX_STRIDE, size))


MEDIA_EXTENSIONS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tiff", "wav", "flac", "mp3",
                    "ogg", "m4a"}


class TarRows:
    """Sample i of a webdataset tar: members grouped by key, as HF's webdataset builder does."""

    def __init__(self, path: str):
        self.path = path
        data = index.load_or_build(path, "tar", lambda: _tar_index(path), valid=_tar_valid)
        self.samples: list[tuple[str, list[tarfile.TarInfo]]] = [
            (key, [_member(*m) for m in members]) for key, members in data["samples"]]
        self.num_rows = data["num_rows"]

    def row(self, i: int) -> dict:
        return next(self.rows(i, i + 1))

    def rows(self, start: int, stop: int) -> Iterator[dict]:
        """Samples start..stop-1 through one open archive. (HF's webdataset builder infers one
        set of columns from the first samples and fails when image and text-only samples mix.)"""
        with tarfile.open(self.path) as tf:
            for key, members in self.samples[start:stop]:
                out: dict[str, Any] = {"__key__": key, "__url__": self.path}
                for m in members:
                    ext = m.name.split(".", 1)[1].lower() if "." in m.name else ""
                    out[ext] = _tar_value(ext, tf.extractfile(m).read(), m.name)
                yield out


def _tar_index(path: str) -> dict:
    """Each sample's key and its members' (name, data offset, size), in archive order."""
    samples: list[list] = []
    with tarfile.open(path) as tf:
        for member in tf:
            if not member.isfile():
                continue
            if member.sparse is not None:
                raise DataError(f"{path!r}: member {member.name!r} is a sparse file, which the "
                                "tar reader cannot seek into; repack the shard without --sparse")
            key = member.name.split(".", 1)[0]
            if not samples or samples[-1][0] != key:
                samples.append([key, []])
            samples[-1][1].append([member.name, member.offset_data, member.size])
    return {"samples": samples, "num_rows": len(samples)}


def _tar_valid(data: dict, size: int) -> bool:
    """Every sample a key and its members (name, data offset, size), in archive order, each
    member's data inside the file."""
    samples = data["samples"]
    if not isinstance(samples, list) or len(samples) != data["num_rows"]:
        return False
    starts = []
    for key, members in samples:
        for name, offset, length in members:
            if not (isinstance(key, str) and isinstance(name, str) and type(length) is int
                    and type(offset) is int and length >= 0 and offset + length <= size):
                return False
            starts.append(offset)
    return index.ascending(starts, size)


def _member(name: str, offset_data: int, size: int) -> tarfile.TarInfo:
    """A regular member as `extractfile` needs it: where its data starts, how long it is."""
    m = tarfile.TarInfo(name)
    m.offset_data, m.size, m.type = int(offset_data), int(size), tarfile.REGTYPE
    return m


def _tar_value(ext: str, data: bytes, name: str):
    if ext.endswith("json"):
        return json.loads(data)
    if ext in ("txt", "text", "cls"):
        return data.decode("utf-8")
    if ext in MEDIA_EXTENSIONS:
        return {"bytes": data, "path": name}
    return data

