"""Every pair of features the composition table lets compose (`ds_omni.config.composition.RULES`:
its "ok" and "if" cells) names the distributed test cases that check it against one process, in
the quick tier and in the slow tier (the full matrix: CI runs both), as
`tests/dist/test_sequence_parallel.py::test_design_covers_every_pair` does for its own design.
A newly allowed pair without a test fails here, and so does a case that no longer exists or a
quick case that moved to the slow tier. Pairs whose second feature cannot act beside the first
(the encoders' placement acts under pp only, which the first refuses) are `INERT`, shown so
from the table.
"""

import ast
from functools import cache
from pathlib import Path

from ds_omni.config.composition import FEATURES, RULES, Setting, refusal

DIST = Path(__file__).resolve().parents[2] / "dist"
SP, TP, PARITY, PP = ("test_sequence_parallel.py", "test_tensor_parallel.py", "test_parity.py",
                      "test_pipeline_composed.py")
EP, EP_SP, CP, PAIRS = ("test_expert_parallel.py", "test_expert_sequence_parallel.py",
                        "test_context_parallel.py", "test_pairs_quick.py")
SP_QUICK, SP_4 = (f"{SP}::test_sequence_parallel_matches_single_process[{w}]" for w in (2, 4))
PP_QUICK = f"{PP}::test_pipeline_with_tp_and_sp_matches_single_process"
PP_8 = f"{PP}::test_pipeline_composed_8_ranks"
PP_BUBBLES = f"{PP}::test_pipeline_bubbles_with_tp_and_sp_matches_single_process"  # "bubbles"
PIPE, PIPE_SLOW = (f"{PARITY}::test_pipeline_matches_single_process",
                   "test_parity_slow.py::test_pipeline_matches_single_process")
EP_SLOW = f"{EP}::test_expert_parallel_matches_single_process"
EP_SP_SLOW = f"{EP_SP}::test_expert_parallel_inside_sp_matches_single_process"
CP_QUICK, CP_SLOW = (f"{CP}::test_ring_attention_matches_single_process",
                     f"{CP}::test_ring_attention_zero_matrix")
EP_SP_POOL, EP_MSP = (f"{PAIRS}::test_ep2_beside_sp_with_encoder_pool[{c}]"
                      for c in ("ep2_sp2_pool", "ep2_msp2"))
CP_COMPOSED = "test_context_parallel_composed.py"
TP_POOL_SLOW, TP_SP_POOL_SLOW = (f"{TP}::test_tp2_x_{c}_encoder_pool_matches_single_process"
                                 for c in ("dp2", "sp2_x_dp2"))
PP_POOL_SLOW = f"{PP}::test_pipeline_with_encoder_pool_matches_single_process"

# pair -> (quick-tier cases, slow-tier cases): "file::test[param]" under tests/dist/
COVERED = {
    ("zero", "sp"): ([SP_QUICK], [SP_4, "test_sequence_parallel_slow.py::"
                                        "test_deepstack_under_sequence_parallelism"]),
    ("zero", "max_sequence_sp"): ([SP_QUICK], ["test_sequence_parallel_slow.py::"
                                               "test_per_sequence_sp_under_zero2"]),
    ("tp", "zero"): ([f"{TP}::test_tensor_parallel_matches_single_process"],
                     [f"{TP}::test_tensor_parallel_families_match_single_process",
                      f"{TP}::test_tp2_x_dp2_matches_single_process"]),
    ("pp", "zero"): ([PIPE, PP_QUICK], [PIPE_SLOW, PP_8]),
    ("zero", "encoder_placement"): ([PIPE], [PIPE_SLOW]),
    ("zero", "encoder_pool"): ([f"{PARITY}::test_data_parallel_matches_single_process"],
                               ["test_parity_slow.py::"
                                "test_encoder_pool_on_more_families_and_ranks"]),
    ("ep", "zero"): ([f"{PAIRS}::test_ep2_x_tp2"], [EP_SLOW]),
    ("sp", "tp"): ([f"{PAIRS}::test_tp2_x_sp2"],
                   [f"{TP}::test_tp2_x_sp2_matches_single_process",
                    f"{TP}::test_tp2_x_sp2_x_dp2_matches_single_process", PP_8]),
    ("pp", "sp"): ([PP_QUICK], [PP_8]),
    ("sp", "encoder_placement"): ([PP_QUICK], [PP_8, PP_BUBBLES]),
    ("sp", "encoder_pool"): ([EP_SP_POOL], [SP_4, TP_SP_POOL_SLOW]),
    ("ep", "sp"): ([EP_SP_POOL], [EP_SP_SLOW]),
    ("tp", "max_sequence_sp"): ([f"{PAIRS}::test_tp2_x_max_sequence_sp2"],
                                ["test_tp_per_sequence.py::test_tp_x_max_sequence_sp_matches_"
                                 "single_process"]),
    ("max_sequence_sp", "encoder_pool"): ([f"{PAIRS}::test_max_sequence_sp2_x_encoder_pool"],
                                          [SP_4]),
    ("max_sequence_sp", "ep"): ([EP_MSP], [EP_SP_SLOW]),
    ("tp", "pp"): ([PP_QUICK], [PP_8]),
    ("tp", "encoder_placement"): ([PP_QUICK], [PP_8, PP_BUBBLES]),
    ("tp", "encoder_pool"): ([f"{PAIRS}::test_tp2_x_encoder_pool"],
                             [TP_POOL_SLOW, TP_SP_POOL_SLOW]),
    ("ep", "tp"): ([f"{PAIRS}::test_ep2_x_tp2"], [EP_SLOW]),
    ("pp", "encoder_placement"): ([PIPE, PP_QUICK], [PIPE_SLOW, PP_8]),
    ("ep", "pp"): ([f"{PAIRS}::test_pp2_x_ep2_uniform"], [EP_SLOW]),
    ("encoder_placement", "ep"): ([f"{PAIRS}::test_pp2_x_ep2_uniform"], []),
    ("encoder_pool", "ep"): ([EP_SP_POOL], []),
    ("encoder_pool", "pp"): ([], [PP_POOL_SLOW]),
    ("encoder_placement", "encoder_pool"): ([], [PP_POOL_SLOW]),  # its "bubbles" case too
    ("zero", "cp"): ([CP_QUICK], [CP_SLOW]),
    ("sp", "cp"): ([CP_QUICK], [CP_SLOW]),
    ("encoder_pool", "cp"): ([], [CP_SLOW]),
    ("tp", "cp"): ([], [f"{CP_COMPOSED}::test_tp2_x_cp2_matches_single_process"]),
    ("ep", "cp"): ([], [f"{CP_COMPOSED}::test_ep2_x_cp2_matches_single_process"]),
}
INERT = {("max_sequence_sp", "encoder_placement"), ("encoder_placement", "cp")}
# the pairs with no case in a tier yet (this list may only shrink): the pool beside cp has its
# 4-rank case in the slow tier only, and so have tp and ep beside cp (one slow launch) and the
# pool under pp (pp2 x dp2, lifted from refused); ep beside "uniform" and beside the pool their
# quick cases alone
QUICK_GAPS = {("encoder_pool", "cp"), ("tp", "cp"), ("ep", "cp"), ("encoder_pool", "pp"),
              ("encoder_placement", "encoder_pool")}
