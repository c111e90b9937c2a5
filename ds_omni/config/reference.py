"""The config reference (docs/config.md), generated from the config dataclasses themselves.

Every field's type and default come from the dataclass, its description from the string literal
written right after it (read from the source with `ast`: Python keeps no such docstrings at run
time). Sections follow `OmniConfig`'s nesting, fields their declaration order, so the output is
stable. A field without a docstring is an error naming it. A docstring's `docs/page.md#start`
becomes a link to the section of docs/ whose heading starts so (where the field says more).

    python -m ds_omni.config.reference > docs/config.md
    python -m ds_omni.config.reference --write        # the same, into docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from ds_omni.config.omni import OmniConfig
from ds_omni.errors import ConfigError

REGENERATE = "python -m ds_omni.config.reference --write"
ROOT = Path(__file__).resolve().parents[2]
DOCS_PATH = ROOT / "docs" / "config.md"


@functools.cache
def _scan(cls: type) -> tuple[dict[str, str], tuple[str, ...]]:
    """Field name -> its docstring (the string literal after it, whitespace collapsed to one
    line), and "Class.field (file:line)" of each field that has none."""
    path = Path(inspect.getsourcefile(cls))
    tree = ast.parse(path.read_text(), str(path))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    names = {f.name for f in dataclasses.fields(cls)}  # not a ClassVar's annotation
    docs, missing = {}, []
    for stmt, after in zip(node.body, node.body[1:] + [None]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and stmt.target.id in names):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[stmt.target.id] = " ".join(after.value.value.split())
        else:
            missing.append(f"{cls.__name__}.{stmt.target.id} ({where}:{stmt.lineno})")
    return docs, tuple(missing)


def check_docstrings(classes: list[type]) -> None:
    """Raises naming every field of `classes` that has no docstring."""
    missing = [m for cls in classes for m in _scan(cls)[1]]
    if missing:
        raise ConfigError("config field(s) without a docstring: " + ", ".join(missing) +
                          "; add a one-sentence string literal right after each field saying "
                          "what it does and its unit")


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its one-line docstring; raises naming the fields that have none."""
    check_docstrings([cls])
    return _scan(cls)[0]


def type_name(tp: Any) -> str:
    """A field's type as a reader writes it in JSON terms: `"a" | "b"`, `int | null`, `list[X]`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if tp is Any:
        return "any"
    return tp.__name__


def default_text(f: dataclasses.Field) -> str:
    """A field's default as JSON; "required" when it has none, "{}" for a section's defaults."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "{}"
    return json.dumps(value)


def nested(tp: Any) -> tuple[type, str] | None:
    """The config dataclass a field holds (directly, optional, or as a list's items) and the
    suffix its path takes ("" or "[]"); None for a plain value."""
    if dataclasses.is_dataclass(tp):
        return tp, ""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    if origin in (typing.Union, types.UnionType):
        found = [n for n in map(nested, args) if n]
        return found[0] if found else None
    return None


def tables(root: type = OmniConfig) -> list[tuple[type, list[str]]]:
    """Each config class under `root` (depth first, fields in declaration order) with the paths it
    appears at, in the order they are met; `root` itself has the path ""."""
    found: dict[type, list[str]] = {}

    def visit(cls: type, path: str) -> None:
        first = cls not in found
        found.setdefault(cls, []).append(path)
        if not first:
            return
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            inner = nested(hints[f.name])
            if inner:
                visit(inner[0], f"{path}.{f.name}{inner[1]}".lstrip("."))
    visit(root, "")
    return list(found.items())


def _cell(text: str) -> str:
    """Text for a table cell: "|" escaped (also in code spans, as GitHub's tables need), and
    "<", ">" outside code spans, so `<output_dir>` is not read as an HTML tag."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


DOC_REF = re.compile(r"(?<![\w/])docs/([\w/]+\.md)(?:#([\w-]+))?")


def _anchor(page: str, prefix: str) -> str:
    """The anchor of the first heading of docs/`page` whose anchor starts with `prefix` (so a
    two-line field docstring can name a long heading by its start); `prefix` when none does."""
    path = DOCS_PATH.parent / page
    headings = re.findall(r"^#+ (.*)", path.read_text(), re.M) if path.exists() else []
    anchors = [re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings]
    return next((a for a in anchors if a.startswith(prefix)), prefix)


def _doc_links(text: str) -> str:
    """Each `docs/page.md#start` outside code spans as a link from docs/config.md to that page's
    section."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = DOC_REF.sub(lambda m: f"[{m.group(1)}]({m.group(1)}" + (
            f"#{_anchor(m.group(1), m.group(2))})" if m.group(2) else ")"), parts[i])
    return "`".join(parts)


def _code(text: str) -> str:
    return "required" if text == "required" else _cell(f"`{text}`")


def table_lines(cls: type, paths: list[str]) -> list[str]:
    """One class's heading, its docstring and its table of key, type, default, description."""
    depth = 2 if len(paths[0].split(".")) <= 1 else 3
    title = ", ".join(f"`{p}`" for p in paths) if paths[0] else "Top level"
    doc = " ".join((inspect.getdoc(cls) or "").split())
    lines = [f"{'#' * depth} {title} ({cls.__name__})", "", doc, "",
             "| key | type | default | description |", "|---|---|---|---|"]
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        lines.append(f"| `{f.name}` | {_code(type_name(hints[f.name]))} | "
                     f"{_code(default_text(f))} | {_doc_links(_cell(docs[f.name]))} |")
    return lines + [""]


def reference() -> str:
    """The whole of docs/config.md."""
    lines = ["# Config reference", "",
             f"<!-- generated by `{REGENERATE}`; edit the field docstrings in ds_omni/config/, "
             "not this file -->", "",
             "Every field of a ds_omni JSON config: its type, its default (\"required\" when it "
             "has none) and what it does, read from the config dataclasses in `ds_omni/config/`. "
             "A key is written as its path: `data.reorder.mode` is the `mode` field of the "
             "`reorder` object inside `data`; `data.sources[]` is each element of the list. "
             "Unknown keys are an error that lists the valid ones. Any field can also be set on "
             "the command line with `--set key=value` (a JSON value), e.g. "
             "`--set train.steps=10`.", ""]
    found = tables()
    check_docstrings([cls for cls, _ in found])
    for cls, paths in found:
        lines += table_lines(cls, paths)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--write"]):
        help_asked = argv in (["-h"], ["--help"])
        print("usage: python -m ds_omni.config.reference [--write]\nWrite the config reference "
              "(docs/config.md) to stdout, or with --write into docs/config.md of this checkout.",
              file=sys.stdout if help_asked else sys.stderr)
        return 0 if help_asked else 2
    text = reference()
    if argv and not DOCS_PATH.parent.is_dir():
        print(f"no {DOCS_PATH.parent}: --write needs a checkout of ds_omni; write to stdout "
              "instead (python -m ds_omni.config.reference > config.md)", file=sys.stderr)
        return 2
    if argv:
        DOCS_PATH.write_text(text)
        print(f"wrote {DOCS_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
