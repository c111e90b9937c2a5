"""Find the data's problems before training: `ds-omni data check` and the start-up check.

`startup_check` is the cheap part, run by `ds-omni train` on every source before anything is
built: the files exist, the schema's columns are in the first rows, relative media paths resolve
against their root. `check_data` scans every row (or `sample` rows per source) with the model's
tokenizer and processors and reports per source: rows, modalities, token-length and
items-per-sample histograms, rows over max_seq_len, missing or unreadable media, marker/item
mismatches, conversations stored as strings, extreme aspect ratios, and the columns the rows have
against the schema. Images decode on a thread pool (PIL releases the GIL); tokenising stays on the
calling thread (a fast tokenizer must not be shared between threads).
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np

from ds_omni.config import OmniConfig
from ds_omni.data.media import media_name, is_constant, load_image
from ds_omni.data.problems import MALFORMED, kind_of
from ds_omni.data.processing import SampleProcessor, conversation_string
from ds_omni.data.build import item_processors
from ds_omni.data.templates import training_template
from ds_omni.data.sources import (FIELD_OF_KIND, Locator, Source, columns, lookup,
                                  missing_column)
from ds_omni.errors import DataError

STARTUP_ROWS = 16  # rows of each source's first file the start-up check reads
EXAMPLES = 5  # example messages kept per problem kind


# --------------------------------------------------------------------------------- start-up
def startup_check(cfg: OmniConfig, media: bool = True, announce: bool = False) -> None:
    """Raise a `DataError` naming the source for what can be seen in its first rows: the
    schema's columns, and (with `media`) that relative media paths resolve. `announce`: print
    each source's layout and the columns taken."""
    for scfg in cfg.data.sources + cfg.data.eval_sources:
        source = Source(scfg, chunk_rows=cfg.data.chunk_rows)
        if not any(source.file_rows):
            raise DataError(f"data source '{source.name}': its {len(source.files)} file(s) hold "
                            f"no rows (e.g. {source.files[0]!r}); give it data, or remove it")
        rows = [(Locator(source.name, 0, i), source.fetch(Locator(source.name, 0, i)))
                for i in range(min(STARTUP_ROWS, source.file_rows[0]))]
        bad = [row[MALFORMED] for _, row in rows if MALFORMED in row]
        if bad and (scfg.on_bad_sample == "error" or len(bad) == len(rows)):
            raise DataError(f"data source '{source.name}': {bad[0]}")
        rows = [(loc, row) for loc, row in rows if MALFORMED not in row]
        if rows:
            if announce:
                print(f"ds-omni: data source '{source.name}': {source.layout.describe()}",
                      flush=True)
            _check_columns(source, rows)
        if rows and media:
            _check_media_paths(source, rows)


def _check_columns(source: Source, rows: list[tuple[Locator, dict]]) -> None:
    layout, where = source.layout, f"data source '{source.name}'"
    if all(lookup(row, layout.text) is None for _, row in rows):
        raise DataError(f"{where}: {missing_column(source, 'text', layout.text, rows[0][1])}")
    for kind, marker in source.cfg.schema.markers().items():
        field, column = FIELD_OF_KIND[kind], layout.media.get(kind)
        marked = any(marker in str(lookup(row, layout.text)) for _, row in rows)
        if marked and (not column or all(lookup(row, column) is None for _, row in rows)):
            hint = missing_column(source, field, column, rows[0][1]) if column else \
                f"schema.{field} is null; set it to the column holding the {field}s"
            raise DataError(f"{where}: the text has {marker} markers but no row has their "
                            f"{field}s: {hint}")


def _check_media_paths(source: Source, rows: list[tuple[Locator, dict]]) -> None:
    """A missing relative file stops training under "error" (and a root that resolves none of
    the first rows is wrong under any policy): say so now, naming the root."""
    where, problems = f"data source '{source.name}'", []
    for loc, row in rows:
        try:
            source.parts(row, loc)
        except DataError as e:
            problems.append(e)
    if problems and (source.cfg.on_bad_sample == "error" or len(problems) == len(rows)):
        raise DataError(f"{where}: {problems[0]}")


# ------------------------------------------------------------------------------------ scan
def check_data(cfg: OmniConfig, built, *, sample: int | None = None, workers: int = 2,
               progress: bool = True) -> dict:
    """{"sources": {name: report}, "errors": [...]} for every source of `cfg`."""
    from tqdm import tqdm
    sources = [Source(s, chunk_rows=cfg.data.chunk_rows) for s in cfg.data.sources]
    plans = {s.name: _row_plan(s, sample) for s in sources}
    total = sum(len(rows) if rows is not None else len(s) for s, rows in
                ((s, plans[s.name]) for s in sources))
    bar = tqdm(total=total, desc="data check", unit="row", file=sys.stderr, disable=not progress)
    out: dict[str, Any] = {"sources": {}, "errors": []}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for source in sources:
            report = _SourceCheck(source, cfg, _processor(cfg, built, source), pool)
            for loc, row in _rows(source, plans[source.name]):
                report.add(loc, row)
                bar.update(1)
            out["sources"][source.name] = report.result()
            out["errors"] += [f"source '{source.name}': {e}" for e in report.errors()]
    bar.close()
    return out


