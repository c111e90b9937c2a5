"""The composition table (`ds_omni.config.composition`): every pair of features has one entry;
every refusal the scattered checks made before it is still refused, before any process group,
by one error naming both features, the reason and the fix; the plan search drops exactly what
the training's validator refuses; docs/composition.md and `ds-omni plan --composition` are the
table's."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from ds_omni.cli import main
from ds_omni.config import ParallelConfig
from ds_omni.config import composition_doc
from ds_omni.config.composition import FEATURES, FIELDS, RULES, check_composition
from ds_omni.errors import CompositionError, ConfigError
from ds_omni.sim import SimPlan, cluster
from ds_omni.sim.search import SearchSpace, candidates, describe, search
from tests.fixtures import ds_config, tiny_config, tiny_config_dict
from tests.unit.parallelize.test_expert_parallel import MOE
from tests.unit.sim.test_sim_search import small_moe, text

GIB = 2 ** 30


def test_every_pair_of_features_has_exactly_one_entry():
    names = [f.name for f in FEATURES]
    pairs = [frozenset((r.a, r.b)) for r in RULES]
    assert all(r.a != r.b and {r.a, r.b} <= set(names) for r in RULES)
    duplicated = {tuple(sorted(p)) for p in pairs if pairs.count(p) > 1}
    missing = {(a, b) for a, b in itertools.combinations(names, 2)} - {
        tuple(sorted(p, key=names.index)) for p in pairs}
    assert not duplicated, f"pairs with more than one entry: {sorted(duplicated)}"
    assert not missing, f"pairs of features with no entry in RULES: {sorted(missing)}"


def test_a_refusal_says_why_and_what_to_set_and_names_what_its_condition_reads():
    for r in RULES:
        if r.refused is not None:
            assert r.reason and r.fix and set(r.shows) <= set(FIELDS), r
        else:
            assert not (r.reason or r.fix or r.shows or r.when or r.launch_only), r
    assert all(f.name in FIELDS for f in FEATURES)


# One case per refusal the code made before the table (where it was written), run through
# `plan_run` as `ds-omni train` and `ds-omni plan` run it: (parallel, ZeRO stage, export_hf,
# ranks, both features as the error names them, a fragment of the fix).
OLD_REFUSALS = {
    "config/parallel.py: max_sequence_sp x sp": (
        dict(max_sequence_sp=2, sp=2), 1, False, 4,
        ("parallel.max_sequence_sp=2", "parallel.sp=2"), "set parallel.sp to 1"),
    "config/parallel.py: max_sequence_sp x pp": (
        dict(max_sequence_sp=2, pp=2), 1, False, 2,
        ("parallel.max_sequence_sp=2", "parallel.pp=2"), "or parallel.pp to 1"),
    "parallel/plan.py: ep x tp under sp": (  # ep x tp composes since issue 37, not with sp
        dict(ep=2, tp=2, sp=2), 1, False, 8,
        ("parallel.ep=2", "parallel.tp=2", "when parallel.sp=2"), "set parallel.sp and"),
    "parallelize/pipeline.py, sim/plan_spec.py: pp x ZeRO-2": (
        dict(pp=2), 2, False, 2, ("parallel.pp=2", "zero_optimization.stage=2"),
        "ds_configs/zero1.json"),
    "parallelize/pipeline.py, sim/plan_spec.py: pp x ZeRO-3": (
        dict(pp=2), 3, False, 2, ("parallel.pp=2", "zero_optimization.stage=3"),
        "ds_configs/zero1.json"),
    "train/ds_config.py, sim/plan_spec.py: ep x sp under ZeRO-0": (
        dict(ep=2, sp=2), 0, False, 4,
        ("parallel.ep=2", "parallel.sp=2", "when zero_optimization.stage=0"),
        "set zero_optimization.stage to 1 or 2"),
    "train/ds_config.py, sim/plan_spec.py: ep x sp under ZeRO-3": (
        dict(ep=2, sp=2), 3, False, 4,
        ("parallel.ep=2", "parallel.sp=2", "when zero_optimization.stage=3"),
        "set zero_optimization.stage to 1 or 2"),
    "sim/plan_spec.py: ep x cp under ZeRO-3": (  # ep x cp composes under ZeRO 1, 2
        dict(ep=2, cp=2), 3, False, 4,
        ("parallel.ep=2", "parallel.cp=2", "when zero_optimization.stage=3"),
        "set zero_optimization.stage to 1 or 2"),
    "train/ds_config.py: ep x ZeRO-3 with export_hf": (
        dict(ep=2), 3, True, 2,
        ("parallel.ep=2", "zero_optimization.stage=3", "when train.export_hf=true"),
        "train.export_hf to false"),
}

READ_TIME = {case for case in OLD_REFUSALS if case.startswith(("config/", "parallel/"))}
"""The refusals the parallel section makes when it is read (those of parallel/plan.py moved
there from `ParallelPlan.from_config`: earlier, still before any process group)."""


def _config(tmp_path, parallel: dict, export_hf: bool):
    """The tiny config with `parallel` set field by field (as `--set` overrides are, past the
    config's own check), an MoE LLM where ep asks for one."""
    cfg = tiny_config(str(tmp_path), global_batch_size=8, export_hf=export_hf)
    if parallel.get("ep", 1) > 1:
        cfg.model.llm.config = dict(MOE)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


@pytest.mark.parametrize("case", list(OLD_REFUSALS))
def test_each_old_refusal_is_refused_before_any_process_group(tmp_path, case):
    from ds_omni.train.setup import plan_run
    parallel, zero, export_hf, world, names, fix = OLD_REFUSALS[case]
    with pytest.raises(CompositionError) as refused:
        plan_run(_config(tmp_path, parallel, export_hf), ds_config(zero), world)
    message = str(refused.value)
    assert all(name in message for name in names) and fix in message, message
    assert " cannot be combined with " in message and not torch.distributed.is_initialized()
    if case in READ_TIME:  # the same error where the parallel section is read
        with pytest.raises(CompositionError) as at_read:
            ParallelConfig(**parallel)
        assert str(at_read.value) == message
    else:  # its rule waits for the ZeRO stage, or for the launch (the simulator models pp x sp)
        ParallelConfig(**parallel)


@pytest.mark.parametrize("parallel", [dict(ep=2, tp=2), dict(ep=2, pp=2)])
def test_experts_compose_with_tp_and_pp(tmp_path, parallel):
    """ep x tp (the experts folded over TP) and pp x ep (the aux loss carried along the stages)
    plan on 4 ranks: the plan's EP groups are drawn inside each stage's dp x tp ranks."""
    from ds_omni.train.setup import plan_run
    plan, ds = plan_run(_config(tmp_path, parallel, False), ds_config(1), 4)
    assert plan.ep_group_ranks() == [[0, 1], [2, 3]]
    assert plan.expert_data_group_ranks() == ([[0, 2], [1, 3]] if plan.tp_enabled
                                              else [[0], [1], [2], [3]])
    # under tp ds_omni folds the experts itself: the engine's AutoEP stays off
    assert ("expert_parallel" in ds) == (not plan.tp_enabled)


@pytest.mark.parametrize("parallel", [dict(tp=2, cp=2), dict(ep=2, cp=2)])
def test_the_ring_composes_with_tp_and_ep(tmp_path, parallel):
    """tp x cp (rings inside one TP rank's sequence ranks) and ep x cp (an MoE LLM's aux summed
    at the zigzag positions) pass the table, the model checks and plan_run (ZeRO-1, 4 ranks):
    tests/dist/test_context_parallel_composed.py checks them against one process."""
    from ds_omni.train.setup import plan_run
    plan, _ = plan_run(_config(tmp_path, parallel, False), ds_config(1), 4)
    assert plan.cp_group_ranks() == ([[0, 2], [1, 3]] if plan.tp_enabled else [[0, 1], [2, 3]])
    assert plan.ep == parallel.get("ep", 1)


# Refused before, composing since: tp x ZeRO-3 (tests/dist/test_tensor_parallel.py, tp2 x dp2
# under ZeRO-3), ep x pp under sp (tests/dist/test_expert_parallel.py, pp2 x sp2 x ep2),
# "bubbles" beside tp and sp (tests/dist/test_pipeline_composed.py, pp2 x tp2 and pp2 x sp2) and
# the encoder pool under pp (tests/dist/test_pipeline_composed.py, pp2 x dp2, every placement)
LIFTED = {"tp x ZeRO-3": (dict(tp=2), 3), "ep x pp under sp": (dict(ep=2, pp=2, sp=2), 1),
          "bubbles beside tp": (dict(pp=2, tp=2, encoder_placement="bubbles"), 1),
          "bubbles beside sp": (dict(pp=2, sp=2, encoder_placement="bubbles"), 1),
          "encoder_pool x pp": (dict(encoder_pool="dp", pp=2, encoder_placement="uniform"), 1),
          "encoder_pool x pp, bubbles": (dict(encoder_pool="dp", pp=2,
                                              encoder_placement="bubbles"), 1)}


def test_tp_under_zero3_is_refused_beside_sp_only():
    """ZeRO-3 partitions over the mpu's data-parallel group (DeepSpeed's
    `_convert_to_zero_parameters`), which under tp x sp leaves the SP ranks' gradients apart."""
    check_composition(ParallelConfig(tp=2, encoder_pool="dp"), zero=3)
    with pytest.raises(CompositionError, match="parallel.tp=2 cannot be combined with "
                       "zero_optimization.stage=3 when parallel.sp=2: .*_convert_to_zero_param"):
        check_composition(ParallelConfig(tp=2, sp=2), zero=3)


@pytest.mark.parametrize("case", list(LIFTED))
def test_lifted_refusals_plan(tmp_path, case):
    from ds_omni.train.setup import plan_run
    parallel, zero = LIFTED[case]
    plan, _ = plan_run(_config(tmp_path, parallel, False), ds_config(zero), 4)
    if plan.ep > 1:  # each stage's EP group is its SP group
        assert plan.ep_group_ranks() == plan.sp_group_ranks() == [[0, 1], [2, 3]]


def test_an_ep_that_does_not_divide_a_stage_or_the_experts_is_refused(tmp_path):
    from ds_omni.errors import LaunchError
    from ds_omni.train.setup import plan_run
    from ds_omni.errors import ConfigError
    with pytest.raises(LaunchError, match="does not divide the data-parallel x sequence-parallel "
                       "x tensor-parallel ranks of a pipeline stage, 2 x 1 x 2 = 4"):
        plan_run(_config(tmp_path, dict(ep=3, tp=2), False), ds_config(1), 4)
    with pytest.raises(LaunchError, match="ranks of a pipeline stage, 2 x 1 x 1 = 2"):
        plan_run(_config(tmp_path, dict(ep=4, pp=2), False), ds_config(1), 4)
    cfg = _config(tmp_path, dict(ep=3, tp=2), False)  # 6 ranks: dp 3 x tp 2, a stage of 6
    cfg.train.global_batch_size = 12
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide the LLM's 4 experts"):
        plan_run(cfg, ds_config(1), 6)


@pytest.mark.parametrize("parallel,zero", [({"pp": 2, "sp": 2}, 2), ({"pp": 2}, 3)])
def test_train_refuses_before_the_process_group_and_the_model(tmp_path, capsys, monkeypatch,
                                                              parallel, zero):
    """`ds-omni train` stops at the table: the process group, the model and DeepSpeed are never
    reached (they are replaced by None here, so reaching them would fail otherwise)."""
    from ds_omni.train import loop
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["parallel"] = parallel
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds_config(zero)))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(loop, "setup_training", None)
    monkeypatch.setattr(loop.dist, "init_distributed", None)
    assert main(["train", "--config", str(c), "--deepspeed", str(d)]) == 2
    err = capsys.readouterr().err
    assert "cannot be combined with" in err and "Traceback" not in err, err


