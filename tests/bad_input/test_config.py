"""Bad input to `ds-omni train` fails at start-up with a clear message, exit status 2, no traceback."""

import json

import pytest

from ds_omni.cli import main
from tests.bad_input.common import says, snapshot, train
from tests.fixtures import ds_config, tiny_config_dict


def _write(tmp_path, cfg: dict, ds: dict | None = None):
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds or ds_config(2)))
    return str(c), str(d)


def _train(capsys, *args) -> str:
    code = main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("ds-omni: error: ") and "Traceback" not in err
    return err


def test_missing_config_file(tmp_path, capsys):
    err = _train(capsys, "--config", str(tmp_path / "nope.json"), "--deepspeed", "x.json")
    assert "nope.json' does not exist" in err


def test_missing_deepspeed_file(tmp_path, capsys):
    c, _ = _write(tmp_path, tiny_config_dict(str(tmp_path / "out")))
    err = _train(capsys, "--config", c, "--deepspeed", str(tmp_path / "ds_missing.json"))
    assert "DeepSpeed config" in err and "does not exist" in err


def test_unknown_key(tmp_path, capsys):
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["data"]["shuffle_buffer"] = 10
    c, d = _write(tmp_path, cfg)
    assert "unknown key(s) ['shuffle_buffer'] in data" in _train(capsys, "--config", c, "--deepspeed", d)


def test_world_size_that_does_not_fit(tmp_path, capsys, monkeypatch):
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["parallel"] = {"dp": 2}
    c, d = _write(tmp_path, cfg)
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = _train(capsys, "--config", c, "--deepspeed", d)
    assert "2 processes but 3 were launched" in err


def test_missing_dataset_path(tmp_path, capsys):
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["data"]["sources"][0]["path"] = str(tmp_path / "no_such_data")
    c, d = _write(tmp_path, cfg)
    err = _train(capsys, "--config", c, "--deepspeed", d)
    assert "data source 'shapes': no data at" in err and "no_such_data" in err


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a directory cannot be made below a file, whoever runs the test
    c, d = _write(tmp_path, tiny_config_dict(str(blocker / "run")))
    err = _train(capsys, "--config", c, "--deepspeed", d)
    assert "output directory" in err and "is not writable" in err


def test_deepspeed_conflict(tmp_path, capsys):
    c, d = _write(tmp_path, tiny_config_dict(str(tmp_path / "out")),
                  {**ds_config(2), "train_micro_batch_size_per_gpu": 5})
    err = _train(capsys, "--config", c, "--deepspeed", d)
    assert "train_micro_batch_size_per_gpu=5 but the ds_omni config implies 2" in err


def test_reorder_group_that_does_not_divide_the_ranks(tmp_path, capsys, monkeypatch):
    cfg = tiny_config_dict(str(tmp_path / "out"), global_batch_size=12, micro_batch_size=1)
    cfg["data"]["reorder"] = {"group_size": 4}
    c, d = _write(tmp_path, cfg)
    monkeypatch.setenv("WORLD_SIZE", "6")
    err = _train(capsys, "--config", c, "--deepspeed", d)
    assert "data.reorder.group_size=4 must divide the data-parallel size 6" in err


def test_sp_on_one_process(tmp_path, capsys, monkeypatch):
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["parallel"] = {"sp": 2}
    c, d = _write(tmp_path, cfg)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _train(capsys, "--config", c, "--deepspeed", d)
    assert "world size 1 is not divisible by parallel.sp x parallel.pp = 2 x 1 = 2" in err


def test_sp_that_does_not_divide_the_heads(tmp_path, capsys, monkeypatch):
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["parallel"] = {"sp": 3}
    c, d = _write(tmp_path, cfg)
    monkeypatch.setenv("WORLD_SIZE", "3")  # fits the world: the heads (4) are what refuse it
    err = _train(capsys, "--config", c, "--deepspeed", d)
    assert "parallel.sp=3 must divide the LLM's attention heads" in err
    assert "4 query heads and 2 key/value heads" in err and "[1, 2, 4]" in err