def _row_plan(source: Source, sample: int | None) -> list[int] | None:
    """Global row indices to check (evenly spread), or None for every row."""
    n = len(source)
    if sample is None or sample >= n:
        return None
    return sorted(set(np.linspace(0, n - 1, sample).round().astype(int).tolist()))


def _rows(source: Source, plan: list[int] | None) -> Iterator[tuple[Locator, dict]]:
    if plan is None:
        for chunk in source.chunks:
            yield from source.stream(chunk, chunk.start)
        return
    starts = np.cumsum([0] + source.file_rows)
    for g in plan:
        f = int(np.searchsorted(starts, g, side="right") - 1)
        loc = Locator(source.name, f, int(g - starts[f]))
        yield loc, source.fetch(loc)


def _processor(cfg: OmniConfig, built, source: Source) -> SampleProcessor:
    """Measures every sample whole (no length limit) so over-long ones are counted, not raised;
    conversation strings are parsed here and counted separately."""
    return SampleProcessor(
        tokenizer=built.tokenizer, family=built.family,
        item_processors=item_processors(cfg, built, [source.cfg]),
        markers=source.cfg.schema.markers(),
        max_seq_len=10 ** 9, conversation_strings="parse", image_aspect="crop",
        template=training_template(cfg.data.template, built),
        max_image_pixels=cfg.data.max_image_pixels)


class _SourceCheck:
    """The tallies of one source."""

    def __init__(self, source: Source, cfg: OmniConfig, processor: SampleProcessor, pool):
        self.source, self.cfg, self.processor, self.pool = source, cfg, processor, pool
        self.rows = 0
        self.bad = 0  # rows training would not use
        self.kinds: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}
        self.modalities = {"image": 0, "audio": 0, "video": 0, "text_only": 0}
        self.tokens: list[int] = []
        self.items: dict[int, int] = {}
        self.extreme_aspect = 0
        self.blank: list[str] = []  # images of one value in every pixel
        self.seen_columns: dict[str, int] = {}

    def add(self, loc: Locator, row: dict) -> None:
        self.rows += 1
        if self.rows <= 1000:
            for c in columns(row):
                self.seen_columns[c] = self.seen_columns.get(c, 0) + 1
        problems = self._problems(loc, row)
        for kind, message in problems:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if len(self.examples.setdefault(kind, [])) < EXAMPLES:
                self.examples[kind].append(message)
        if any(self._spoils(kind) for kind, _ in problems):
            self.bad += 1

    def _parses(self) -> bool:
        return self.source.cfg.schema.conversation_strings == "parse"

    def _spoils(self, kind: str) -> bool:
        """Training would not use the row (or would train it wrongly) under the policies."""
        if kind == "conversation_string":
            return not self._parses()
        return kind != "overlong" or self.cfg.data.overlong == "error"

    def _problems(self, loc: Locator, row: dict) -> list[tuple[str, str]]:
        try:
            text, media, sid = self.source.parts(row, loc)
        except DataError as e:
            return [(kind_of(e), str(self.source.explain(e, row)))]
        problems = []
        if isinstance(text, str) and conversation_string(text) is not None:
            problems.append(("conversation_string", f"{sid}: the text is a JSON conversation "
                             "stored as a string"))
        images = media.get("vision", [])
        self.modalities["image"] += bool(images)
        self.modalities["audio"] += bool(media.get("audio"))
        self.modalities["video"] += bool(media.get("video"))
        self.modalities["text_only"] += not media
        self.items[sum(len(v) for v in media.values())] = \
            self.items.get(sum(len(v) for v in media.values()), 0) + 1
        limit = self.cfg.data.max_image_pixels
        for image, result in zip(images, self.pool.map(_inspect_image, images,
                                                       [limit] * len(images))):
            if isinstance(result, DataError):
                problems.append((kind_of(result), f"{sid}: {result}"))
                continue
            size, blank = result
            if blank:  # trains, but likely not as meant: flagged, not a bad row
                self.blank.append(f"{sid}: every pixel of the image {media_name(image)}has one "
                                  "value (a blank image, or one saved in a form that lost its "
                                  "pixels); replace it")
            if max(size) > self.cfg.data.max_aspect_ratio * max(1, min(size)):
                self.extreme_aspect += 1
        if any(kind != "conversation_string" for kind, _ in problems):
            return problems  # a broken image: measuring would report it again
        try:
            size = self.processor.measure(text=text, media=media, sample_id=sid,
                                          source=self.source.name)
        except DataError as e:
            return problems + [(kind_of(e), str(self.source.explain(e, row)))]
        self.tokens.append(size.tokens)
        if size.tokens > self.cfg.data.max_seq_len:
            problems.append(("overlong", f"{sid}: {size.tokens} tokens > data.max_seq_len="
                             f"{self.cfg.data.max_seq_len}"))
        return problems

    def result(self) -> dict:
        schema, layout = self.source.cfg.schema, self.source.layout
        fields = {"text": layout.text, **{FIELD_OF_KIND[k]: c for k, c in layout.media.items()},
                  "id": schema.id}
        return {
            "format": self.source.fmt, "files": len(self.source.files),
            "layout": layout.name, "layout_detected": layout.detected,
            "rows": len(self.source), "checked": self.rows,
            "columns": sorted(self.seen_columns),
            "schema": {f: {"column": c, "rows_with_it": self.seen_columns.get(c, 0) if c else None}
                       for f, c in fields.items()},
            "modalities": self.modalities,
            "tokens": _histogram(self.tokens, self.cfg.data.max_seq_len),
            "items_per_sample": {str(k): v for k, v in sorted(self.items.items())},
            "over_max_seq_len": self.kinds.get("overlong", 0),
            "extreme_aspect": self.extreme_aspect,
            "blank_images": {"count": len(self.blank), "examples": self.blank[:EXAMPLES]},
            "problems": dict(sorted(self.kinds.items())),
            "bad_rows": self.bad,
            "examples": self.examples,
            "policy": {"on_bad_sample": self.source.cfg.on_bad_sample,
                       "overlong": self.cfg.data.overlong,
                       "conversation_strings": schema.conversation_strings},
        }

    def errors(self) -> list[str]:
        """What would stop or spoil training under the source's policies."""
        out = []
        if self.rows and self.bad == self.rows:
            out.append(f"all {self.rows} checked rows are bad ({dict(sorted(self.kinds.items()))})")
        elif self.bad and self.source.cfg.on_bad_sample == "error":
            stopping = {k: n for k, n in self.kinds.items()
                        if k not in ("overlong", "conversation_string")}
            if stopping:
                out.append(f"bad rows {stopping} would stop training (on_bad_sample=\"error\"; "
                           "fix them or set it to \"skip\")")
        if self.kinds.get("overlong") and self.cfg.data.overlong == "error":
            out.append(f"{self.kinds['overlong']} rows over data.max_seq_len="
                       f"{self.cfg.data.max_seq_len} would stop training (raise it, or set "
                       "data.overlong=\"truncate\")")
        if self.kinds.get("conversation_string") and not self._parses():
            out.append(f"{self.kinds['conversation_string']} rows hold a conversation as a JSON "
                       f"string (schema.conversation_strings="
                       f"\"{self.source.cfg.schema.conversation_strings}\")")
        return out


