import json

import pytest

from ds_omni.config import OmniConfig, from_dict, load_config
from ds_omni.errors import ConfigError
from tests.fixtures import tiny_config_dict


def test_loads_nested_config(tmp_path):
    cfg = from_dict(OmniConfig, tiny_config_dict(str(tmp_path)))
    assert cfg.train.global_batch_size == 8
    assert cfg.data.sources[0].schema.text == "conversations"
    assert cfg.parallel.dp == "auto"
    assert cfg.model.llm.config["model_type"] == "llama"


def test_unknown_keys_are_listed(tmp_path):
    d = tiny_config_dict(str(tmp_path))
    d["train"]["stpes"] = 3
    d["train"]["lrr"] = 1
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['lrr', 'stpes'\] in train.*valid keys"):
        from_dict(OmniConfig, d)


def test_unknown_top_level_key(tmp_path):
    d = tiny_config_dict(str(tmp_path))
    d["optimiser"] = {}
    with pytest.raises(ConfigError, match=r"\['optimiser'\] in config"):
        from_dict(OmniConfig, d)


@pytest.mark.parametrize("section,key,value,match", [
    ("train", "steps", "ten", r"train.steps must be int, got 'ten' \(str\)"),
    ("train", "steps", 0, r"train.steps must be >= 1, got 0"),
    ("train", "lr", True, r"train.lr must be float, got True"),
    ("model", "dtype", "fp8", r"model.dtype must be one of \['float32', 'bfloat16'\], got 'fp8'"),
    ("data", "max_seq_len", 2, r"data.max_seq_len must be >= 8, got 2"),
    ("data", "workers", -1, r"data.workers must be >= 0 \(0: load in the training process\), got -1"),
    ("data", "workers", "many", r"data.workers must be int, got 'many' \(str\) or data.workers "
                                r"must be one of \['auto'\], got 'many'"),
    ("model", "freeze", ["eyes"], r"model.freeze: unknown part\(s\) \['eyes'\]"),
])
def test_bad_values_name_field_and_value(tmp_path, section, key, value, match):
    d = tiny_config_dict(str(tmp_path))
    d[section][key] = value
    with pytest.raises(ConfigError, match=match):
        from_dict(OmniConfig, d)


def test_nested_list_items_are_checked(tmp_path):
    d = tiny_config_dict(str(tmp_path))
    d["data"]["sources"][0]["weight"] = "heavy"
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight must be float"):
        from_dict(OmniConfig, d)


def test_missing_required_key(tmp_path):
    d = tiny_config_dict(str(tmp_path))
    del d["train"]["steps"]
    with pytest.raises(ConfigError, match=r"train is missing required key\(s\) \['steps'\]"):
        from_dict(OmniConfig, d)


def test_model_needs_exactly_one_origin(tmp_path):
    d = tiny_config_dict(str(tmp_path))
    d["model"]["pretrained"] = "some/dir"
    with pytest.raises(ConfigError, match="exactly one of 'pretrained'"):
        from_dict(OmniConfig, d)


def test_load_config_file_and_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(tiny_config_dict(str(tmp_path))))
    cfg = load_config(path, ["train.steps=7", "train.output_dir=/x/y", "parallel.dp=2"])
    assert (cfg.train.steps, cfg.train.output_dir, cfg.parallel.dp) == (7, "/x/y", 2)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; pass --config"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(bad)


def test_round_trip_through_dict(tmp_path):
    cfg = from_dict(OmniConfig, tiny_config_dict(str(tmp_path)))
    assert from_dict(OmniConfig, cfg.to_dict()) == cfg
