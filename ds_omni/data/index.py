"""Row indexes of data files, built once per file and shared by every process that reads it.

A JSON array, a JSON lines file or a webdataset tar has no row directory: finding row i means
scanning the file. `load_or_build(path, kind, build, ...)` looks in an in-process memo, then an
index file under `index_dir()` (`$DS_OMNI_INDEX_DIR`, else `index/` in `$DS_OMNI_CACHE`), else
builds it in one process under an `fcntl.flock` while the others wait, writing to a temporary name
and `os.replace`-ing it. An index file is JSON (reading it runs no code) with the data file's path,
size and `mtime_ns`, the reader's parameters and the row offsets; one that does not match, parse or
validate is rebuilt (one log line), never trusted. Where the directory cannot be written the index
is built in memory; files under `MIN_INDEXED_BYTES` are scanned by each reader.
More: docs/data.md, "Row indexes, built once".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ds_omni.data.demo import default_cache_dir
from ds_omni.errors import DataError

log = logging.getLogger(__name__)

FORMAT = "ds_omni.data.index"
INDEX_VERSION = 1  # bump when an index's content changes: older files are then rebuilt
MIN_INDEXED_BYTES = 1 << 20  # smaller files are scanned by each reader (< 0.1 s)
LOCK_POLL_S = (0.05, 1.0)  # first and longest wait between tries (a thousand ranks poll one file)
LOCK_TIMEOUT_S = float(os.environ.get("DS_OMNI_INDEX_WAIT_S", 3600))  # a living builder's limit

BUILDS: Counter = Counter()  # kind -> indexes built by this process (tests count them)
LOADS: Counter = Counter()  # kind -> indexes read from an index file
_MEMO: dict[tuple, tuple["FileStat", dict]] = {}
_WARNED: set[str] = set()


@dataclass(frozen=True)
class FileStat:
    """What identifies one version of a data file."""

    path: str  # absolute
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> "FileStat":
        st = os.stat(path)
        return cls(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def index_dir() -> Path:
    """Where index files live: $DS_OMNI_INDEX_DIR, else `index/` in the cache directory."""
    explicit = os.environ.get("DS_OMNI_INDEX_DIR")
    return Path(explicit).resolve() if explicit else default_cache_dir() / "index"


def index_path(stat: FileStat, kind: str, params: dict) -> Path:
    """The index file of one data file, kind and reader parameters (the name hashes all three;
    the content repeats them, and is checked against them)."""
    key = json.dumps([stat.path, kind, params], sort_keys=True).encode()
    name = Path(stat.path).name[:80]
    return index_dir() / f"{name}.{hashlib.sha256(key).hexdigest()[:16]}.{kind}.json"


def clear_memo() -> None:
    _MEMO.clear()


def load_or_build(path: str, kind: str, build: Callable[[], dict], *,
                  params: dict | None = None,
                  valid: Callable[[dict, int], bool] = lambda d, size: True) -> dict:
    """The index of `path` (what `build()` returns: JSON-able), built at most once per file
    version across the processes that share `index_dir()`. `params`: the reader's options that
    change the index (a JSON document's key); `valid(index, file size)`: a check of a read
    index's shape and ranges (offsets ascending, inside the file)."""
    params = params or {}
    stat = FileStat.of(path)
    if stat.size < MIN_INDEXED_BYTES:
        return _build(build, kind)
    memo_key = (stat.path, kind, json.dumps(params, sort_keys=True))
    hit = _MEMO.get(memo_key)
    if hit is not None and hit[0] == stat:
        return hit[1]
    data = _shared(stat, kind, params, build, valid)
    _MEMO[memo_key] = (stat, data)
    return data


def _build(build: Callable[[], dict], kind: str) -> dict:
    BUILDS[kind] += 1
    return build()


def _shared(stat: FileStat, kind: str, params: dict, build: Callable[[], dict],
            valid: Callable[[dict, int], bool]) -> dict:
    """Read the index file; else, under its lock, read it again (another process may just have
    written it) or build and write it."""
    target = index_path(stat, kind, params)
    data, why = _read(target, stat, kind, params, valid)
    if data is not None:
        return data
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.with_name(target.name + ".lock"), "a+")
    except OSError as e:
        _warn_once(str(target.parent), f"index directory {str(target.parent)!r} cannot be "
                   f"written ({e}); data files are indexed in memory by every process. Set "
                   "DS_OMNI_INDEX_DIR to a writable folder that all ranks see to share them")
        return _build(build, kind)
    with lock, _locked(lock, target, stat):
        data, why_now = _read(target, stat, kind, params, valid)
        if data is not None:
            return data
        if why_now != "missing":
            log.info("%s: rebuilding the index %s of %s: %s", _who(), target, stat.path, why_now)
        data = _build(build, kind)
        _write(target, stat, kind, params, data)
    return data


