"""JSON documents that hold rows: a top-level array (LLaVA-Instruct's `llava_v1_5_mix665k.json`),
or an object with the rows in a list under one key (`{"version": 1, "data": [...]}`).

HF `datasets` reads such a file whole with `json.load` (and its streaming cannot decode them), so a
1 GB file would sit in memory on every rank. This reader walks the file once with the standard
library's C decoder over a sliding buffer, one element at a time, and remembers the byte offset of
every `STRIDE`-th element: rows are then counted exactly, streamed from any row, and fetched by
index (seek to the nearest remembered element, decode forward), like the jsonl line index.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any, BinaryIO, Iterator

from ds_omni.errors import DataError

BLOCK = 1 << 20  # bytes read at a time
STRIDE = 256  # remember the offset of every 256th element
_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _Scanner:
    """Values one at a time from a binary file, from byte `offset` on; `byte` is where it stands."""

    def __init__(self, f: BinaryIO, offset: int, path: str):
        f.seek(offset)
        self.f, self.path = f, path
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos, self.base, self.eof, self._ascii = "", 0, offset, False, True

    @property
    def byte(self) -> int:
        """Byte offset of the current position (characters count one byte in ASCII text)."""
        return self.base + (self.pos if self._ascii else len(self.text[:self.pos].encode("utf-8")))

    def _fill(self) -> None:
        data = self.f.read(BLOCK)
        self.base, self.eof = self.byte, not data
        self.text = self.text[self.pos:] + self._utf8.decode(data, final=self.eof)
        self.pos, self._ascii = 0, self.text.isascii()

    def _advance(self, end: int) -> None:
        self.pos = end

    def peek(self) -> str:
        """The next non-blank character ("" at the end of the file), not consumed."""
        while True:
            self._advance(_WS.match(self.text, self.pos).end())
            if self.pos < len(self.text):
                return self.text[self.pos]
            if self.eof:
                return ""
            self._fill()

    def take(self, expected: str) -> None:
        got = self.peek()
        if got != expected:
            raise self._error(f"expected {expected!r}, found {got or 'the end of the file'!r}")
        self._advance(self.pos + 1)

    def next_item(self) -> bool:
        """After an array element: True (separator taken) if another follows, False at "]"."""
        m = _SEP.match(self.text, self.pos)
        if m is None or m.end() == len(self.text):  # the slow path, across a block boundary
            if self.peek() == "]":
                self.take("]")
                return False
            self.take(",")
            self.peek()
            return True
        self.pos = m.end()
        if m.group(1) == "]":
            return False
        return True

    def value(self) -> Any:
        """Decode the next value (it may span several blocks)."""
        if self.pos >= len(self.text) or self.text[self.pos] in " \t\n\r":
            self.peek()
        while True:
            try:
                obj, end = _DECODER.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as e:
                if self.eof:
                    raise self._error(e.msg) from None
                self._fill()
                continue
            if end == len(self.text) and not self.eof:  # a number may go on in the next block
                self._fill()
                continue
            self._advance(end)
            return obj

    def _error(self, what: str) -> DataError:
        return DataError(f"{self.path!r} is not valid JSON near byte {self.byte}: {what}")


class JsonDocument:
    """Rows of a JSON array file, or of the list under `key` in a JSON object file."""

    def __init__(self, path: str, key: str | None, offsets: list[int], num_rows: int):
        self.path, self.key = path, key
        self.offsets, self.num_rows = offsets, num_rows

    def row(self, i: int) -> dict:
        if not 0 <= i < self.num_rows:
            raise IndexError(i)
        return next(self.rows(i, i + 1))

    def rows(self, start: int, stop: int) -> Iterator[dict]:
        """Rows start..stop-1, decoded one at a time."""
        stop = min(stop, self.num_rows)
        if start >= stop:
            return
        first = start - start % STRIDE
        with open(self.path, "rb") as f:
            sc = _Scanner(f, self.offsets[start // STRIDE], self.path)
            for i in range(first, stop):
                if i > first and not sc.next_item():
                    raise sc._error(f"the array ends before element {i}")
                value = sc.value()
                if i >= start:
                    yield _as_row(value, i, self)


def _as_row(value: Any, i: int, doc: JsonDocument) -> dict:
    if not isinstance(value, dict):
        where = f"under key {doc.key!r} " if doc.key else ""
        raise DataError(f"element {i} {where}of {doc.path!r} is a {type(value).__name__}; each row "
                        "must be a JSON object ({\"conversations\": ..., \"image\": ...})")
    return value


def open_document(path: str, key: str | None = None, row_hint: str | None = None
                  ) -> JsonDocument | None:
    """The rows of `path` if it is one JSON document holding them; None if it is JSON lines.

    An object file's rows are the list under `key`, or, by default, its only list of objects.
    `row_hint` (the schema's text column): an object that has it is a single row (a one-line
    JSON lines file), not a document.
    """
    with open(path, "rb") as f:
        sc = _Scanner(f, 0, path)
        first = sc.peek()
        if first == "[":
            offsets, n, _ = _index_array(sc)
            if sc.peek():
                raise sc._error("more data after the top-level array")
            return JsonDocument(path, None, offsets, n)
        if first != "{":
            return None
        try:
            lists, keys = _walk_object(sc, key)
        except DataError:
            if path.endswith(".jsonl") or _second_line_is_a_row(path):  # its first line broken
                return None
            raise
        if sc.peek():  # another value follows: JSON lines
            return None
    return _pick_list(path, lists, keys, key, row_hint)


def _second_line_is_a_row(path: str) -> bool:
    """Whether the file's second non-empty line is a JSON object on its own (JSON lines; in a
    document spread over lines it is a fragment)."""
    with open(path, "rb") as f:
        lines = (line for line in f if line.strip())
        next(lines, None)
        second = next(lines, None)
    try:
        return second is not None and isinstance(json.loads(second), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def _index_array(sc: _Scanner) -> tuple[list[int], int, type | None]:
    """Offsets of every STRIDE-th element of the array at the scanner, the element count, and
    the first element's type (is this a list of objects?)."""
    sc.take("[")
    offsets, n, first_kind = [], 0, None
    if sc.peek() == "]":
        sc.take("]")
        return offsets, 0, None
    sc.peek()
    while True:
        if n % STRIDE == 0:
            offsets.append(sc.byte)
        value = sc.value()
        first_kind = first_kind or type(value)
        n += 1
        if not sc.next_item():
            return offsets, n, first_kind


