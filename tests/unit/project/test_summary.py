"""benchmarks/summary.py regenerates the figures of the benchmark pages from the results files
and BENCHMARKS.md's from the pages: today's files come back unchanged, a planted wrong figure is
rewritten to its results value (in the row's own format), and a row whose source does not match
its figure is left and named.
`make bench` (benchmarks/run_all.py) and the rows agree: every row's command is a run of it
(at the row's settings into results/, or shortened into results/quick/), or is excused with a
reason; a planted row command it does not run is named."""

import re
from pathlib import Path

from tests import bench_scripts

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"
LOADER_ROW = "| loader vs 0 / 2 workers | 0.96x / 2.13x |"  # its page's row
LOADER_SUMMARY = "| [loader vs 0 / 2 workers](docs/benchmarks/loader.md) | 0.96x / 2.13x |"
SOAK_FIGURE = "| 0.377016 = 0.377016; 0.0; 8,000 = 8,000; 2.38x | 500-step"


def _summary():
    return bench_scripts.load("summary", "bench_summary")


def _changed_files(texts: dict) -> dict:
    return {path: text for path, text in texts.items() if text != path.read_text()}


def test_regenerating_from_the_current_results_leaves_every_file_unchanged():
    texts, changed, skipped = _summary().regenerate_all(DOC, RESULTS)
    assert changed == [] and skipped == [], "\n".join(changed + skipped)
    assert DOC in texts and len(texts) > 10 and _changed_files(texts) == {}


def test_a_planted_wrong_figure_is_rewritten_from_its_results_file(tmp_path):
    doc = bench_scripts.planted_tree(tmp_path, LOADER_ROW,
                                     LOADER_ROW.replace("0.96x / 2.13x", "9.99x / 0.01x"))
    soak = tmp_path / "docs" / "benchmarks" / "soak.md"
    planted = soak.read_text()
    assert planted.count(SOAK_FIGURE) == 1
    soak.write_text(planted.replace(SOAK_FIGURE, SOAK_FIGURE.replace(
        "0.377016 = 0.377016; 0.0; 8,000 = 8,000", "0.1 = 0.2; 0.0; 1,234 = 5")))
    texts, changed, skipped = _summary().regenerate_all(doc, RESULTS)
    assert len(changed) == 3 and skipped == [], changed  # two pages' rows, the soak's summary
    # digits and separators as the planted row printed them: 0.1 -> one decimal, 1,234 -> commas
    assert LOADER_ROW in texts[tmp_path / "docs" / "benchmarks" / "loader.md"]
    assert "| 0.4 = 0.4; 0.0; 8,000 = 8000; 2.38x |" in texts[soak]
    # the summary takes the page's figure, as the page now prints it
    assert texts[doc] == DOC.read_text().replace("0.377016 = 0.377016; 0.0; 8,000 = 8,000",
                                                 "0.4 = 0.4; 0.0; 8,000 = 8000")


def test_a_summary_figure_is_taken_from_its_page(tmp_path):
    doc = bench_scripts.planted_tree(tmp_path, LOADER_SUMMARY,
                                     LOADER_SUMMARY.replace("0.96x", "0.50x"))
    texts, changed, skipped = _summary().regenerate_all(doc, RESULTS)
    assert changed == ["summary row 'loader vs 0 / 2 workers': 0.50x / 2.13x -> 0.96x / 2.13x"]
    assert texts[doc] == DOC.read_text()


def test_a_row_whose_source_names_the_wrong_count_is_left_and_reported():
    page = (ROOT / "docs" / "benchmarks" / "loader.md").read_text()
    planted = page.replace(LOADER_ROW, LOADER_ROW.replace("0.96x / 2.13x", "0.96x / 2.13x / 7x"))
    text, changed, skipped = _summary().regenerate(planted, RESULTS)
    assert text == planted and changed == []
    assert len(skipped) == 1 and "loader vs 0 / 2 workers" in skipped[0] and "3 numbers" in skipped[0]


