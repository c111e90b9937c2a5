"""`ds-omni plan`: with --gpus-per-node every process group of the plan and those that cross
nodes; DeepSpeed-AutoTP's warning about too few key/value heads said once, not per plan looked at."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ds_omni.cli import main

ROOT = Path(__file__).resolve().parents[3]
DEMO = str(ROOT / "examples/tiny_llava.json")


def _plan(capsys, *args: str, config: str = DEMO, zero: str = "zero1.json") -> dict:
    assert main(["plan", "--config", config, "--deepspeed", str(ROOT / "ds_configs" / zero),
                 *args]) in (0, None)
    out = capsys.readouterr().out  # after DeepSpeed's accelerator line, where it prints one
    return json.loads(out[out.index("{\n"):])


def _crossing(groups: list[list[int]], per_node: int) -> list[list[int]]:
    return [g for g in groups if len({r // per_node for r in g}) > 1]


def _check_groups(layout: dict, kinds: set[str], per_node: int, world: int) -> None:
    """Every kind printed, each kind's groups a partition of the ranks (or of a stage's, for
    those inside one), and `cross_node` exactly the groups spanning two nodes."""
    printed = {k for k in layout if k.endswith("_groups")}
    assert kinds <= printed, sorted(kinds - printed)
    assert set(layout["cross_node"]) == printed
    for kind in printed:
        groups = layout[kind]
        if kind != "sequence_block_groups":  # blocks of every size: each size a partition
            assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert layout["cross_node"][kind] == _crossing(groups, per_node), kind


def test_plan_prints_every_group_and_which_cross_nodes(capsys):
    # tp x per-sequence SP x the encoder pool on 8 ranks, 2 a node: dp = 4, blocks of 2
    # data-parallel ranks of one TP rank, which cross nodes (the TP groups do not)
    sets = ["--set", "parallel.tp=2", "--set", "parallel.max_sequence_sp=2",
            "--set", "parallel.encoder_pool=\"dp\"", "--set", "train.micro_batch_size=24"]
    layout = _plan(capsys, "--world-size", "8", "--gpus-per-node", "2", *sets)["layout"]
    _check_groups(layout, {"tp_groups", "sp_groups", "dp_groups", "pool_groups",
                           "sequence_block_groups", "reorder_groups"}, 2, 8)
    assert layout["sequence_block_groups"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["cross_node"]["sequence_block_groups"] == layout["sequence_block_groups"]
    assert layout["cross_node"]["tp_groups"] == [] and layout["pool_groups"] == [[0, 2, 4, 6],
                                                                                [1, 3, 5, 7]]
    # the pipeline (the demo config evaluates: validation runs under pp), 2 stages on 4 ranks
    layout = _plan(capsys, "--world-size", "4", "--gpus-per-node", "2",
                   "--set", "parallel.pp=2")["layout"]
    _check_groups(layout, {"pp_groups", "dp_groups", "sp_groups", "reorder_groups"}, 2, 4)
    assert layout["pp_groups"] == [[0, 2], [1, 3]]
    assert layout["cross_node"]["pp_groups"] == layout["pp_groups"]
    assert layout["cross_node"]["dp_groups"] == []
    # expert parallelism of the MoE example over 8 ranks, 2 a node
    layout = _plan(capsys, "--world-size", "8", "--gpus-per-node", "2", "--set", "parallel.ep=4",
                   "--set", "train.micro_batch_size=2",
                   config=str(ROOT / "examples/tiny_moe.json"), zero="zero2.json")["layout"]
    _check_groups(layout, {"ep_groups", "expert_data_groups", "dp_groups"}, 2, 8)
    assert layout["cross_node"]["ep_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _kv_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "key/value heads" in r.getMessage()]


def test_autotp_kv_heads_warning_is_said_once(capsys, caplog):
    """The demo LLM has 2 key/value heads: tp=4 gives the attention to 2 TP ranks. `ds-omni plan`
    says so once; the plan search, which checks every candidate plan with training's own
    checks, says it once for the plans it reports (it said it once per candidate before)."""
    caplog.set_level(logging.WARNING)
    _plan(capsys, "--world-size", "4", "--set", "parallel.tp=4")
    assert len(_kv_warnings(caplog)) == 1, _kv_warnings(caplog)
    caplog.clear()
    from ds_omni.parallelize.tensor_parallel import check_tensor_parallel, tp_beyond_kv_heads
    from ds_omni.config import load_config
    from ds_omni.model.build import llm_text_config
    text = llm_text_config(load_config(DEMO, []).model)[1]
    for _ in range(3):  # what the search runs per candidate: silent
        check_tensor_parallel(text, 4, "model.llm")
    assert _kv_warnings(caplog) == [] and tp_beyond_kv_heads(text, 2) is None
    assert "parallel.tp=4 exceeds the LLM's 2 key/value heads" in tp_beyond_kv_heads(text, 4)
    from ds_omni.sim.from_config import say_tp_warnings
    say_tp_warnings(_model_spec(), [4, 4, 1, 2, 4])
    assert len(_kv_warnings(caplog)) == 1


def _model_spec():
    from ds_omni.config import load_config
    from ds_omni.sim.from_config import model_spec
    return model_spec(load_config(DEMO, []))


@pytest.mark.slow  # the 1,024-GPU search itself (about a minute of CPU)
def test_the_1024_gpu_search_says_the_warning_at_most_once(capsys, caplog):
    """The search on the demo config at 1,024 GPUs (one sample a rank) looks at many tp=4
    plans; it said the warning 70 times before."""
    caplog.set_level(logging.WARNING)
    assert main(["plan", "--config", DEMO, "--deepspeed", str(ROOT / "ds_configs/zero2.json"),
                 "--search", "--gpus", "1024", "--gpus-per-node", "8", "--gpu", "h100",
                 "--set", "train.micro_batch_size=1", "--set", "train.global_batch_size=1024"]
                ) in (0, None)
    assert len(_kv_warnings(caplog)) <= 1, _kv_warnings(caplog)
