"""benchmarks/summary.py regenerates BENCHMARKS.md's summary figures from the results files:
today's table comes back unchanged, a planted wrong figure is rewritten to its results value (in
the row's own format), and a row whose source does not match its figure is left and named."""

import functools
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"
LOADER_ROW = "| loader throughput, 1 process, against 0 / 2 workers | 0.96x / 2.13x |"
SOAK_FIGURE = "0.377016 = 0.377016; 0.0; 8,000 = 8,000; 2.38x"


@functools.cache
def _summary():
    script = ROOT / "benchmarks" / "summary.py"
    spec = importlib.util.spec_from_file_location("bench_summary", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_regenerating_from_the_current_results_leaves_the_table_unchanged():
    doc = DOC.read_text()
    text, changed, skipped = _summary().regenerate(doc, RESULTS)
    assert changed == [] and skipped == [], "\n".join(changed + skipped)
    assert text == doc


def test_a_planted_wrong_figure_is_rewritten_from_its_results_file():
    doc = DOC.read_text()
    assert doc.count(LOADER_ROW) == 1 and doc.count(SOAK_FIGURE) == 1
    planted = doc.replace(LOADER_ROW, LOADER_ROW.replace("0.96x / 2.13x", "9.99x / 0.01x"))
    planted = planted.replace(SOAK_FIGURE, "0.1 = 0.2; 0.0; 1,234 = 5; 2.38x")
    text, changed, skipped = _summary().regenerate(planted, RESULTS)
    assert len(changed) == 2 and skipped == []
    # digits and separators as the planted row printed them: 0.1 -> one decimal, 1,234 -> commas
    assert "| 0.96x / 2.13x |" in text and "0.4 = 0.4; 0.0; 8,000 = 8000; 2.38x" in text
    assert text.replace("0.4 = 0.4; 0.0; 8,000 = 8000", "0.377016 = 0.377016; 0.0; 8,000 = 8,000") == doc


def test_a_row_whose_source_names_the_wrong_count_is_left_and_reported():
    doc = DOC.read_text()
    planted = doc.replace(LOADER_ROW, LOADER_ROW.replace("0.96x / 2.13x", "0.96x / 2.13x / 7x"))
    text, changed, skipped = _summary().regenerate(planted, RESULTS)
    assert text == planted and changed == []
    assert len(skipped) == 1 and "loader throughput" in skipped[0] and "3 numbers" in skipped[0]


def test_check_mode_writes_nothing_and_fails_on_a_difference(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(DOC.read_text().replace(LOADER_ROW, LOADER_ROW.replace("0.96x", "0.50x")))
    before = doc.read_text()
    assert _summary().main(["--doc", str(doc), "--results", str(RESULTS), "--check"]) == 1
    assert doc.read_text() == before and "0.50x / 2.13x -> 0.96x / 2.13x" in capsys.readouterr().out
    assert _summary().main(["--doc", str(doc), "--results", str(RESULTS)]) == 0
    assert doc.read_text() == DOC.read_text()
