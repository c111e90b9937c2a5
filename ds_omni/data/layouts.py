"""Row layouts: how a row's conversation and media are laid out, found from the first rows.

- "llava": LLaVA / ShareGPT turns ({"from", "value"}) with `<image>` markers, the media in columns;
- "messages": chat messages ({"role", "content"}), each content a string (with markers, as
  LLaMA-Factory writes it) or a list of typed parts (text / image / video / audio, and the
  `image_url` / `input_audio` spellings), as transformers' `apply_chat_template` and TRL take them;
  a media part holds its item inline (a path, bytes, an HF Image struct) or takes the next one of
  the row's `images` / `videos` / `audios` column;
- "cauldron": The Cauldron's `texts` ({"user", "assistant"} pairs) and `images`, the images (no
  markers in the text) before the first user turn, as its processor places them;
- "text": a plain text column, every token trained.

Every layout becomes what the sample processor takes: turns with markers where the items stand,
and per kind the items in text order. `detect` picks the layout and the columns when the schema
leaves `layout` at "auto" (docs/data.md).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ds_omni.data.problems import SampleError
from ds_omni.errors import DataError

LAYOUTS = ("llava", "messages", "cauldron", "text")
KIND_OF_PART = {"image": "vision", "image_url": "vision", "video": "video", "video_url": "video",
                "audio": "audio", "input_audio": "audio"}
PART_NAMES = {"vision": "image", "video": "video", "audio": "audio"}
TEXT_COLUMN = {"llava": "conversations", "messages": "messages", "cauldron": "texts",
               "text": "text"}
MEDIA_COLUMNS = {"vision": ("images", "image"), "video": ("videos", "video"),
                 "audio": ("audios", "audio")}
DEFAULT_TEXT = "conversations"  # SchemaConfig.text's default: other columns may be detected
DEFAULT_MEDIA = {"vision": "image", "video": None, "audio": None}  # SchemaConfig's defaults
SCHEMA_FIELD = {"vision": "image", "video": "video", "audio": "audio"}


@dataclass(frozen=True)
class Layout:
    """A source's layout and the columns it is read from."""

    name: str
    """One of LAYOUTS."""
    text: str
    """The column holding the conversation (or the text)."""
    media: dict[str, str | None] = field(default_factory=dict)
    """Kind of item ("vision", "audio", "video") -> the column holding them."""
    detected: bool = False
    """Found from the rows (schema.layout "auto"), not named by the schema."""

    def describe(self) -> str:
        columns = ", ".join([f"text={self.text!r}"] + [f"{SCHEMA_FIELD[k]}={c!r}" for k, c in
                                                         self.media.items() if c])
        return f"layout {self.name!r} ({'detected' if self.detected else 'schema'}; {columns})"


# -------------------------------------------------------------------------------- detection
def columns(row: dict) -> list[str]:
    """The columns of a row, with one level of nested objects as dotted names ("json.id")."""
    out = []
    for k, v in row.items():
        out.append(k)
        if isinstance(v, dict) and not {"bytes", "path"} & set(v):
            out += [f"{k}.{n}" for n in v]
    return out


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


