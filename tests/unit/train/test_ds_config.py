import pytest

from ds_omni.errors import ConfigError
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.train.ds_config import derive_ds_config
from tests.fixtures import ds_config, tiny_config


def _plan(cfg, world):
    return ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)


def test_batch_fields_follow_from_train_and_plan(tmp_path):
    cfg = tiny_config(str(tmp_path))  # global 8, micro 2
    out = derive_ds_config(cfg, ds_config(2), _plan(cfg, 2))
    assert out["train_micro_batch_size_per_gpu"] == 2
    assert out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 8
    assert out["optimizer"]["params"]["lr"] == cfg.train.lr
    assert derive_ds_config(cfg, ds_config(2), _plan(cfg, 4))["gradient_accumulation_steps"] == 1


def test_scheduler_length_and_warmup(tmp_path):
    cfg = tiny_config(str(tmp_path), steps=40, warmup_steps=5)
    user = {**ds_config(1), "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    params = derive_ds_config(cfg, user, _plan(cfg, 1))["scheduler"]["params"]
    assert (params["total_num_steps"], params["warmup_num_steps"]) == (40, 5)


def test_conflicting_user_value_is_an_error(tmp_path):
    cfg = tiny_config(str(tmp_path))
    user = {**ds_config(2), "gradient_accumulation_steps": 4}
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=4 but the ds_omni config "
                                          r"implies 2"):
        derive_ds_config(cfg, user, _plan(cfg, 2))
    user = ds_config(2)
    user["optimizer"]["params"]["lr"] = 0.5
    with pytest.raises(ConfigError, match=r"optimizer.params.lr=0.5"):
        derive_ds_config(cfg, user, _plan(cfg, 2))


def test_equal_explicit_value_is_fine(tmp_path):
    cfg = tiny_config(str(tmp_path))
    user = {**ds_config(2), "train_batch_size": 8}
    assert derive_ds_config(cfg, user, _plan(cfg, 2))["train_batch_size"] == 8


def test_indivisible_global_batch(tmp_path):
    cfg = tiny_config(str(tmp_path), global_batch_size=10, micro_batch_size=2)
    with pytest.raises(ConfigError, match=r"global_batch_size=10 is not divisible by .* 2 x 4 = 8"):
        derive_ds_config(cfg, ds_config(2), _plan(cfg, 4))


def test_cosine_schedule_needs_warmup(tmp_path):
    cfg = tiny_config(str(tmp_path), warmup_steps=0)
    user = {**ds_config(1), "scheduler": {"type": "WarmupCosineLR", "params": {}}}
    with pytest.raises(ConfigError, match="WarmupCosineLR needs at least one warm-up step"):
        derive_ds_config(cfg, user, _plan(cfg, 1))


def test_accelerate_names_the_deepspeed_config(monkeypatch):
    from ds_omni.cli import _deepspeed_config_path
    from ds_omni.errors import DsOmniError
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_configs/zero2.json")
    assert _deepspeed_config_path(None) == "ds_configs/zero2.json"
    assert _deepspeed_config_path("mine.json") == "mine.json"
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    with pytest.raises(DsOmniError, match="no DeepSpeed config: pass --deepspeed"):
        _deepspeed_config_path(None)
