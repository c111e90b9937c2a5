"""Skipped samples made visible: `<output_dir>/skipped.jsonl` (one line per sample: id, source,
locator, step, kind, reason), a console line when some were skipped, and per-source totals for
the report. The loader collects them (`OmniLoader.take_skipped`); these functions gather them
from every data-parallel rank, so every rank calls them together.
"""

from __future__ import annotations

import json
from pathlib import Path

SKIPPED_FILE = "skipped.jsonl"


def flush_skipped(loader, output_dir: str | Path, rank: int, step: int) -> None:
    """Append the samples skipped since the last flush on any rank to skipped.jsonl (rank 0)."""
    entries = [e for part in loader.comm.world_all_gather(loader.take_skipped()) for e in part]
    if rank != 0 or not entries:
        return
    path = Path(output_dir) / SKIPPED_FILE
    with path.open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
    counts: dict[str, int] = {}
    for e in entries:
        counts[e["source"]] = counts.get(e["source"], 0) + 1
    print(f"ds-omni: step {step}: skipped {len(entries)} bad sample(s) "
          f"({', '.join(f'{s}: {n}' for s, n in sorted(counts.items()))}); ids and reasons in "
          f"{path}", flush=True)


def skipped_totals(loader) -> dict[str, int]:
    """Samples skipped so far per source, over all data-parallel ranks."""
    totals = {name: 0 for name in loader.sources}
    for part in loader.comm.world_all_gather(dict(loader.skipped)):
        for name, n in part.items():
            totals[name] = totals.get(name, 0) + n
    return totals
