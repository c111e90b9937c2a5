"""The recipe for a new parallel axis (docs/architecture.md, "Where a new parallel feature goes"):
every feature of the composition table reaches its config docs, its evidence counters, its
process groups, the plan search and the baselines through the extension points the recipe names,
and the recipe names at most six existing modules. Pure; no process group."""

from __future__ import annotations

import re
from pathlib import Path

import ds_omni.model.attention  # noqa: F401  (registers ring attention's counters)
from ds_omni.config.composition import DEGREES, FEATURES, FIELDS, PARALLEL_FIELDS, Setting
from ds_omni.parallel import groups as groups_module
from ds_omni.parallel.evidence import COUNTERS, SPCounts
from ds_omni.parallel.groups import RankGroups
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.parallelize import _ring
from ds_omni.sim import SimPlan, baselines, from_config, search

ROOT = Path(__file__).resolve().parents[3]
NAMES = [f.name for f in FEATURES]


def test_every_feature_is_a_setting_field_with_its_docs_rows():
    composition, config = (ROOT / "docs/composition.md").read_text(), (
        ROOT / "docs/config.md").read_text()
    for name in NAMES:
        assert hasattr(Setting(), name) and name in FIELDS, name
        assert f"| `{name}` |" in composition, f"{name}: no row in docs/composition.md"
        if name in PARALLEL_FIELDS:
            assert f"| `{name}` |" in config, f"parallel.{name}: no row in docs/config.md"


def test_evidence_counters_are_registered_by_features_and_documented():
    parallelism = (ROOT / "docs/parallelism.md").read_text()
    assert {"ring_steps", "ring_bytes"} <= {c for c, (f, _) in COUNTERS.items() if f == "cp"}
    for counter, (feature, what) in COUNTERS.items():
        assert feature in NAMES and what, counter
        assert f"sp_{counter}" in parallelism, f"sp_{counter}: not in docs/parallelism.md"
    counts = SPCounts()
    counts.ring_steps += 2
    assert counts.as_metrics() == {f"sp_{c}": 2 * (c == "ring_steps") for c in COUNTERS}


def test_axis_groups_are_made_and_printed_from_the_plan_alone(monkeypatch):
    monkeypatch.setattr(groups_module.dist, "new_group", lambda members: tuple(members))
    for sp, cp in ((1, 2), (2, 2)):
        plan = ParallelPlan(world_size=8, dp=8 // (sp * cp), sp=sp * cp, cp=cp)
        kinds = plan.axis_group_ranks()
        assert {f"{k}_groups" for k in kinds} <= set(plan.layout())
        for rank in range(8):
            mine = groups_module.axis_groups(plan, rank)
            assert set(mine) == {k for k, g in kinds.items() if len(g[0]) > 1}
            assert all(rank in members for _, members in mine.values())
            ring = _ring(RankGroups(dp=None, reorder=None, mpu=None, blocks={}, comm=None,
                                    step_comm=None, rank=rank, axes=mine))
            assert ring.size == cp and ring.members[ring.rank] == rank


def test_a_degree_without_a_search_rule_is_searched_described_and_off_in_baselines(monkeypatch):
    assert set(DEGREES) <= set(search.SEARCHED) | {
        d for combo in search._other_degrees(search.SearchSpace()) for d in combo}
    assert set(DEGREES) <= set(search.DESCRIBED) | {"max_sequence_sp"}
    assert set(baselines.NAMED) <= set(NAMES) and set(from_config.UNSHOWN) <= set(DEGREES)
    # cp as if it were new: no rule of its own in the search, not named by the baselines
    monkeypatch.setattr(search, "SEARCHED", tuple(d for d in search.SEARCHED if d != "cp"))
    assert search._other_degrees(search.SearchSpace(degrees=(1, 2))) == [{"cp": 1}, {"cp": 2}]
    monkeypatch.setattr(baselines, "NAMED", tuple(d for d in baselines.NAMED if d != "cp"))
    assert baselines._plain(SimPlan(sp=2, cp=2), "x").cp == 1


def test_the_recipe_names_at_most_six_existing_modules():
    text = (ROOT / "docs/architecture.md").read_text()
    section = text[text.index("## Where a new parallel feature goes"):]
    files = re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.M)
    assert 1 <= len(files) <= 6, files
    assert all((ROOT / "ds_omni" / f).is_file() for f in files), files
