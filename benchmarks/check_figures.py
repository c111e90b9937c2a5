"""Every figure of BENCHMARKS.md's summary and History tables, found in its results file.

The summary table is the first table of BENCHMARKS.md; every later table with `figure` and
`source` columns (the History of earlier runs) is checked the same way. Every number in a
`figure` cell is a figure, and its `source` cell names, in backticks, a results file of
`benchmarks/results/` and then one key per number, in the order the numbers are printed:

    | what | figure | baseline | source | command |
    |---|---|---|---|---|
    | loader throughput, 0 / 2 workers | 0.96x / 2.13x | ... | `loader.json`:
      `throughput.baseline_workers0.ds_omni_over_this`,
      `throughput.baseline_workers2.ds_omni_over_this` | ... |      (on one line in the table)

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


def check(doc_path: Path, results: Path) -> tuple[int, list[str]]:
    """(figures checked, one line per figure not backed) for the summary table of `doc_path`
    and every later table with `figure` and `source` columns."""
    found = tables(doc_path.read_text())
    for name in ("figure", "source"):  # the summary table must have both
        require(column(found[0][0], name), found[0][0], name)
    checked, problems = 0, []
    for header, rows in found:
        fig_col, src_col = column(header, "figure"), column(header, "source")
        if fig_col is not None and src_col is not None:
            n, more = check_rows(rows, fig_col, src_col, results)
            checked, problems = checked + n, problems + more
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
    print(f"{checked} figures of {args.doc.name} (summary and History tables) found in "
          f"{args.results}/*.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