def test_the_validator_waits_for_the_stage_and_composes_the_rest():
    check_composition(ParallelConfig(sp=2, ep=2), launch=False)  # ep x sp: stage unknown
    check_composition(ParallelConfig(sp=2, ep=2), zero=1)
    check_composition(ParallelConfig(ep=2), zero=3)  # trains; only its export is refused
    check_composition(ParallelConfig(tp=2, encoder_pool="dp"), zero=2)
    check_composition(ParallelConfig(max_sequence_sp=4, encoder_pool="dp", ep=2), zero=3)
    with pytest.raises(ConfigError, match="parallel.ep=2 cannot be combined with parallel.sp=2"):
        check_composition(ParallelConfig(sp=2, ep=2), zero=0)


def _training_verdict(fields: dict) -> str | None:
    """Training's verdict on a searched plan's degrees: the config's check, then plan_run's
    (the stage known, the launch's rules too); None where they compose."""
    try:
        parallel = ParallelConfig(
            sp=fields["sp"], tp=fields["tp"], pp=fields["pp"], ep=fields["ep"],
            max_sequence_sp=fields["max_sequence_sp"],
            encoder_placement=fields["encoder_placement"],
            encoder_pool="dp" if fields["encoder_mode"] == "pool" else "off")
        check_composition(parallel, zero=fields["zero_stage"])
    except CompositionError as e:
        return str(e)
    return None


