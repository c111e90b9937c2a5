"""The loader on simulated data-parallel ranks (threads): balancing, policies, exact and elastic
resume. Every check is on sample keys, so a lost or repeated sample fails it."""

import collections
import json
import os
import re
import signal
import time

import pytest

from ds_omni.config import DataConfig, ParallelConfig, ReorderConfig, SchemaConfig, SourceConfig
from ds_omni.data.build import cost_model_for
from ds_omni.data.loader import OmniLoader
from ds_omni.data.prefetch import Prefetcher
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.rank_place import LoaderComms, RankPlace
from ds_omni.data.sample_reader import key_locator
from ds_omni.data.sources import Source
from ds_omni.parallel.plan import ParallelPlan
from tests.data_files import conversation_rows, text_rows, write
from tests.data_sim import on_ranks, thread_comms

GLOBAL_BATCH, MICRO = 8, 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ds_omni.model.build import build_model
    from tests.fixtures import tiny_config
    return build_model(tiny_config(str(tmp_path_factory.mktemp("m"))).model)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two sources: 40 image conversations (parquet), 30 texts of varied length (jsonl)."""
    tmp = tmp_path_factory.mktemp("data")
    img_path, img_schema = write("parquet", conversation_rows(40), tmp / "img")
    txt_path, txt_schema = write("json", text_rows(30), tmp / "txt")
    return {"img": (img_path, img_schema), "txt": (txt_path, txt_schema)}


def _cfg(data, mode="fixed", group=2, exhausted="repeat", **kw) -> DataConfig:
    return DataConfig(sources=[
        SourceConfig(name=n, path=p, schema=SchemaConfig(**s), on_exhausted=exhausted,
                     weight=2.0 if n == "img" else 1.0) for n, (p, s) in data.items()],
        max_seq_len=128, chunk_rows=4, reorder=ReorderConfig(mode=mode, group_size=group), **kw)


def _loaders(built, cfg: DataConfig, dp: int, own_step_comms: bool = False):
    """dp loaders; `own_step_comms`: their steps all-gather over exchanges of their own (as a
    prefetch thread's do over groups of their own)."""
    group = 1 if cfg.reorder.mode == "loader_order" else min(cfg.reorder.group_size, dp)
    comms = thread_comms(dp, group)
    step_comms = thread_comms(dp, group) if own_step_comms else comms
    procs = {s.name: SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                                     item_processors=built.item_processors,
                                     markers={"vision": "<image>"}, max_seq_len=128)
             for s in cfg.sources}
    cost = cost_model_for(built, [])
    return [OmniLoader([Source(s, cfg.chunk_rows) for s in cfg.sources], procs, cost, cfg,
                       global_batch_size=GLOBAL_BATCH,
                       place=RankPlace(plan=ParallelPlan.from_config(ParallelConfig(), dp,
                                                                     cfg.reorder),
                                       rank=r, num_micro=GLOBAL_BATCH // (dp * MICRO) or 1),
                       comms=LoaderComms(comms[r], step_comms[r]))
            for r in range(dp)]


def _steps(loaders, n):
    """Run n steps on all ranks; per step, per rank, the StepBatch."""
    return [on_ranks(lambda r: loaders[r].next_step(), len(loaders)) for _ in range(n)]


def _rows(keys):
    return [str(key_locator(k)) for k in keys]


@pytest.mark.parametrize("mode", ["loader_order", "fixed", "budget"])
def test_every_sample_once_per_epoch(built, data, mode):
    loaders = _loaders(built, _cfg(data, mode, exhausted="drop"), dp=4)
    trained = []
    for step in _steps(loaders, 12):
        assert all(b.error is None for b in step)
        assert all(len(b.micro_batches) == loaders[0].num_micro for b in step)
        trained += [k for b in step for k in b.keys]
    rows = collections.Counter(_rows(trained))
    assert set(rows.values()) == {1} and len(rows) == 70  # 40 + 30, each exactly once


def test_grouped_reordering_balances_modelled_cost(built, data):
    def spread(mode):
        loaders = _loaders(built, _cfg(data, mode, group=4), dp=4)
        worst = []
        for step in _steps(loaders, 6):
            costs = [b.modelled_cost for b in step]
            worst.append(max(costs) / (sum(costs) / len(costs)))
        return sum(worst) / len(worst)
    assert spread("fixed") < spread("loader_order")
    assert spread("fixed") < 1.1


def test_budget_mode_delays_are_bounded(built, data):
    loaders = _loaders(built, _cfg(data, "budget"), dp=4)
    for step in _steps(loaders, 10):
        assert max(b.stats["max_delay"] for b in step) <= loaders[0].cfg.reorder.max_wait


@pytest.mark.parametrize("mode", ["fixed", "budget"])
def test_state_is_json_and_resumes_exactly(built, data, mode):
    cfg = _cfg(data, mode)
    a = _loaders(built, cfg, dp=2)
    _steps(a, 3)
    state = json.loads(json.dumps(on_ranks(lambda r: a[r].state_dict(), 2)[0]))
    assert state["version"] == 2 and state["dp_size"] == 2
    expected = [[b.keys for b in step] for step in _steps(a, 4)]
    b = _loaders(built, cfg, dp=2)
    for loader in b:
        loader.load_state_dict(state)
    assert [[x.keys for x in step] for step in _steps(b, 4)] == expected


@pytest.mark.parametrize("mode,old_dp,new_dp", [("fixed", 2, 4), ("fixed", 4, 1),
                                                ("budget", 2, 4), ("budget", 4, 2)])
def test_elastic_resume_loses_and_repeats_nothing(built, data, mode, old_dp, new_dp):
    cfg = _cfg(data, mode, exhausted="drop")
    old = _loaders(built, cfg, old_dp)
    trained = [k for step in _steps(old, 3) for b in step for k in b.keys]
    state = json.loads(json.dumps(on_ranks(lambda r: old[r].state_dict(), old_dp)[0]))
    new = _loaders(built, cfg, new_dp)
    for loader in new:
        loader.load_state_dict(state)
    for _ in range(40):
        step = _steps(new, 1)[0]
        if not any(b.keys for b in step):
            break
        trained += [k for b in step for k in b.keys]
    rows = collections.Counter(_rows(trained))
    assert len(rows) == 70 and set(rows.values()) == {1}


def test_bad_samples_skip_or_stop(built, tmp_path):
    rows = conversation_rows(12)
    rows[3]["image"] = {"bytes": b"corrupt", "path": None}
    rows[7]["conversations"] = [{"from": "human", "value": "<image>"}]  # nothing to learn
    path, schema = write("parquet", rows, tmp_path, files=1)
    for policy in ("skip", "error"):
        cfg = DataConfig(sources=[SourceConfig(name="bad", path=path, schema=SchemaConfig(**schema),
                                               on_bad_sample=policy, on_exhausted="drop")],
                         max_seq_len=128, chunk_rows=4)
        loaders = _loaders(built, cfg, dp=1)
        batches = [s[0] for s in _steps(loaders, 2)]
        if policy == "skip":
            assert sum(len(b.keys) for b in batches) == 10
            assert batches[-1].stats["skipped"]["bad"] == 2
        else:
            errors = [b.error for b in batches if b.error]
            assert errors and "source 'bad' sample bad/r" in errors[0]


def test_stop_policy_reports_and_drop_policy_renormalises(built, data):
    loaders = _loaders(built, _cfg(data, "fixed", exhausted="stop"), dp=2)
    stops = [b.stop for step in _steps(loaders, 12) for b in step if b.stop]
    assert stops and "is exhausted (on_exhausted='stop')" in stops[0]


def test_live_weight_change_takes_effect_next_step(built, data):
    loaders = _loaders(built, _cfg(data, "fixed"), dp=2)
    _steps(loaders, 2)
    for loader in loaders:
        loader.set_weights({"img": 0.0})
    later = [k for step in _steps(loaders, 3) for b in step for k in b.keys]
    assert later and all(key_locator(k).source == "txt" for k in later)


def test_weights_file_changes_the_mix_while_running(built, data, tmp_path, capsys):
    import os
    from ds_omni.train.control import WeightsFile
    loader = _loaders(built, _cfg(data, "fixed"), dp=1)[0]
    control = WeightsFile(tmp_path, rank=0)
    assert control.poll(loader) is None  # no file yet
    (tmp_path / "mix_weights.json").write_text('{"img": 0}')
    assert control.poll(loader) == {"img": 0}
    assert all(key_locator(k).source == "txt" for k in loader.next_step().keys)
    (tmp_path / "mix_weights.json").write_text('{"imgg": 1}')
    os.utime(tmp_path / "mix_weights.json", (1e9, 2e9))  # a new modification time
    assert control.poll(loader) is None
    out = capsys.readouterr().out
    assert "ignored" in out and "unknown source(s) ['imgg']" in out
    assert all(key_locator(k).source == "txt" for k in loader.next_step().keys)  # still in force


def _batch_tensors(batch):
    return [(mb.input_ids, mb.targets, mb.position_ids, mb.cu_seqlens,
             sorted((e, k, v.shape, float(v.double().sum())) for e, d in mb.encoder_inputs.items()
                    for k, v in d.items())) for mb in batch.micro_batches]


@pytest.mark.parametrize("mode", ["fixed", "budget"])
def test_prefetch_gives_the_same_steps_and_the_state_of_the_steps_taken(built, data, mode):
    """2 ranks, 2 steps ahead, against loaders called step by step: the same micro-batches; the
    state, a weight change, a rewind and the end all at the steps taken, not the prefetched ones."""
    import torch
    from ds_omni.data.prefetch import Prefetcher
    cfg = _cfg(data, mode)
    plain = _loaders(built, cfg, dp=2)
    feeds = [Prefetcher(loader, 2) for loader in _loaders(built, cfg, dp=2, own_step_comms=True)]

    def both(n):
        a, b = _steps(plain, n), _steps(feeds, n)
        for x, y in zip(a, b):
            assert [s.keys for s in x] == [s.keys for s in y]
            for bx, by in zip(x, y):
                for tx, ty in zip(_batch_tensors(bx), _batch_tensors(by)):
                    assert all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v
                               for u, v in zip(tx, ty))
        return a
    both(3)
    for f in feeds:  # the threads go 2 steps ahead ...
        with f._cond:
            assert f._cond.wait_for(lambda: len(f._made) == 2, timeout=30)
    assert [f.loader.step for f in feeds] == [5, 5]
    states = on_ranks(lambda r: (plain[r].state_dict(), feeds[r].state_dict()), 2)
    assert states[0][1] == states[0][0] and states[0][1]["step"] == 3  # ... the state is not
    on_ranks(lambda r: (plain[r].set_weights({"img": 0.0}), feeds[r].set_weights({"img": 0.0})), 2)
    after = both(2)
    if mode == "fixed":  # (budget mode first trains what it has buffered)
        assert all(key_locator(k).source == "txt" for b in after[0] for k in b.keys)
    on_ranks(lambda r: (plain[r].rewind(), feeds[r].rewind()), 2)
    both(2)
    on_ranks(lambda r: feeds[r].close(), 2)
    assert not any(f._thread for f in feeds)
    assert [f.loader.step for f in feeds] == [p.step for p in plain] == [6, 6]
    ends = on_ranks(lambda r: (plain[r].state_dict(), feeds[r].loader.state_dict()), 2)
    assert ends[0][0] == ends[0][1]