def _walk_object(sc: _Scanner, wanted: str | None) -> tuple[dict, list[str]]:
    """Index every list (or only `wanted`) of the top-level object; skip other values."""
    sc.take("{")
    lists: dict[str, tuple[list[int], int, type | None]] = {}
    keys: list[str] = []
    while sc.peek() != "}":
        if keys:
            sc.take(",")
        name = sc.value()
        sc.take(":")
        keys.append(name)
        if sc.peek() == "[" and wanted in (None, name):
            lists[name] = _index_array(sc)
        else:
            sc.value()
    sc.take("}")
    return lists, keys


def _pick_list(path: str, lists: dict, keys: list[str], key: str | None,
               row_hint: str | None) -> JsonDocument | None:
    if key is not None:
        if key not in lists:
            raise DataError(f"{path!r} is a JSON object without a list under json_field={key!r}; "
                            f"its keys are {keys}")
        offsets, n, _ = lists[key]
        return JsonDocument(path, key, offsets, n)
    if row_hint is not None and row_hint.split(".")[0] in keys:
        return None  # a single row
    of_objects = [k for k, (_, n, kind) in lists.items() if kind is dict]
    if len(of_objects) == 1:
        offsets, n, _ = lists[of_objects[0]]
        return JsonDocument(path, of_objects[0], offsets, n)
    raise DataError(f"{path!r} is a JSON object with keys {keys}: set the source's json_field to "
                    f"the key whose list holds the rows (lists of objects: {of_objects})")
