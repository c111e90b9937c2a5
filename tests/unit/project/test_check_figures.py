"""Every figure of BENCHMARKS.md's summary reads as its page's row (docs/benchmarks/), and every
figure of the pages' Figures and History tables is found in benchmarks/results/*.json (History:
the results file of its run, results/history/) (benchmarks/check_figures.py); a planted wrong
figure, key or count is named. BENCHMARKS.md stays a one-line-a-figure summary."""

from pathlib import Path

import pytest

from tests import bench_scripts

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"
LOADER_PAGE_ROW = "| loader vs 0 / 2 workers | 0.96x / 2.13x |"
LOADER_SUMMARY_ROW = "| [loader vs 0 / 2 workers](docs/benchmarks/loader.md) | 0.96x / 2.13x |"


def _checker():
    return bench_scripts.load("check_figures", "check_figures")


def test_every_summary_figure_is_backed():
    checked, problems = _checker().check(DOC, RESULTS)
    assert not problems, ("figures of BENCHMARKS.md with no results file behind them:\n"
                          + "\n".join(problems))
    # the tables were read: one figure per number, not a table that parsed to nothing
    assert checked >= 400


def test_the_summary_is_one_short_line_a_figure():
    """At most 200 characters a row and 15 KB in all: the method, tables and history of an
    experiment live on its page, not in the summary."""
    text = DOC.read_text()
    long_rows = [line[:60] for line in text.splitlines() if len(line) > 200]
    assert not long_rows, f"BENCHMARKS.md rows over 200 characters: {long_rows}"
    assert len(text.encode()) <= 15_000, f"BENCHMARKS.md is {len(text.encode())} bytes"
    assert text.count("\n## ") == 0, "BENCHMARKS.md is the summary table only: sections go to pages"


@pytest.mark.parametrize("old, new, named", [
    # a figure one digit off: 0.9583 prints as 0.96, not 0.97
    (LOADER_PAGE_ROW, LOADER_PAGE_ROW.replace("0.96x", "0.97x"),
     "figure 0.97 but `loader.json` `throughput.baseline_workers0.ds_omni_over_this` is 0.95829 "
     "(0.96 as printed)"),
    # the summary's figure differs from its page's
    (LOADER_SUMMARY_ROW, LOADER_SUMMARY_ROW.replace("0.96x", "0.97x"),
     "summary row 'loader vs 0 / 2 workers': figure 0.97x / 2.13x but loader.md has 0.96x / 2.13x"),
    # a summary row whose page has no row of its name
    (LOADER_SUMMARY_ROW, LOADER_SUMMARY_ROW.replace("[loader vs", "[loader against"),
     "no row 'loader against 0 / 2 workers' in a table with figure and source columns of loader.md"),
    # a percentage is the stored fraction x 100 (a History row: its figures never change)
    ("| 99.8 %; 47 %; 0.06x;", "| 99.8 %; 49 %; 0.06x;",
     "figure 49 % but `prefetch.json@a3f57ea` `hidden_fraction_wall`"),
    # the end of a range is the max over every value selected
    ("| 1.00 vs 1.35-1.60 | max/mean", "| 1.00 vs 1.35-1.59 | max/mean",
     "figure 1.59 but `balance.json` "
     "`max of results[dp=8,mode=loader].rank_max_over_mean`"),
    # a key that is not in the file
    ("`throughput.{baseline_workers0,", "`throughput.{baseline_workers9,",
     "`loader.json` has no `baseline_workers9` under `throughput`"),
    # a History figure is read from the results file of that commit (results/history/)
    ("| 1.16 / 1.14 / 1.44 |", "| 1.16 / 1.14 / 1.45 |",
     "figure 1.45 but `pipeline.json@ddeca92` "
     "`text_heavy_1to9.stage0_over_uniform_cpu_s_median_of_paired_ratios`"),
    # a number added to a figure cell without a key for it
    (LOADER_PAGE_ROW, LOADER_PAGE_ROW.replace("2.13x |", "2.13x (earlier run 2.20x) |"),
     "the figure column has 3 numbers (0.96, 2.13, 2.20) but the source names 2 values"),
])
def test_planted_error_is_named(tmp_path, capsys, old, new, named):
    doc = bench_scripts.planted_tree(tmp_path, old, new)
    checked, problems = _checker().check(doc, RESULTS)
    # a wrong page figure also differs from its summary copy: that is named too, not instead
    mine = [p for p in problems if named in p]
    assert len(mine) == 1 and len(problems) <= 2, problems
    # the script's exit status and output say the same
    assert _checker().main(["--doc", str(doc), "--results", str(RESULTS)]) == 1
    assert named in capsys.readouterr().out


def test_clean_table_exits_zero(capsys):
    assert _checker().main(["--doc", str(DOC), "--results", str(RESULTS)]) == 0
    assert "figures of BENCHMARKS.md and its pages" in capsys.readouterr().out