def kind_of_value(value: Any) -> str | None:
    """The layout a text column's value is written in, or None."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        return None
    keys = set().union(*({k for k, v in t.items() if v is not None} for t in value))
    if {"user", "assistant"} & keys and not {"from", "role"} & keys:
        return "cauldron"
    if "role" in keys and "content" in keys:
        return "messages"
    if "from" in keys and "value" in keys:
        return "llava"
    return None


def _first(rows: list[dict], column: str) -> Any:
    return next((v for row in rows if (v := lookup(row, column)) is not None), None)


def detect(schema, rows: list[dict], where: str) -> Layout:
    """The layout of `rows` (a source's first rows) under `schema`: the schema's layout and text
    column where it names them, else found from the rows' values; an ambiguous layout is a
    `DataError` listing the candidates and the schema to write."""
    if schema.layout != "auto":
        text = TEXT_COLUMN[schema.layout] if schema.text == DEFAULT_TEXT and rows and \
            _first(rows, schema.text) is None else schema.text
        return Layout(schema.layout, text, _media(schema, rows, schema.layout))
    if not rows:
        return Layout("llava", schema.text, schema.media_columns())
    found = kind_of_value(_first(rows, schema.text))
    if found is not None or schema.text != DEFAULT_TEXT:  # the user's column, or the default's
        found = found or "llava"  # (a column the rows lack: the start-up check names it)
        return Layout(found, schema.text, _media(schema, rows, found),
                      detected=True)
    candidates = [(k, c) for c in rows[0] if (k := kind_of_value(_first(rows, c))) not in
                  (None, "text")]
    if not candidates:
        candidates = [("text", c) for c in rows[0] if c == "text"
                      and isinstance(_first(rows, c), str)]
    if len(candidates) == 1:
        name, column = candidates[0]
        return Layout(name, column, _media(schema, rows, name), detected=True)
    if not candidates:
        raise DataError(f"{where}: no column of the first rows holds a conversation or a text "
                        f"(schema.text={schema.text!r}): {missing_column_hint(rows)}. Set "
                        f"schema.text (and schema.layout: one of {list(LAYOUTS)})")
    schemas = "; or ".join(f'"schema": {{"layout": "{k}", "text": "{c}"}}' for k, c in candidates)
    raise DataError(f"{where}: cannot tell the layout from the first rows: columns "
                    f"{[c for _, c in candidates]} could each be the conversation "
                    f"({', '.join(f'{c!r} as {k!r}' for k, c in candidates)}); write the schema, "
                    f"e.g. {schemas}")


def missing_column_hint(rows: list[dict]) -> str:
    return f"its rows have {columns(rows[0])}"


def _media(schema, rows: list[dict], layout: str) -> dict[str, str | None]:
    """Per kind, the schema's column; where that is the schema's default and the rows do not
    have it, the column the layout's datasets use ("images", "image", ...) if the rows have one
    (LLaVA rows: images only, as ShareGPT files with an "images" list have them)."""
    out = {}
    for kind, column in schema.media_columns().items():
        swap = column == DEFAULT_MEDIA[kind] and (layout != "llava" or kind == "vision")
        if swap and (column is None or _first(rows, column) is None):
            column = next((c for c in MEDIA_COLUMNS[kind] if _first(rows, c) is not None), column)
        out[kind] = column
    return out


# -------------------------------------------------------------------------------- reading
def to_turns(layout: Layout, value: Any, pools: dict[str, list], markers: dict[str, str],
             where: str, rooted: Callable[[Any], Any]) -> tuple[Any, dict[str, list]]:
    """(text, media) for the sample processor from a row's text value and its media columns'
    items (`pools`, kind -> items in order): turns whose contents mark each item, the items in
    the order of their markers. `rooted`: resolves a relative media path inline in a part."""
    if layout.name in ("llava", "text") or not isinstance(value, list):
        return value, {k: v for k, v in pools.items() if v is not None}
    if layout.name == "cauldron":
        value = cauldron_messages(value, pools, markers, where)
    items = _Items(pools, layout.media, markers, where, rooted)
    turns = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise SampleError(f"{where}: message {i} is {message!r}; messages are objects "
                              "{\"role\", \"content\"}", "text")
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        text = "".join(items.part_text(p, i, j) for j, p in enumerate(parts))
        turns.append({"role": message.get("role"), "content": text})
    items.check_all_taken()
    return turns, {k: v for k, v in items.media.items() if v}


def cauldron_messages(texts: list, pools: dict[str, list], markers: dict[str, str],
                      where: str) -> list[dict]:
    """The Cauldron's {"user", "assistant"} turns as messages; images no marker places go
    before the first user turn."""
    messages = []
    for i, turn in enumerate(texts):
        user, answer = (turn.get("user"), turn.get("assistant")) if isinstance(turn, dict) else \
            (None, None)
        if not isinstance(user, str) or not isinstance(answer, str):
            raise SampleError(f"{where}: texts[{i}] is {turn!r}; The Cauldron's turns are "
                              "{\"user\": str, \"assistant\": str}", "text")
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    if messages:
        for kind, items in pools.items():
            marked = sum(m["content"].count(markers[kind]) for m in messages
                         if markers.get(kind))
            if items and not marked:
                messages[0]["content"] = markers[kind] * len(items) + messages[0]["content"]
    return messages


class _Items:
    """The items of one row's messages, in the order their parts (or markers) place them."""

    def __init__(self, pools: dict[str, list], columns: dict[str, str | None],
                 markers: dict[str, str], where: str, rooted: Callable[[Any], Any]):
        self.pools, self.columns, self.markers = pools, columns, markers
        self.where, self.rooted = where, rooted
        self.media: dict[str, list] = {k: [] for k in PART_NAMES}
        self.taken = {k: 0 for k in PART_NAMES}
        self._split = re.compile("(" + "|".join(map(re.escape, markers.values())) + ")")

    def part_text(self, part: Any, i: int, j: int) -> str:
        """One part's text: a text part's text (each marker in it taking the next item of its
        kind), a media part's marker (its item inline, or the next of the row's column)."""
        at = f"{self.where}: message {i} part {j}"
        if not isinstance(part, dict):
            raise SampleError(f"{at} is {part!r}; parts are objects with a 'type' (text, image, "
                              "video, audio)", "text")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise SampleError(f"{at} is a text part without a string 'text' ({part!r})",
                                  "text")
            for piece in self._split.split(text):
                k = next((k for k, m in self.markers.items() if m == piece), None)
                if k is not None and k in self.pools:
                    self.media[k].append(self._take(k, at))
            return text
        if kind not in KIND_OF_PART:
            raise SampleError(f"{at} has type {kind!r}; the part types read are "
                              f"{['text'] + sorted(KIND_OF_PART)}. Fix the row (or set the "
                              "source's on_bad_sample to \"skip\")", "text")
        k = KIND_OF_PART[kind]
        item = inline_item(part, kind)
        self.media[k].append(self.rooted(item) if item is not None else self._take(k, at))
        return self.markers[k]

    def _column(self, kind: str) -> str:
        return f"{self.columns.get(kind) or MEDIA_COLUMNS[kind][0]!r}"

    def _take(self, kind: str, at: str) -> Any:
        """The next item of the row's column for `kind`."""
        items, n, name = self.pools.get(kind) or [], self.taken[kind], PART_NAMES[kind]
        if n >= len(items):
            raise SampleError(
                f"{at} is {name} part {n + 1} but the row's {self._column(kind)} column holds "
                f"{len(items)} {name}s and the part none inline; give each {name} part its media "
                f"(in the column, in order, or in the part as '{name}') or remove the part",
                "markers", kind)
        self.taken[kind] += 1
        if items[n] is None:
            raise SampleError(f"{at}: {name} {n + 1} of the row's {self._column(kind)} column is "
                              "missing (null); fill it in or drop the part", "media_missing")
        return items[n]

    def check_all_taken(self) -> None:
        """Items of a column that no part took are an error (they would be trained on nowhere)."""
        for kind, items in self.pools.items():
            if items and self.taken[kind] < len(items):
                name = PART_NAMES[kind]
                raise SampleError(
                    f"{self.where}: the {self._column(kind)} column holds {len(items)} {name}s "
                    f"but the messages take {self.taken[kind]} ({name} parts with no media "
                    f"inline, and {self.markers.get(kind)} markers); add a {{\"type\": "
                    f"\"{name}\"}} part where each belongs, or drop the extra items",
                    "markers", kind)


def inline_item(part: dict, kind: str) -> Any:
    """The media a part holds itself (None: it takes the next one of the row's column)."""
    name = {"image_url": "image_url", "video_url": "video_url",
            "input_audio": "input_audio"}.get(kind, kind)
    value = part.get(name)
    if value is None:
        value = part.get("path") if part.get("path") is not None else part.get("url")
    if isinstance(value, dict) and kind == "input_audio" and value.get("data") is not None:
        return base64.b64decode(value["data"])
    if isinstance(value, dict) and "url" in value and not {"bytes", "path"} & set(value):
        value = value["url"]
    if isinstance(value, str):
        return _from_url(value)
    return value


def _from_url(url: str) -> Any:
    """A path, a file:// URL, or a base64 data URL; a web URL is an error (no network)."""
    if url.startswith("data:"):
        return base64.b64decode(url.split(",", 1)[1])
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith(("http://", "https://")):
        raise SampleError(f"media at {url!r}: training reads no network; download the files "
                          "and give their local paths", "media_missing")
    return url