def _read(target: Path, stat: FileStat, kind: str, params: dict,
          valid: Callable[[dict, int], bool]) -> tuple[dict | None, str]:
    """(the index, "") if `target` holds a trustworthy one for `stat`, else (None, why not)."""
    try:
        text = target.read_text()
    except FileNotFoundError:
        return None, "missing"
    except (OSError, UnicodeDecodeError) as e:
        return None, f"it cannot be read ({e})"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"it is not valid JSON (cut short or corrupt: {e})"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None, "it is not a ds_omni index file"
    if doc.get("version") != INDEX_VERSION:
        return None, (f"it was written by index version {doc.get('version')!r}, this ds_omni "
                      f"reads version {INDEX_VERSION}")
    if doc.get("kind") != kind or doc.get("params") != params or doc.get("path") != stat.path:
        return None, "it indexes another file or kind"
    if not _fresh(doc, stat):
        return None, (f"the data file changed since (size {doc.get('size')} -> {stat.size}, "
                      f"mtime_ns {doc.get('mtime_ns')} -> {stat.mtime_ns})")
    data = doc.get("index")
    if not isinstance(data, dict) or not _valid(valid, data, stat.size):
        return None, "its content is malformed (a row offset out of order or past the file's end)"
    LOADS[kind] += 1
    return data, ""


def _fresh(doc: dict, stat: FileStat) -> bool:
    """Is an index of `doc`'s file version one of the file as it is now?"""
    return doc.get("size") == stat.size and doc.get("mtime_ns") == stat.mtime_ns


def _valid(valid: Callable[[dict, int], bool], data: dict, size: int) -> bool:
    try:
        return bool(valid(data, size))
    except (KeyError, TypeError, ValueError, IndexError):
        return False


def _write(target: Path, stat: FileStat, kind: str, params: dict, data: dict) -> None:
    """Write atomically, unless the data file changed while it was being indexed (the next
    reader then rebuilds: an index is only ever of one version of the file)."""
    if FileStat.of(stat.path) != stat:
        log.info("%s: %s changed while it was indexed; its index is kept in memory only",
                 _who(), stat.path)
        return
    doc = {"format": FORMAT, "version": INDEX_VERSION, "kind": kind, "path": stat.path,
           "size": stat.size, "mtime_ns": stat.mtime_ns, "params": params, "index": data}
    tmp = target.with_name(f".{target.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        os.replace(tmp, target)
    except OSError as e:
        _warn_once(str(target.parent), f"cannot write the index {target} ({e}); data files "
                   "are indexed in memory by every process")
        with contextlib.suppress(OSError):
            tmp.unlink()


@contextlib.contextmanager
def _locked(lock, target: Path, stat: FileStat) -> Iterator[None]:
    """Hold `lock` exclusively; wait (at most LOCK_TIMEOUT_S) while another process builds."""
    start, said, pause = time.monotonic(), False, LOCK_POLL_S[0]
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        except OSError as e:  # a file system without flock: atomic writes still keep it whole
            _warn_once(f"{target.parent}:flock", f"no file locks under {target.parent} ({e}): "
                       "processes may each index a file once")
            yield
            return
        waited = time.monotonic() - start
        if waited > LOCK_TIMEOUT_S:
            raise DataError(f"{_who()}: waited {waited:.0f} s for the index of {stat.path!r}, "
                            f"which {_holder(lock)} is building (lock {lock.name}). If that "
                            "process is stuck, stop it; raise DS_OMNI_INDEX_WAIT_S for a file "
                            "that takes longer to scan")
        if not said and waited > 1.0:
            log.info("%s: waiting for %s to index %s", _who(), _holder(lock), stat.path)
            said = True
        time.sleep(pause)
        pause = min(2 * pause, LOCK_POLL_S[1])
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(f"{_who()} (host {socket.gethostname()}, pid {os.getpid()})\n")
        lock.flush()
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)


def _holder(lock) -> str:
    with contextlib.suppress(OSError):
        lock.seek(0)
        return lock.read().strip() or "another process"
    return "another process"


def _who() -> str:
    """This process, as a launcher names it."""
    rank = os.environ.get("RANK")
    return f"rank {rank}" if rank is not None else f"pid {os.getpid()}"


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


def offsets_cover(data: dict, stride: int, size: int) -> bool:
    """A sparse offset index's shape: `num_rows` rows, one int offset per `stride` of them,
    strictly ascending and inside a file of `size` bytes (a flipped digit is caught here, not
    read as a wrong row)."""
    n, offsets = data["num_rows"], data["offsets"]
    return (isinstance(n, int) and n >= 0 and isinstance(offsets, list)
            and len(offsets) == -(-n // stride) and all(type(o) is int for o in offsets)
            and ascending(offsets, size))


def ascending(offsets: list[int], size: int) -> bool:
    """Strictly ascending, from 0 on, all before byte `size`."""
    return (not offsets or (offsets[0] >= 0 and offsets[-1] < size)) and all(
        a < b for a, b in zip(offsets, offsets[1:]))
