"""Regenerate the figures of BENCHMARKS.md's summary table from benchmarks/results/*.json.

Each row's `source` cell names a results file and one key per number of its `figure` cell
(`benchmarks/check_figures.py`'s docstring has the key syntax). This rewrites every number of
every `figure` cell with the value its key reads now, printed as the row prints it today: the
same decimals, `%` as a percentage of the stored fraction, thousands separators kept. The words
around the numbers stay. A row whose source cannot be read, or names more or fewer values than
its figure has numbers, is left as it is and reported: fix it by hand. Rows without a source
(a figure still pending) are skipped. The History tables are not touched (their files are
fixed revisions).

Run: python benchmarks/summary.py            # rewrite BENCHMARKS.md, list the changed rows
     python benchmarks/summary.py --check    # change nothing; list what would change, exit 1 if any
`make bench` runs it after the benchmarks.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check_figures():
    """benchmarks/check_figures.py, the parser of figures and sources both scripts share."""
    spec = importlib.util.spec_from_file_location("check_figures",
                                                  Path(__file__).with_name("check_figures.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


cf = _check_figures()


def reformat(cell: str, values: list[float]) -> str:
    """`cell` with its i-th number replaced by values[i], printed as that number is."""
    out, last = [], 0
    for figure, value in zip(cf.NUMBER.finditer(cell), values):
        shown = cf.printed_as(figure, value)
        if "," in figure.group(1):
            whole, dot, frac = shown.partition(".")
            sign = "-" if whole.startswith("-") else ""
            shown = f"{sign}{int(whole.lstrip('-')):,}{dot}{frac}"
        out += [cell[last:figure.start(1)], shown]
        last = figure.end(1)
    return "".join(out) + cell[last:]


def regenerate(doc: str, results: Path) -> tuple[str, list[str], list[str]]:
    """(the document with the summary table's figures regenerated, one line per changed row,
    one line per row left as it was because its source could not be used)."""
    lines = doc.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("|"))
    header = [c.strip() for c in lines[start].strip().strip("|").split("|")]
    fig_col = cf.require(cf.column(header, "figure"), header, "figure")
    src_col = cf.require(cf.column(header, "source"), header, "source")
    changed, skipped = [], []
    i = start + 2  # past the header and its |---| line
    while i < len(lines) and lines[i].lstrip().startswith("|"):
        new = _row(lines[i], fig_col, src_col, results, changed, skipped)
        lines[i] = new
        i += 1
    return "".join(lines), changed, skipped


def _row(line: str, fig_col: int, src_col: int, results: Path, changed: list,
         skipped: list) -> str:
    body, end = line.rstrip("\n"), line[len(line.rstrip("\n")):]
    cells = body.strip().strip("|").split("|")
    what, figure, source = cells[0].strip(), cells[fig_col], cells[src_col]
    if not cf.TOKEN.findall(source):
        return line  # no results file named (a pending figure)
    try:
        values = [v for _, v in cf.source_values(source, results)]
    except cf.FigureError as e:
        skipped.append(f"row '{what}': {e}")
        return line
    count = len(list(cf.NUMBER.finditer(figure)))
    if count != len(values):
        skipped.append(f"row '{what}': the figure has {count} numbers, the source names "
                       f"{len(values)} values")
        return line
    new_figure = reformat(figure, values)
    if new_figure == figure:
        return line
    changed.append(f"row '{what}': {figure.strip()} -> {new_figure.strip()}")
    cells[fig_col] = new_figure
    indent = body[:len(body) - len(body.lstrip())]
    return indent + "|" + "|".join(cells) + "|" + end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if any figure would change")
    args = parser.parse_args(argv)
    text, changed, skipped = regenerate(args.doc.read_text(), args.results)
    for line in skipped:
        print(f"left as it is: {line}")
    for line in changed:
        print(f"{'would change' if args.check else 'changed'}: {line}")
    if not args.check and changed:
        args.doc.write_text(text)
    print(f"{len(changed)} row(s) of {args.doc.name}'s summary "
          f"{'differ from' if args.check else 'regenerated from'} {args.results}/*.json"
          f"{f', {len(skipped)} left as they were' if skipped else ''}")
    return 1 if args.check and (changed or skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
