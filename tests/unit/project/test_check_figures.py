"""Every figure of BENCHMARKS.md's summary table is found in benchmarks/results/*.json, and every
figure of its History table in the results file of its run (results/history/) (benchmarks/check_figures.py); a planted
wrong figure, key or count is named."""

from pathlib import Path

import pytest

from tests import bench_scripts

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"
LOADER_ROW = "| loader throughput, 1 process, against 0 / 2 workers | 0.96x / 2.13x |"


def _checker():
    return bench_scripts.load("check_figures", "check_figures")


def test_every_summary_figure_is_backed():
    checked, problems = _checker().check(DOC, RESULTS)
    assert not problems, ("figures of BENCHMARKS.md with no results file behind them:\n"
                          + "\n".join(problems))
    # the table was read: one figure per number, not a table that parsed to nothing
    assert checked >= 100


def _planted(tmp_path, old: str, new: str) -> Path:
    """A copy of BENCHMARKS.md with `old` (in the summary table) replaced by `new`."""
    text = DOC.read_text()
    assert text.count(old) == 1, f"the plant's anchor {old!r} is not in BENCHMARKS.md once"
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(text.replace(old, new))
    return doc


@pytest.mark.parametrize("old, new, named", [
    # a figure one digit off: 0.9583 prints as 0.96, not 0.97
    (LOADER_ROW, LOADER_ROW.replace("0.96x", "0.97x"),
     "figure 0.97 but `loader.json` `throughput.baseline_workers0.ds_omni_over_this` is 0.95829 "
     "(0.96 as printed)"),
    # a percentage is the stored fraction x 100 (a History row: its figures never change)
    ("| 99.8 %; 47 %; 0.06x;", "| 99.8 %; 49 %; 0.06x;",
     "figure 49 % but `prefetch.json@a3f57ea` `hidden_fraction_wall`"),
    # the end of a range is the max over every value selected
    ("| 1.00 vs 1.35-1.60 |", "| 1.00 vs 1.35-1.59 |",
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
    (LOADER_ROW, LOADER_ROW.replace("2.13x |", "2.13x (earlier run 2.20x) |"),
     "the figure column has 3 numbers (0.96, 2.13, 2.20) but the source names 2 values"),
])
def test_planted_error_is_named(tmp_path, capsys, old, new, named):
    doc = _planted(tmp_path, old, new)
    checked, problems = _checker().check(doc, RESULTS)
    assert len(problems) == 1 and named in problems[0], problems
    # the script's exit status and output say the same
    assert _checker().main(["--doc", str(doc), "--results", str(RESULTS)]) == 1
    assert named in capsys.readouterr().out


def test_clean_table_exits_zero(capsys):
    assert _checker().main(["--doc", str(DOC), "--results", str(RESULTS)]) == 0
    assert "figures of BENCHMARKS.md (summary and History tables) found" in capsys.readouterr().out