def test_prefetch_thread_errors_reach_the_trainer_and_close_does_not_hang(built, data):
    from ds_omni.data.prefetch import Prefetcher
    loader = _loaders(built, _cfg(data, "fixed"), dp=1)[0]
    real, calls = loader.next_step, []

    def failing():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted failure")
        return real()
    loader.next_step = failing
    feed = Prefetcher(loader, 3)
    feed.next_step(), feed.next_step()
    with pytest.raises(RuntimeError, match="planted failure"):
        feed.next_step()
    feed.close(abort=True)
    assert feed._thread is None
    with pytest.raises(ValueError, match="needs process groups of its own"):
        Prefetcher(_loaders(built, _cfg(data, "fixed"), dp=2)[0], 1)


# ------------------------------------------------------------ data worker processes (data.workers)
def _worker_loader(built, tmp, workers: int) -> OmniLoader:
    """Images (two of them corrupt: skipped by policy) and texts, 8 samples a step."""
    rows = conversation_rows(24)
    for i in (3, 17):
        rows[i]["image"] = {"bytes": b"corrupt", "path": None}
    img, img_schema = write("parquet", rows, tmp / "img")
    txt, txt_schema = write("json", text_rows(20), tmp / "txt")
    cfg = DataConfig(sources=[
        SourceConfig(name="img", path=img, schema=SchemaConfig(**img_schema), weight=2.0,
                     on_bad_sample="skip"),
        SourceConfig(name="txt", path=txt, schema=SchemaConfig(**txt_schema))],
        max_seq_len=128, chunk_rows=4, workers=workers)
    procs = {s.name: SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                                     item_processors=built.item_processors,
                                     markers={"vision": "<image>"}, max_seq_len=128)
             for s in cfg.sources}
    return OmniLoader([Source(s, cfg.chunk_rows) for s in cfg.sources], procs,
                      cost_model_for(built, []), cfg, global_batch_size=8,
                      place=RankPlace(num_micro=2))


