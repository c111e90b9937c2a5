"""A bad DeepSpeed JSON is refused at start-up, before DeepSpeed (or a process group) starts,
naming the field, the value and the fix; nothing is written to the output folder."""

import pytest

from tests.bad_input.common import config, refused, says, snapshot, train, write
from tests.fixtures import ds_config


def _ds(**changes) -> dict:
    ds = ds_config(2)
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = ds
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return ds


WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0}}
DS_CASES = {  # name: (DeepSpeed JSON, ds_omni train fields, env WORLD_SIZE, words)
    "optimizer_type_unknown": (_ds(optimizer__type="AdamWW"), {}, None,
                               ["optimizer.type='AdamWW'", "not a type DeepSpeed knows",
                                "'adamw'", "torch.optim", "SGD"]),
    "optimizer_type_missing": (_ds(optimizer={"params": {}}), {}, None,
                               ["optimizer.type=None", "'adam'"]),
    "scheduler_type_unknown": (_ds(scheduler={"type": "Cosine"}), {}, None,
                               ["scheduler.type='Cosine'", "WarmupCosineLR", "StepLR"]),
    "micro_batch_conflict": (_ds(train_micro_batch_size_per_gpu=4), {}, None,
                             ["train_micro_batch_size_per_gpu=4", "implies 2", "\"auto\""]),
    "global_batch_conflict": (_ds(train_batch_size=16), {}, None,
                              ["train_batch_size=16", "implies 8", "\"auto\""]),
    "accumulation_conflict": (_ds(gradient_accumulation_steps=3), {}, None,
                              ["gradient_accumulation_steps=3", "implies 4"]),
    "lr_conflict": (_ds(optimizer__params__lr=0.5), {}, None,
                    ["optimizer.params.lr=0.5", "implies 0.001"]),
    "warmup_conflict": (_ds(scheduler={"type": "WarmupLR",
                                       "params": {"warmup_num_steps": 100}}), {}, None,
                        ["scheduler.params.warmup_num_steps=100", "implies 0"]),
    "cosine_without_warmup": (_ds(scheduler={"type": "WarmupCosineLR"}), {}, None,
                              ["WarmupCosineLR needs at least one warm-up step",
                               "train.warmup_steps >= 1"]),
    "autotp_in_deepspeed": (_ds(tensor_parallel={"autotp_size": 2}), {}, None,
                            ["tensor_parallel.autotp_size=2", "set parallel.tp"]),
    "tp_sp_with_zero3": (_ds(zero_optimization__stage=3), {"parallel": {"tp": 2, "sp": 2}}, "4",
                         ["parallel.tp=2 cannot be combined with zero_optimization.stage=3 "
                          "when parallel.sp=2", "zero_optimization.stage to 1 or 2"]),
    "sp_zero3_reduce_scatter_off": (
        _ds(zero_optimization={"stage": 3, "reduce_scatter": False}), {"parallel": {"sp": 2}},
        "2", ["reduce_scatter=false", "set it to true"]),
}


@pytest.mark.parametrize("name", sorted(DS_CASES))
def test_bad_deepspeed_json_is_refused_before_deepspeed(tmp_path, capsys, monkeypatch,
                                                        no_training, name):
    ds, extra, world, words = DS_CASES[name]
    cfg = config(tmp_path / "out")
    cfg.update(extra)
    if world:
        monkeypatch.setenv("WORLD_SIZE", world)
    says(refused(capsys, *write(tmp_path, cfg, ds)), *words)
    assert snapshot(tmp_path / "out") == {}


def test_deepspeed_json_that_is_not_json(tmp_path, capsys, no_training):
    c, d = write(tmp_path, config(tmp_path / "out"))
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2},}')
    says(refused(capsys, c, d), "DeepSpeed config", "ds.json", "is not valid JSON", "line 1")


@pytest.mark.parametrize("section", [{"optimizer": {"type": "SGD", "params": {}}},
                                     {"optimizer": {"type": "adam", "params": {}}},
                                     {"scheduler": {"type": "StepLR",
                                                    "params": {"step_size": 1}}}])
def test_types_deepspeed_builds_are_let_through(tmp_path, capsys, no_training, section):
    """A torch.optim class, DeepSpeed's own name in any case, a torch LR scheduler."""
    assert train(capsys, *write(tmp_path, config(tmp_path / "out"),
                                {**ds_config(2), **section}))[0] == "started"