def _inspect_image(value, max_pixels: int) -> tuple[tuple[int, int], bool] | DataError:
    """((width, height), whether every pixel has one value) of an image that fully decodes,
    else its error."""
    try:
        image = load_image(value, max_pixels)
    except DataError as e:
        return e
    return image.size, is_constant(image)


def _histogram(values: list[int], max_seq_len: int) -> dict:
    """Counts per power-of-two bucket ("<=64", ...), with min/median/max."""
    if not values:
        return {}
    buckets: dict[str, int] = {}
    for v in sorted(values):
        edge = 2 ** max(4, math.ceil(math.log2(max(v, 1))))
        buckets[f"<={edge}"] = buckets.get(f"<={edge}", 0) + 1
    arr = np.array(values)
    return {"min": int(arr.min()), "median": float(np.median(arr)), "max": int(arr.max()),
            "buckets": buckets}


# ----------------------------------------------------------------------------------- output
def format_report(report: dict) -> str:
    """The report for people: one block per source, then the errors."""
    lines = []
    for name, r in report["sources"].items():
        lines.append(f"source '{name}': {r['format']}, {r['files']} file(s), {r['rows']} rows, "
                     f"{r['checked']} checked")
        schema = ", ".join(f"{f}={v['column']!r} ({v['rows_with_it']} rows)"
                           for f, v in r["schema"].items() if v["column"])
        lines.append(f"  columns: {r['columns']}")
        how = "detected from the first rows" if r["layout_detected"] else "schema.layout"
        lines.append(f"  layout: {r['layout']} ({how}); columns taken: {schema}")
        lines.append(f"  modalities: {r['modalities']}; items per sample: "
                     f"{r['items_per_sample']}")
        if r["tokens"]:
            t = r["tokens"]
            lines.append(f"  tokens: min {t['min']}, median {t['median']:g}, max {t['max']}; "
                         f"{t['buckets']}; over max_seq_len: {r['over_max_seq_len']}")
        lines.append(f"  extreme aspect ratio: {r['extreme_aspect']}; blank images: "
                     f"{r['blank_images']['count']}; bad rows: {r['bad_rows']}"
                     f" {r['problems'] or ''}")
        for kind, examples in [*r["examples"].items(),
                               ("blank_image", r["blank_images"]["examples"])]:
            for e in examples[:2]:
                lines.append(f"    {kind}: {e}")
    lines += [f"ERROR: {e}" for e in report["errors"]] or ["no errors"]
    return "\n".join(lines)