@pytest.mark.parametrize("kernel, says", [
    ("varlen", "torch's varlen kernel needs CUDA and torch >= 2.10"),
    ("flash_attention_2", "flash-attn is not installed or no GPU is visible")])
def test_attention_kernel_this_machine_cannot_run(tmp_path, capsys, monkeypatch, kernel, says):
    """Checked at start-up, before any process group: every rank stops at once, none waits."""
    from ds_omni.model import attention
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: False)  # as on CPU
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["model"]["attn_implementation"] = kernel
    c, d = _write(tmp_path, cfg)
    err = _train(capsys, "--config", c, "--deepspeed", d)
    assert f"model.attn_implementation is '{kernel}'" in err and says in err
    assert "use 'auto'" in err


# ---------------------------------------------------------------- table: the ds_omni config
def _set(path: str, value):
    """A change to the config dict: `path` dotted ("model.llm.config.model_type")."""
    def change(cfg: dict) -> None:
        *parents, last = path.split(".")
        node = cfg
        for key in parents:
            node = node[key]
        node[last] = value
    return change


CONFIG_CASES = {  # name: (change, words the refusal must hold: what, where, how to fix)
    "steps_zero": (_set("train.steps", 0), ["train.steps must be >= 1", "got 0"]),
    "lr_zero": (_set("train.lr", 0.0), ["train.lr must be > 0"]),
    "on_nonfinite_unknown": (_set("train.on_nonfinite", "ignore"),
                             ["train.on_nonfinite", "\"stop\" or \"skip\"", "'ignore'"]),
    "batch_not_divisible": (_set("train.global_batch_size", 7),
                            ["train.global_batch_size=7 is not divisible", "multiple of 2"]),
    "overlong_unknown": (_set("data.overlong", "cut"), ["overlong", "'cut'", "truncate"]),
    "max_seq_len_over_positions": (
        _set("data.max_seq_len", 1024),
        ["data.max_seq_len=1024", "max_position_embeddings=256", "model.llm",
         "Lower data.max_seq_len to 256", "rope scaling"]),
    "llm_is_bert": (_set("model.llm.config", {"model_type": "bert", "hidden_size": 64,
                                              "num_hidden_layers": 2, "num_attention_heads": 4,
                                              "intermediate_size": 128}),
                    ["model.llm has model_type 'bert'", "an encoder", "causal LM",
                     "set model.llm to one"]),
    "llm_is_t5": (_set("model.llm.config", {"model_type": "t5", "d_model": 64}),
                  ["model_type 't5'", "not a causal LM", "'llama'"]),
    "llm_unknown_type": (_set("model.llm.config.model_type", "llamaa"),
                         ["model.llm.config: unknown model_type 'llamaa'"]),
    "unknown_section_key": (_set("train.save_evry", 5), ["unknown key(s) ['save_evry'] in train"]),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_bad_config_is_refused_at_start_up(tmp_path, capsys, no_training, name):
    change, words = CONFIG_CASES[name]
    cfg = tiny_config_dict(str(tmp_path / "out"))
    change(cfg)
    c, d = _write(tmp_path, cfg)
    says(_train(capsys, "--config", c, "--deepspeed", d), *words)
    assert snapshot(tmp_path / "out") == {}  # nothing written: the run never began


def test_max_seq_len_covered_by_rope_scaling_starts(tmp_path, capsys, no_training):
    """Above max_position_embeddings, but the LLM's linear rope scaling (x8) covers it."""
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["data"]["max_seq_len"] = 1024
    cfg["model"]["llm"]["config"]["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    c, d = _write(tmp_path, cfg)
    assert train(capsys, c, d)[0] == "started"


def test_config_that_is_not_json(tmp_path, capsys, no_training):
    c = tmp_path / "cfg.json"
    c.write_text('{"model": {"tokenizer": "builtin:shapes",}')
    _, d = _write(tmp_path, tiny_config_dict(str(tmp_path / "out")))
    c.write_text('{"model": {"tokenizer": "builtin:shapes",}')
    says(_train(capsys, "--config", str(c), "--deepspeed", d), "cfg.json", "JSON")
