"""Validation: the eval plan over ranks (pure), the evaluator against a one-process evaluation of
the whole set (tests/oracle/), bad eval samples, and the loop's metrics, bar and report.
(tests/dist/test_parity.py checks the loss over 2 ranks under ZeRO 0-3, tests/dist/
test_sequence_parallel.py under SP.)"""

import pytest
import torch

from ds_omni.config import OmniConfig, SourceConfig, from_dict
from ds_omni.errors import ConfigError, DataError
from ds_omni.train.evaluate import Evaluator, eval_due, eval_plan
from tests import oracle
from tests.fixtures import eval_sources, tiny_config, tiny_config_dict


@pytest.mark.parametrize("rows", [0, 1, 5, 8, 13])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("per_micro", [1, 2, 3])
def test_every_row_is_evaluated_once_and_every_rank_runs_as_many_forwards(rows, dp, per_micro):
    plans = [eval_plan(rows, r, dp, per_micro) for r in range(dp)]
    got = sorted(i for plan in plans for mb in plan for i in mb)
    assert got == list(range(rows))
    assert len({len(plan) for plan in plans}) == 1
    assert all(len(mb) <= per_micro for plan in plans for mb in plan)
    assert not rows or plans[0][-1]  # no round is empty on every rank


def test_eval_is_due_every_n_steps_and_after_the_last():
    assert [s for s in range(1, 11) if eval_due(s, 4, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if eval_due(s, 0, 10)] == [10]


def test_eval_every_needs_eval_sources(tmp_path):
    data = tiny_config_dict(str(tmp_path), eval_every=5)
    with pytest.raises(ConfigError, match="data.eval_sources is empty"):
        from_dict(OmniConfig, data)


class _Plain:
    """The model as `Evaluator.run` calls an engine."""

    device = "cpu"

    def __init__(self, model):
        self.module = model

    def __call__(self, mb):
        return self.module(mb)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from ds_omni.data.build import build_loader
    from ds_omni.model.build import build_model
    tmp = tmp_path_factory.mktemp("eval")
    cfg = tiny_config(str(tmp / "out"))
    cfg.data.eval_sources = [from_dict(SourceConfig, s) for s in eval_sources(tmp)]
    built = build_model(cfg.model)
    with torch.no_grad():  # not the init the oracle builds: the parameters must really be loaded
        for p in built.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loader = build_loader(cfg, built, num_micro=1)
    return cfg, built, loader


@pytest.fixture(scope="module")
def reference_loss(setup):
    cfg, built, _ = setup
    return oracle.reference_eval_losses(cfg, [{n: p.detach().clone()
                                               for n, p in built.model.named_parameters()}])[0]


def test_one_process_eval_equals_the_oracle_in_eval_mode_and_restores_train_mode(setup,
                                                                                 reference_loss):
    cfg, built, loader = setup
    modes = []
    hook = built.model.backbone.register_forward_pre_hook(lambda m, _: modes.append(m.training))
    built.model.train()
    try:
        got = Evaluator(cfg, built, loader).run(_Plain(built.model))
    finally:
        hook.remove()
    assert modes == [False] * 3  # 5 rows, 2 per micro-batch, in eval mode
    assert built.model.training
    assert all(p.grad is None for p in built.model.parameters())
    assert got["eval_loss"] == pytest.approx(reference_loss, rel=1e-6)
    assert got["eval_samples"] == 5 and got["eval_targets"] > 0


def test_the_oracle_sees_one_dropped_eval_row(setup, reference_loss):
    cfg, built, loader = setup
    evaluator = Evaluator(cfg, built, loader)
    evaluator.plan[-1] = evaluator.plan[-1][:-1]  # planted: the last row is not evaluated
    assert evaluator.run(_Plain(built.model))["eval_loss"] != pytest.approx(reference_loss, rel=1e-6)


def test_a_bad_eval_sample_stops_with_the_fix_or_is_left_out(setup, tmp_path):
    import copy
    import json
    cfg, built, loader = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "b0", "conversations": [
        {"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "a shape"}],
        "image": "missing.png"}) + "\n" + json.dumps({"id": "b1", "conversations": "fine text"}) + "\n")
    cfg = copy.deepcopy(cfg)
    cfg.data.eval_sources = [SourceConfig(name="bad", path=str(bad), schema=from_dict(
        type(cfg.data.sources[0].schema), {"text": "conversations"}))]
    with pytest.raises(DataError, match=r"b0.*on_bad_sample to \"skip\""):
        Evaluator(cfg, built, loader).run(_Plain(built.model))
    cfg.data.eval_sources[0].on_bad_sample = "skip"
    got = Evaluator(cfg, built, loader).run(_Plain(built.model))
    assert got["eval_skipped"] == 1 and got["eval_samples"] == 1


def test_the_loop_logs_eval_loss_in_metrics_bar_and_report(setup, tmp_path, capsys):
    from ds_omni.parallel.groups import rank_groups
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.loop import _loop
    from ds_omni.train.metrics import MetricsLogger, read_metrics, write_report
    from tests.fake_engine import FakeEngine
    cfg, built, loader = setup
    cfg = tiny_config(str(tmp_path), steps=5)
    cfg.data.eval_sources, cfg.train.eval_every = setup[0].data.eval_sources, 2
    logger = MetricsLogger(tmp_path, total_steps=5, start_step=0, enabled=True)
    evaluator = Evaluator(cfg, built, loader)
    groups = rank_groups(ParallelPlan(world_size=1, dp=1), 0, prefetch=False)
    _loop(cfg, FakeEngine(loss_per_target=0.5), loader, groups, logger, None, 0, 0, None,
          evaluator=evaluator)
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 3, 4]  # after steps 2, 4, 5
    assert all(r["eval_loss"] == 0.5 for r in records if "eval_loss" in r)
    assert "eval=0.5000" in capsys.readouterr().err
    report = write_report(tmp_path, {})
    assert report["last_eval_loss"] == report["best_eval_loss"] == 0.5
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
