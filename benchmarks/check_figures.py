"""Every figure of BENCHMARKS.md, found in its results file.

BENCHMARKS.md's summary is its first table: one row per figure, `| [what](page) | figure |
command |`. The linked page (docs/benchmarks/<name>.md) has the row in full in a table with
`figure` and `source` columns, under the same `what`; the summary's figure must read exactly as
the page's. Every table of every page with `figure` and `source` columns (the Figures and the
History tables) is checked against the results: every number in a `figure` cell is a figure,
and its `source` cell names, in backticks, a results file of `benchmarks/results/` and then one
key per number, in the order the numbers are printed:

    | what | figure | ... | source | command |
    |---|---|---|---|---|
    | loader vs 0 / 2 workers | 0.96x / 2.13x | ... | `loader.json`:
      `throughput.{baseline_workers0,baseline_workers2}.ds_omni_over_this` | ... |  (one line)

A key is a path of dict keys and list indexes joined by dots (`cpu.ratios.0`). Other forms:
- `{a,b,c}.x`: one key per alternative, in that order (a figure per mix); inside range(), min()
  or max() the alternatives' values are pooled;
- `results[mix=1:9,dp=8].x`: the list elements whose fields have these values;
- `range(path)`: two numbers, the min and the max of every value the path selects (`1.35-1.60`);
  `max(path)` and `min(path)`: one of them (a figure that holds for every mix);
- `p / q`: the ratio of two values, for a ratio the results file does not store.
A file written `name.json@rev` is the results file as git revision `rev` had it, kept as
`results/history/name@rev.json`: a figure of an earlier run whose results file a later run
replaced.
A figure matches when its value, formatted with as many decimals as printed, reads the same
(`0.96` for 0.9583); a figure printed with `%` is compared with the value x 100 (the results
files store fractions). Context that is not a measurement of that run (a modelled bound, a
target) goes in the other columns, which are not checked.

Run: python benchmarks/check_figures.py [--doc BENCHMARKS.md] [--results benchmarks/results].
The pages are read from docs/benchmarks/ beside the doc.
It prints one line per figure that is not backed (and what it found instead) and exits with 1,
or prints how many figures it checked and exits with 0. No benchmark is run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# 0.96, 8,000, 99.8 %, -29 %; a range 1.35-1.60 is two numbers (a "-" after a digit is no sign)
NUMBER = re.compile(r"((?:(?<![\d.])-)?\d+(?:,\d{3})*(?:\.\d+)?)(\s?%)?")
TOKEN = re.compile(r"`([^`]+)`")
# a path segment: a key or index, or a [field=value,...] filter (whose values may hold dots)
SEGMENT = re.compile(r"\[[^\]]*\]|[^.\[\]]+")


class FigureError(ValueError):
    """A source that cannot be read: no such file or key, or a key selecting the wrong count."""


def tables(doc: str) -> list[tuple[list[str], list[list[str]]]]:
    """Header and rows (cells stripped) of every Markdown table in `doc`, in order."""
    found, rows = [], []
    for line in doc.splitlines() + [""]:
        if line.strip().startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            found.append((rows[0], rows[2:]))  # rows[1] is the |---| line
            rows = []
    if not found:
        raise FigureError("no table found: the summary table must be the document's first table")
    return found


def column(header: list[str], name: str) -> int | None:
    return next((i for i, cell in enumerate(header) if cell.lower().startswith(name)), None)


def require(index: int | None, header: list[str], name: str) -> int:
    if index is not None:
        return index
    raise FigureError(f"the summary table has no '{name}' column (its columns: {header}); "
                      "add one, see benchmarks/check_figures.py's docstring")


def expand_braces(key: str) -> list[str]:
    """`{a,b}.x` -> [`a.x`, `b.x`]; several groups give their product."""
    group = re.search(r"\{([^{}]*)\}", key)
    if group is None:
        return [key]
    return [expanded for alt in group.group(1).split(",")
            for expanded in expand_braces(key[:group.start()] + alt + key[group.end():])]


def select(data, path: str, file: str) -> list[float]:
    """Every number `path` reaches in `data` (more than one only through a filter)."""
    nodes, walked = [data], ""
    for seg in SEGMENT.findall(path):
        nodes = [child for node in nodes for child in _step(node, seg, file, walked or "the top")]
        walked += seg if seg.startswith("[") or not walked else "." + seg
        if not nodes:
            raise FigureError(f"`{file}`: no list element matches `{walked}`")
    for node in nodes:
        if isinstance(node, bool) or not isinstance(node, (int, float)):
            raise FigureError(f"`{file}`: `{path}` is {type(node).__name__}, not a number")
    return nodes


def _step(node, seg: str, file: str, at: str) -> list:
    if seg.startswith("["):  # a filter over a list of dicts: field=value, compared as text
        if not isinstance(node, list):
            raise FigureError(f"`{file}`: `{at}` is no list, so `{seg}` cannot filter it")
        wanted = dict(pair.split("=", 1) for pair in seg[1:-1].split(","))
        return [el for el in node if isinstance(el, dict)
                and all(str(el.get(k)) == v for k, v in wanted.items())]
    if isinstance(node, dict) and seg in node:
        return [node[seg]]
    if isinstance(node, list) and seg.isdigit() and int(seg) < len(node):
        return [node[int(seg)]]
    there = sorted(node)[:12] if isinstance(node, dict) else f"a list of {len(node)}"
    raise FigureError(f"`{file}` has no `{seg}` under `{at}` (there: {there})")


def one(data, path: str, file: str) -> float:
    values = select(data, path, file)
    if len(values) != 1:
        raise FigureError(f"`{file}`: `{path}` selects {len(values)} values; name one, or write "
                          "range(...), min(...) or max(...)")
    return values[0]


def key_values(data, key: str, file: str) -> list[tuple[str, float]]:
    """(label, value) for each number `key` stands for: two for range(), else one."""
    if " / " in key:
        num, den = key.split(" / ", 1)
        return [(key, one(data, num.strip(), file) / one(data, den.strip(), file))]
    call = re.fullmatch(r"(range|min|max)\((.+)\)", key)
    if call:  # over every value the path selects, braces included
        name, path = call.groups()
        values = [v for alt in expand_braces(path) for v in select(data, alt, file)]
        ends = {"min": [("min", min(values))], "max": [("max", max(values))]}
        picked = ends.get(name, ends["min"] + ends["max"])  # range(): both
        return [(f"{end} of {path}", value) for end, value in picked]
    return [(key, one(data, key, file))]


def source_values(cell: str, results: Path) -> list[tuple[str, float]]:
    """The values a source cell names, in order, each labelled `file` `key`."""
    out, file, data = [], None, None
    for token in TOKEN.findall(cell):
        if re.search(r"\.json(@\w+)?$", token):
            file, data = token, load(results, token)
            continue
        if data is None:
            raise FigureError(f"`{token}` comes before any results file: name the `*.json` first")
        keys = [token] if re.match(r"(range|min|max)\(", token) else expand_braces(token)
        for key in keys:
            out += [(f"`{file}` `{label}`", value) for label, value in key_values(data, key, file)]
    return out


def load(results: Path, file: str):
    """A results file as it is now, or as git revision `rev` had it (`name.json@rev`: kept
    as `history/name@rev.json`, so that no check needs git)."""
    name, _, rev = file.partition("@")
    path = results / name if not rev else results / "history" / f"{Path(name).stem}@{rev}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FigureError(f"no results file `{path}`" + (
            f" (an earlier run's: `git show {rev}:benchmarks/results/{name} > {path}`)"
            if rev else "")) from None


def printed_as(figure: re.Match, value: float) -> str:
    """`value` written as `figure` is: its decimals, x 100 for a percentage."""
    number = figure.group(1).replace(",", "")
    decimals = len(number.split(".")[1]) if "." in number else 0
    return f"{value * (100 if figure.group(2) else 1):.{decimals}f}"


LINK = re.compile(r"^\[([^\]]+)\]\(([^)#]+)(?:#[^)]*)?\)$")


def pages_of(doc_path: Path) -> list[Path]:
    """The experiment pages of `doc_path`: docs/benchmarks/*.md beside it."""
    return sorted((doc_path.parent / "docs" / "benchmarks").glob("*.md"))


def figure_tables(text: str):
    """(header, rows, figure column, source column) of each table with both columns."""
    try:
        found = tables(text)
    except FigureError:  # a page without tables
        return
    for header, rows in found:
        fig_col, src_col = column(header, "figure"), column(header, "source")
        if fig_col is not None and src_col is not None:
            yield header, rows, fig_col, src_col


def summary_rows(doc_path: Path) -> list[tuple[str, str, str, Path]]:
    """(what, figure, command cell, page) of each row of the summary, the doc's first table:
    `| [what](docs/benchmarks/page.md) | figure | command |`."""
    header, rows = tables(doc_path.read_text())[0]
    fig_col = require(column(header, "figure"), header, "figure")
    cmd_col = require(column(header, "command"), header, "command")
    out = []
    for row in rows:
        link = LINK.match(row[0])
        if link is None:
            raise FigureError(f"summary row '{row[0]}': its `what` must link its page, "
                              "`[what](docs/benchmarks/<name>.md)`")
        out.append((link.group(1), row[fig_col], row[cmd_col], doc_path.parent / link.group(2)))
    return out


def page_rows(page: Path) -> dict[str, list[str]]:
    """what -> the full row, for every row of the page's figure tables."""
    return {row[0]: row for header, rows, _, _ in figure_tables(page.read_text()) for row in rows}


def page_row(page: Path, what: str) -> tuple[list[str], int, int]:
    """The page's row named `what`, with its figure and source columns."""
    if not page.exists():
        raise FigureError(f"its page {page} does not exist")
    for header, rows, fig_col, src_col in figure_tables(page.read_text()):
        for row in rows:
            if row[0] == what:
                return row, fig_col, src_col
    raise FigureError(f"no row '{what}' in a table with figure and source columns of "
                      f"{page.name}: add the row in full there")


def check(doc_path: Path, results: Path) -> tuple[int, list[str]]:
    """(figures checked, one line per figure not backed): every figure table of the pages
    against the results, and every summary row against its page's row."""
    checked, problems = 0, []
    for page in pages_of(doc_path):
        for header, rows, fig_col, src_col in figure_tables(page.read_text()):
            n, more = check_rows(rows, fig_col, src_col, results)
            checked += n
            problems += [f"{page.name}: {line}" for line in more]
    for what, figure, _, page in summary_rows(doc_path):
        try:
            row, fig_col, _ = page_row(page, what)
        except FigureError as e:
            problems.append(f"summary row '{what}': {e}")
            continue
        if row[fig_col] != figure:
            problems.append(f"summary row '{what}': figure {figure} but {page.name} has "
                            f"{row[fig_col]} (run benchmarks/summary.py)")
        checked += len(list(NUMBER.finditer(figure)))
    return checked, problems


def check_rows(rows: list[list[str]], fig_col: int, src_col: int,
               results: Path) -> tuple[int, list[str]]:
    what, checked, problems = 0, 0, []
    for row in rows:
        name = f"row '{row[what]}'"
        figures = list(NUMBER.finditer(row[fig_col]))
        try:
            values = source_values(row[src_col], results)
        except FigureError as e:
            problems.append(f"{name}: {e}")
            continue
        if len(figures) != len(values):
            problems.append(
                f"{name}: the figure column has {len(figures)} numbers "
                f"({', '.join(f.group(0) for f in figures) or 'none'}) but the source names "
                f"{len(values)} values ({', '.join(label for label, _ in values) or 'none'}); "
                "every number in the figure column needs a key, in order")
            continue
        for figure, (label, value) in zip(figures, values):
            checked += 1
            shown = printed_as(figure, value)
            if shown != figure.group(1).replace(",", ""):
                problems.append(f"{name}: figure {figure.group(0)} but {label} is {value:.6g} "
                                f"({shown} as printed)")
    return checked, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    checked, problems = check(args.doc, args.results)
    for problem in problems:
        print(f"{args.doc.name}: {problem}")
    if problems:
        print(f"{len(problems)} figure(s) not backed by {args.results}/*.json")
        return 1
    print(f"{checked} figures of {args.doc.name} and its pages (Figures and History tables) "
          f"found in {args.results}/*.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