def test_check_mode_writes_nothing_and_fails_on_a_difference(tmp_path, capsys):
    doc = bench_scripts.planted_tree(tmp_path, LOADER_ROW, LOADER_ROW.replace("0.96x", "0.50x"))
    page = tmp_path / "docs" / "benchmarks" / "loader.md"
    before = page.read_text()
    assert _summary().main(["--doc", str(doc), "--results", str(RESULTS), "--check"]) == 1
    assert page.read_text() == before and "0.50x / 2.13x -> 0.96x / 2.13x" in capsys.readouterr().out
    assert _summary().main(["--doc", str(doc), "--results", str(RESULTS)]) == 0
    assert page.read_text() == (ROOT / "docs" / "benchmarks" / "loader.md").read_text()


# ------------------------------------------------------------- make bench and the rows' commands
def _run_all():
    return bench_scripts.load("run_all", "bench_run_all")


def row_commands(cell: str, previous: list[str]) -> list[str]:
    """A command cell as commands without the interpreter ("loader.py --only memory"):
    "(same)" repeats the row above's; "(and `--world 4`)" is the same script again."""
    if cell.strip() == "(same)":
        return previous
    tokens = re.findall(r"`([^`]+)`", cell)
    if not tokens:
        return []
    first = tokens[0].split("benchmarks/", 1)[-1]
    script = first.split()[0]
    return [first] + [f"{script} {extra}" for extra in tokens[1:]]


def unmatched(doc: Path) -> list[str]:
    """Rows of the summary whose command make bench / --full does not run with the row's
    arguments and files (the source of its page's row), and that run_all.NOT_RUN does not
    excuse."""
    ra, cf = _run_all(), bench_scripts.load("check_figures", "check_figures")
    benches = {b.command: b for b in ra.BENCHES}
    problems, previous = [], []
    for what, _, command, page in cf.summary_rows(doc):
        commands = row_commands(command, previous)
        previous = commands
        row, _, src_col = cf.page_row(page, what)
        files = set(re.findall(r"`([\w.]+\.json)`", row[src_col]))
        excused = {f for f in files if f in ra.NOT_RUN}
        if any(c.split()[0] in ra.NOT_RUN for c in commands):
            continue
        written = set()
        for c in commands:
            if c in ra.NOT_RUN:
                continue
            if c not in benches:
                problems.append(f"row '{what[:50]}': `{c}` is not a run of run_all.py")
            else:
                written |= set(benches[c].writes)
        if files - excused - written and all(c in benches or c in ra.NOT_RUN for c in commands):
            problems.append(f"row '{what[:50]}': its files {sorted(files - excused - written)} "
                            f"are not what {commands} write")
    return problems


def test_every_rows_command_is_a_run_of_make_bench_or_excused():
    assert unmatched(DOC) == []
    ra = _run_all()
    assert all(ra.NOT_RUN.values()) and all(b.full_only or b.limit for b in ra.BENCHES)


def test_a_row_whose_command_make_bench_does_not_run_is_named(tmp_path):
    row = "`loader.py --only throughput --repeats 7 --steps 40`"
    doc = bench_scripts.planted_tree(tmp_path, row, row.replace("--repeats 7", "--repeats 9"))
    problems = unmatched(doc)
    assert len(problems) == 1 and "--repeats 9" in problems[0]


def test_make_bench_writes_a_rows_file_only_at_the_rows_settings():
    """Quick (shorter) runs go to results/quick/; a run into results/ has the row's own
    arguments; every script run sends its files where DS_OMNI_BENCH_RESULTS says."""
    ra = _run_all()
    plan = ra.plan_runs(full=False, only=None)
    assert plan and not any(b.full_only for b, _ in plan)
    for b, where in plan:
        if where == ra.RESULTS:
            assert b.quick is None and b.args(False) == b.command.split()[1:]
        else:
            assert where == ra.QUICK_RESULTS and b.quick is not None
    for b, where in ra.plan_runs(full=True, only=None):
        assert where == ra.RESULTS and b.args(True) == b.command.split()[1:]
    for b in ra.BENCHES:
        text = (ROOT / "benchmarks" / b.script).read_text()
        assert "DS_OMNI_BENCH_RESULTS" in text or "from benchmarks.tensor_parallel import" \
            in text, b.script