SLOW_GAPS = {("encoder_placement", "ep"), ("encoder_pool", "ep")}


def _key(a: str, b: str) -> frozenset:
    return frozenset((a, b))


def _composing() -> set[frozenset]:
    """The pairs the table lets compose: no rule refuses them, or only under a condition."""
    return {_key(r.a, r.b) for r in RULES if r.refused is None or r.when}


def test_every_composing_pair_names_its_cases():
    named = {_key(*p) for p in COVERED} | {_key(*p) for p in INERT}
    assert len(named) == len(COVERED) + len(INERT)
    assert named == _composing(), (f"pairs without cases: {_composing() - named}; "
                                   f"refused pairs named: {named - _composing()}")
    for pair, (quick, slow) in COVERED.items():
        assert bool(quick) != (pair in QUICK_GAPS), (pair, quick)
        assert bool(slow) != (pair in SLOW_GAPS), (pair, slow)


def test_inert_pairs_cannot_act():
    """The encoders' placement acts under pp only: beside a feature that pp refuses (whatever
    else is set), it changes nothing, so there is nothing to check against one process."""
    on = {"max_sequence_sp": {"max_sequence_sp": 2}, "encoder_pool": {"encoder_pool": "dp"},
          "cp": {"cp": 2}}
    for pair in INERT:
        (other,) = set(pair) - {"encoder_placement"}
        rule = refusal(Setting(pp=2, **on[other]))
        assert rule is not None and {rule.a, rule.b} == {other, "pp"} and not rule.when, pair
        assert "encoder_placement" in {f.name for f in FEATURES}


@cache
def _tests(path: str) -> tuple[bool, dict[str, ast.FunctionDef]]:
    """Whether the module is marked slow, and its test functions."""
    tree = ast.parse((DIST / path).read_text())
    slow = any(isinstance(node, ast.Assign) and node.targets[0].id == "pytestmark"
               and "slow" in ast.unparse(node.value) for node in tree.body
               if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name))
    return slow, {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name.startswith("test_")}


def _is_slow(case: str) -> bool:
    """Whether the case exists and runs in the slow tier only (its module, its function or its
    parameter marked slow)."""
    path, name = case.split("::")
    func, _, param = name.partition("[")
    module_slow, tests = _tests(path)
    assert func in tests, f"{case}: no such test"
    decorators = [ast.unparse(d) for d in tests[func].decorator_list]
    if module_slow or "pytest.mark.slow" in decorators:
        return True
    param = param.rstrip("]")
    return any(f"pytest.param({param}, marks=pytest.mark.slow)" in d for d in decorators) \
        if param else False


def test_the_named_cases_exist_in_their_tier():
    for pair, (quick, slow) in COVERED.items():
        for case in quick:
            assert not _is_slow(case), f"{pair}: {case} is not in the quick tier"
        for case in slow:
            _is_slow(case)  # exists (a quick case also runs where the slow tier runs)


def test_every_case_of_the_pairwise_launch_is_named():
    """Each test of the quick tier's pairwise launch checks some pair named here."""
    named = {case.split("::")[1].partition("[")[0] for quick, _ in COVERED.values()
             for case in quick if case.startswith(PAIRS)}
    assert named == set(_tests(PAIRS)[1])
