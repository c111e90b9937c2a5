"""Sequence-parallel degrees that cannot work are refused before launch, with a message that names the
numbers and the degrees that would work; `ds-omni plan` checks them too and prints the rank layout."""

import json

import pytest

from ds_omni.cli import main
from ds_omni.config import ModelConfig, ParallelConfig, ReorderConfig, from_dict
from ds_omni.errors import ConfigError, LaunchError, ModelError
from ds_omni.model.build import check_sequence_parallel
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.train.ds_config import derive_ds_config
from tests.fixtures import TINY_LLAMA, ds_config, tiny_config, tiny_config_dict


def _composed(**llm) -> ModelConfig:
    """A composed model config; only its config dicts are read, nothing is built."""
    return from_dict(ModelConfig, {"tokenizer": "builtin:shapes",
                                   "llm": {"config": {**TINY_LLAMA, **llm}}})


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from tests.family_dirs import make_llava_dir
    return make_llava_dir(tmp_path_factory.mktemp("llava"))


def test_sp_must_divide_the_query_heads_of_a_composed_llm():
    with pytest.raises(ModelError, match=r"parallel.sp=3 must divide the LLM's attention heads: "
                                         r"model.llm \(llama\) has 4 query heads and 2 key/value "
                                         r"heads; .* sp can be one of \[1, 2, 4\]"):
        check_sequence_parallel(_composed(), 3)
    big = _composed(hidden_size=96, num_attention_heads=12, num_key_value_heads=4)
    with pytest.raises(ModelError, match=r"12 query heads and 4 key/value heads; .*\[1, 2, 3, 4, 6, 12\]"):
        check_sequence_parallel(big, 8)
    for sp in (2, 4):  # 4 > 2 KV heads is fine: the kernel repeats them
        check_sequence_parallel(_composed(), sp)
    check_sequence_parallel(big, 6)


def test_sp_must_divide_the_query_heads_of_a_pretrained_llm(llava_dir):
    cfg = ModelConfig(pretrained=str(llava_dir))
    with pytest.raises(ModelError, match=r"the LLM of '.*llava.*' \(llama\) has 4 query heads and 2 "
                                         r"key/value heads; .*one of \[1, 2, 4\]"):
        check_sequence_parallel(cfg, 3)
    check_sequence_parallel(cfg, 4)


def test_a_family_without_sequence_parallelism_is_refused(llava_dir, monkeypatch):
    from ds_omni.model.families import family_for
    monkeypatch.setattr(family_for("llava"), "sequence_parallel", False)
    with pytest.raises(ModelError, match=r"parallel.sp=2: the 'llava' family does not support "
                                         r"sequence parallelism yet; set parallel.sp to 1"):
        check_sequence_parallel(ModelConfig(pretrained=str(llava_dir)), 2)


@pytest.mark.parametrize("cfg,world,match", [
    (ParallelConfig(sp=3), 4, r"world size 4 is not divisible by parallel.sp x parallel.pp = 3 x 1 "
                              r"= 3; launch a multiple of 3"),
    (ParallelConfig(dp=2, sp=3), 4, r"dp x sp x pp = 2 x 3 x 1 = 6 processes but 4 were launched"),
])
def test_sp_must_fit_the_world(cfg, world, match):
    with pytest.raises(LaunchError, match=match):
        ParallelPlan.from_config(cfg, world, ReorderConfig())


def test_zero3_under_sp_needs_reduce_scatter(tmp_path):
    cfg = tiny_config(str(tmp_path))
    sp2, sp1 = ParallelPlan(world_size=2, dp=1, sp=2), ParallelPlan(world_size=1, dp=1)
    user = ds_config(3)
    user["zero_optimization"]["reduce_scatter"] = False
    with pytest.raises(ConfigError, match=r"zero_optimization.reduce_scatter=false is not supported "
                                          r"with ZeRO-3 and parallel.sp > 1"):
        derive_ds_config(cfg, user, sp2)
    assert derive_ds_config(cfg, user, sp1)["zero_optimization"]["reduce_scatter"] is False
    out = derive_ds_config(cfg, ds_config(3), sp2)
    assert out["zero_optimization"]["reduce_scatter"] is True and out["sequence_parallel_size"] == 2


# ------------------------------------------------------------------------------------ CLI
def _files(tmp_path, parallel: dict, **data) -> tuple[str, str]:
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["parallel"] = parallel
    cfg["data"].update(data)
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds_config(2)))
    return str(c), str(d)


def _fails(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("ds-omni: error: ") and "Traceback" not in err
    return err


def test_plan_refuses_an_sp_that_does_not_divide_the_heads(tmp_path, capsys):
    c, d = _files(tmp_path, {"sp": 3})
    err = _fails(capsys, ["plan", "--config", c, "--deepspeed", d, "--world-size", "6"])
    assert "parallel.sp=3 must divide the LLM's attention heads" in err and "[1, 2, 4]" in err


def test_plan_prints_the_rank_layout(tmp_path, capsys):
    c, d = _files(tmp_path, {"sp": 2}, reorder={"group_size": 2})
    assert main(["plan", "--config", c, "--deepspeed", d, "--world-size", "8"]) == 0
    text = capsys.readouterr().out
    assert '\n   {"rank": 5, "pp": 0, "dp": 2, "sp": 1},\n' in text  # a line per rank
    out = json.loads(text)
    assert out["plan"] == {"world_size": 8, "dp": 4, "sp": 2, "pp": 1}
    assert out["deepspeed"]["sequence_parallel_size"] == 2
    layout = out["layout"]
    assert layout == ParallelPlan(world_size=8, dp=4, sp=2, reorder_group=2).layout()
    assert layout["ranks"][5] == {"rank": 5, "pp": 0, "dp": 2, "sp": 1}
    assert layout["reorder_groups"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