def _logged(loader):
    return [{**e, "reason": re.sub(" at 0x[0-9a-f]+", "", e["reason"])}
            for e in loader.take_skipped()]


def _all_tensors(batch):
    return [[mb.input_ids, mb.targets, mb.position_ids, mb.cu_seqlens,
             *[t for enc in sorted(mb.encoder_inputs) for _, t in sorted(
                 mb.encoder_inputs[enc].items())]] for mb in batch.micro_batches]


def test_workers_make_the_same_steps_and_a_dead_worker_is_a_clear_error(built, tmp_path):
    """One worker process (behind the prefetch thread) against loading in-process: the same
    micro-batches, skipped samples and state; a failure in it, and its death, are errors."""
    import torch
    here = _worker_loader(built, tmp_path / "a", workers=0)
    feed = Prefetcher(_worker_loader(built, tmp_path / "b", workers=1), 1)  # thread + worker
    for _ in range(6):  # every row once, and again: the corrupt images are met twice
        a, b = here.next_step(), feed.next_step()
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.keys == b.keys and a.stats == b.stats
        for ta, tb in zip(_all_tensors(a), _all_tensors(b), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
        assert _logged(here) == _logged(feed)
    assert here.skipped == feed.skipped and here.skipped["img"] >= 2
    assert here.state_dict() == feed.state_dict()

    pool = feed.loader.pool
    with pytest.raises(Exception, match="a data worker failed: AttributeError"):
        pool.map(["not a job"])  # an exception in the worker comes back with its traceback
    feed.close()
    assert feed.loader.pool is pool  # the pool outlives the prefetch thread: it is the loader's
    os.kill(pool._procs[0].pid, signal.SIGKILL)
    t0 = time.perf_counter()
    batch = feed.loader.next_step()  # no hang: this step's error, which stops every rank
    assert time.perf_counter() - t0 < 10
    assert "data worker process" in batch.error and "died with signal SIGKILL" in batch.error
    assert "lower data.workers" in batch.error
    feed.loader.close()
    assert feed.loader.pool is None


def test_a_numeric_encoder_sp_that_no_item_reaches_is_said_once(caplog):
    """Long-short SP with a threshold above every item's cost splits nothing: after QUIET_STEPS
    steps without a long item the loader says so, once; a step with one silences it for good."""
    import logging
    from ds_omni.data import step_load as loader_mod
    from ds_omni.parallel.long_short import LongItems

    def fresh(threshold):
        ld = loader_mod.MicroBatchLoader.__new__(loader_mod.MicroBatchLoader)
        ld.shard, ld.max_degree, ld._steps_without_long_items = object(), 1, 0
        ld.long_items = LongItems(threshold, {"vision": 4})
        return ld

    with caplog.at_level(logging.WARNING, logger=loader_mod.__name__):
        quiet = fresh(1e12)
        for _ in range(2 * loader_mod.QUIET_STEPS):
            quiet._check_long_items(0)
        busy = fresh(1.0)
        busy._check_long_items(3)
        for _ in range(2 * loader_mod.QUIET_STEPS):
            busy._check_long_items(0)
        auto = fresh(None)
        for _ in range(2 * loader_mod.QUIET_STEPS):
            auto._check_long_items(0)
    said = [r.getMessage() for r in caplog.records if "encoder_sp" in r.getMessage()]
    assert len(said) == 1 and "parallel.encoder_sp=1e+12" in said[0] and "auto" in said[0]


@pytest.mark.parametrize("placement", ["uniform", "bubbles", "auto"])
def test_long_short_sp_is_off_under_the_joint_pipeline(tmp_path, built, placement):
    """Under pp every joint placement ("auto" resolves to one) has its stages encode whole items
    (`EncodeShare`): a long item split over the SP ranks would reach no stage whole."""
    from ds_omni.data.build import long_items_of
    from tests.fixtures import tiny_config
    cfg, model = tiny_config(str(tmp_path)), built.model
    cfg.parallel = ParallelConfig(pp=2, sp=2, encoder_placement=placement)
    assert long_items_of(cfg, model, 2) is None
    cfg.parallel = ParallelConfig(pp=2, sp=2, encoder_placement="stage0")
    assert long_items_of(cfg, model, 2) is not None
