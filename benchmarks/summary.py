"""Regenerate the figures of BENCHMARKS.md and its pages from benchmarks/results/*.json.

Each row of a page's figure table (docs/benchmarks/<name>.md, a table with `figure` and `source`
columns) names a results file and one key per number of its `figure` cell
(`benchmarks/check_figures.py`'s docstring has the key syntax). This rewrites every number of
every such `figure` cell with the value its key reads now, printed as the row prints it today: the
same decimals, `%` as a percentage of the stored fraction, thousands separators kept. The words
around the numbers stay. Then each summary row of BENCHMARKS.md takes its page row's figure. A
row whose source cannot be read, or names more or fewer values than its figure has numbers, is
left as it is and reported: fix it by hand. Rows without a source (a figure still pending) and
History rows (`name.json@rev`: fixed revisions) are skipped.

Run: python benchmarks/summary.py            # rewrite the files, list the changed rows
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
    """(the page `doc` with the figures of its figure tables regenerated, one line per changed
    row, one line per row left as it was because its source could not be used)."""
    lines = doc.splitlines(keepends=True)
    changed, skipped = [], []
    fig_col = src_col = None
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            fig_col = src_col = None  # a table ended
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if i == 0 or not lines[i - 1].lstrip().startswith("|"):  # a header
            fig_col, src_col = cf.column(cells, "figure"), cf.column(cells, "source")
        elif fig_col is not None and src_col is not None and not set(cells[0]) <= {"-"}:
            lines[i] = _row(line, fig_col, src_col, results, changed, skipped)
    return "".join(lines), changed, skipped


def regenerate_all(doc_path: Path, results: Path) -> tuple[dict[Path, str], list[str], list[str]]:
    """({file: its text regenerated} for BENCHMARKS.md and every page, changed rows, rows left):
    the pages' figure tables from the results, then the summary's figures from the pages."""
    texts, changed, skipped = {}, [], []
    for page in cf.pages_of(doc_path):
        text, more, left = regenerate(page.read_text(), results)
        texts[page] = text
        changed += [f"{page.name} {line}" for line in more]
        skipped += [f"{page.name} {line}" for line in left]
    texts[doc_path] = _summary(doc_path, texts, changed)
    return texts, changed, skipped


def _summary(doc_path: Path, pages: dict[Path, str], changed: list[str]) -> str:
    """BENCHMARKS.md with each summary row's figure taken from its page's row."""
    figures = {}
    for page, text in pages.items():
        for header, rows, fig_col, _ in cf.figure_tables(text):
            figures.update({(page.resolve(), row[0]): row[fig_col] for row in rows})
    lines = doc_path.read_text().splitlines(keepends=True)
    for what, figure, _, page in cf.summary_rows(doc_path):
        new = figures.get((page.resolve(), what))
        if new is None or new == figure:
            continue
        i = next(i for i, line in enumerate(lines) if line.startswith(f"| [{what}]("))
        cells = lines[i].rstrip("\n").strip().strip("|").split("|")
        cells[1] = f" {new} "
        lines[i] = "|" + "|".join(cells) + "|\n"
        changed.append(f"summary row '{what}': {figure} -> {new}")
    return "".join(lines)


def _row(line: str, fig_col: int, src_col: int, results: Path, changed: list,
         skipped: list) -> str:
    body, end = line.rstrip("\n"), line[len(line.rstrip("\n")):]
    cells = body.strip().strip("|").split("|")
    what, figure, source = cells[0].strip(), cells[fig_col], cells[src_col]
    if not cf.TOKEN.findall(source) or "@" in source:
        return line  # no results file named (a pending figure), or a History row
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
    texts, changed, skipped = regenerate_all(args.doc, args.results)
    for line in skipped:
        print(f"left as it is: {line}")
    for line in changed:
        print(f"{'would change' if args.check else 'changed'}: {line}")
    if not args.check:
        for path, text in texts.items():
            if text != path.read_text():
                path.write_text(text)
    print(f"{len(changed)} row(s) of {args.doc.name} and its pages "
          f"{'differ from' if args.check else 'regenerated from'} {args.results}/*.json"
          f"{f', {len(skipped)} left as they were' if skipped else ''}")
    return 1 if args.check and (changed or skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