def check_search_agrees_with_training() -> None:
    """Over every degree of {1, 2} (sp, tp, pp, ep, max_sequence_sp), every ZeRO stage, pool or
    not, both placements, on 8 GPUs with room for every plan's states: a candidate the
    training's validator refuses is dropped with its message; one it accepts is never dropped
    for composing (it is ranked, pruned, or dropped for another reason)."""
    model, gpus = small_moe(), cluster("h100", 8, 8, hbm_bytes=1024 * GIB)
    space = SearchSpace(degrees=(1, 2), zero_stages=(0, 1, 2, 3), reorder_groups=(4,),
                        checkpointing=(True,))
    base = SimPlan(global_batch=16, micro_batches=2, pack_tokens=4096)
    every = candidates(base, 8, 8, model, space)
    verdicts = {describe(f): _training_verdict(f) for f in every}
    refused = {plan for plan, verdict in verdicts.items() if verdict is not None}
    assert len(refused) > 20 and len(verdicts) - len(refused) > 20  # both kinds searched
    samples = text([1000, 3000, 500, 2000] * 4)
    out = search(gpus, model, samples, base, top=1, space=space, baselines=False)
    dropped = {d["plan"]: d["reason"] for d in out.dropped}
    for plan in refused:
        assert dropped.get(plan) == verdicts[plan], plan
    for plan, reason in dropped.items():
        assert plan in refused or "cannot be combined" not in reason, (plan, reason)


