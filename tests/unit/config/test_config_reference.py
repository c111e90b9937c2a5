"""docs/config.md is generated from the config dataclasses (ds_omni/config/reference.py): it says
what the code does, and a field without a docstring cannot be added unnoticed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

import ds_omni.config
from ds_omni.config import reference
from ds_omni.errors import ConfigError


def test_docs_config_md_matches_the_code():
    written = reference.DOCS_PATH.read_text() if reference.DOCS_PATH.exists() else ""
    assert written == reference.reference(), (
        f"docs/config.md disagrees with the config dataclasses in ds_omni/config/; regenerate it "
        f"with `{reference.REGENERATE}` and commit the result")


def test_every_config_class_has_a_table():
    exported = {getattr(ds_omni.config, n) for n in ds_omni.config.__all__}
    classes = {c for c in exported if isinstance(c, type) and dataclasses.is_dataclass(c)}
    in_tables = {cls for cls, _ in reference.tables()}
    assert classes <= in_tables, f"config classes no field of OmniConfig reaches: " \
        f"{sorted(c.__name__ for c in classes - in_tables)}"


def test_tables_follow_the_nesting():
    paths = [paths for _, paths in reference.tables()]
    assert paths[0] == [""]
    assert [p[0] for p in paths if "." not in p[0] and p[0]] == \
        [f.name for f in dataclasses.fields(ds_omni.config.OmniConfig) if f.name != "version"]
    assert ["data.sources[]", "data.eval_sources[]"] in paths
    assert ["data.sources[].schema"] in paths and ["model.lora"] in paths


@dataclass(kw_only=True)
class _HalfDocumented:
    documented: int = 0
    """Has one."""
    bare: int = 1


def test_a_field_without_a_docstring_is_named():
    with pytest.raises(ConfigError, match=r"_HalfDocumented\.bare \(tests/unit/config/"
                                          r"test_config_reference\.py:\d+\).*one-sentence"):
        reference.field_docs(_HalfDocumented)


def test_cells_keep_markup_out():
    assert reference._cell("a | b <dir>/x `<image> | c`") == "a \\| b &lt;dir&gt;/x `<image> \\| c`"
    assert reference.type_name(int | None) == "int | null"


def test_a_docs_reference_becomes_a_link_to_its_section():
    """`docs/page.md#start` in a field docstring links the section whose heading starts so
    (a two-line docstring cannot hold a long anchor); inside a code span it stays text."""
    text = reference._doc_links("More: docs/data.md#loading-ahead. `docs/data.md` stays.")
    assert "[data.md](data.md#loading-ahead-prefetch-loader-processes-pinned-cores)" in text
    assert "`docs/data.md` stays" in text