def test_the_search_drops_what_training_refuses_with_its_reason():
    check_search_agrees_with_training()


def test_the_agreement_sees_a_search_that_ranks_what_training_refuses(monkeypatch):
    """Planted: the search does not check the table, so it would rank plans (pp x ZeRO-2,
    max_sequence_sp x sp, ...) that `ds-omni train` refuses."""
    monkeypatch.setattr(SimPlan, "check_composition", lambda self, launch=False: None)
    with pytest.raises(AssertionError):
        check_search_agrees_with_training()


@pytest.mark.parametrize("parallel", [dict(pp=2, tp=2), dict(pp=2, sp=2),
                                      dict(pp=2, tp=2, sp=2, encoder_placement="uniform")])
def test_the_pipeline_composes_with_tp_and_sp(tmp_path, parallel):
    """pp x tp, pp x sp and all three (issue 37) pass the table and plan_run (ZeRO-1), and the
    derived DeepSpeed config turns the engine's activation partitioning off under tp."""
    from ds_omni.train.setup import plan_run
    world = 2 * parallel.get("tp", 1) * parallel.get("sp", 1)
    plan, ds = plan_run(_config(tmp_path, parallel, False), ds_config(1), world)
    assert (plan.pp, plan.tp, plan.sp) == (2, parallel.get("tp", 1), parallel.get("sp", 1))
    partitioned = ds.get("pipeline", {}).get("pipe_partitioned", True)
    assert partitioned is (plan.tp == 1)
    assert ds["train_batch_size"] == 8 * plan.sp  # the pipeline grid counts SP ranks as data


def test_docs_composition_md_is_the_table():
    path = composition_doc.DOCS_PATH
    written = path.read_text() if path.exists() else ""
    assert written == composition_doc.markdown(), (
        "docs/composition.md disagrees with the table in ds_omni/config/composition.py; "
        f"regenerate it with `{composition_doc.REGENERATE}` and commit the result")


def test_plan_prints_the_table_without_a_config(capsys):
    assert main(["plan", "--composition"]) == 0
    out = capsys.readouterr().out
    assert out == composition_doc.markdown()
    refused = [r for r in RULES if r.refused is not None]
    assert all(f"`{FIELDS[r.a]}` with `{FIELDS[r.b]}`" in out and r.fix in out for r in refused)
    assert main(["plan", "--world-size", "2"]) == 2  # the plan itself still needs its configs
    assert "needs --config and --deepspeed" in capsys.readouterr().err
