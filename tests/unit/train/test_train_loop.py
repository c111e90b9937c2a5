"""The training loop's bookkeeping around a step, with a stand-in engine (no DeepSpeed)."""

import pytest

from ds_omni.config import DataConfig, ReorderConfig, SchemaConfig, SourceConfig
from ds_omni.data.build import cost_model_for
from ds_omni.data.loader import OmniLoader
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.rank_place import LoaderComms, RankPlace
from ds_omni.data.sources import Source
from ds_omni.parallel.groups import TorchDataComm, rank_groups
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.train.loop import _loop
from ds_omni.train.metrics import MetricsLogger, read_metrics
from tests.data_files import text_rows, write
from tests.fake_engine import FakeEngine
from tests.fixtures import tiny_config

ONE_RANK = rank_groups(ParallelPlan(world_size=1, dp=1), 0, prefetch=False)  # one process's groups

STEPS, BATCH, MICRO = 5, 8, 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ds_omni.model.build import build_model
    return build_model(tiny_config(str(tmp_path_factory.mktemp("m"))).model)


def _loader(built, path, schema, exhausted, mode="fixed") -> OmniLoader:
    cfg = DataConfig(sources=[SourceConfig(name="t", path=path, schema=SchemaConfig(**schema),
                                           on_exhausted=exhausted)],
                     max_seq_len=128, chunk_rows=4, reorder=ReorderConfig(mode=mode))
    procs = {"t": SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                                  item_processors=built.item_processors, markers={},
                                  max_seq_len=128)}
    return OmniLoader([Source(s, cfg.chunk_rows) for s in cfg.sources], procs,
                      cost_model_for(built, []), cfg, global_batch_size=BATCH,
                      place=RankPlace(num_micro=BATCH // MICRO),
                      comms=LoaderComms(TorchDataComm()))


def _train(out, engine, loader, start=0, **train):
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(str(out), steps=STEPS, log_samples=True, **train)
    logger = MetricsLogger(out, total_steps=STEPS, start_step=start, enabled=True)
    step = _loop(cfg, engine, loader, ONE_RANK, logger, None, 0, start, None)
    logger.close()
    return step


@pytest.mark.parametrize("mode", ["fixed", "budget"])
def test_a_run_stopped_by_an_exhausted_source_resumes_without_losing_its_last_step(built, tmp_path,
                                                                                  mode):
    """22 rows, 8 per step: the third step runs dry after 6 and stops the run; resumed (the source
    now repeats), every step trains what an uninterrupted run with on_exhausted=repeat trains."""
    path, schema = write("json", text_rows(22), tmp_path / "data", files=1)
    _train(tmp_path / "full", FakeEngine(), _loader(built, path, schema, "repeat", mode))
    stopped = _loader(built, path, schema, "stop", mode)
    step = _train(tmp_path / "run", FakeEngine(), stopped)
    assert step < STEPS
    state = stopped.state_dict()
    resumed = _loader(built, path, schema, "repeat", mode)
    resumed.load_state_dict(state)
    assert _train(tmp_path / "run", FakeEngine(), resumed, start=step) == STEPS
    expected = [r["sample_keys"] for r in read_metrics(tmp_path / "full")]
    assert [r["sample_keys"] for r in read_metrics(tmp_path / "run")] == expected


def test_modelled_cost_counts_the_vision_dummy_of_micro_batches_without_images(built, tmp_path):
    import io
    import numpy as np
    from PIL import Image
    from ds_omni.data.demo import shapes_rows
    path, schema = write("json", text_rows(8), tmp_path, files=1)
    loader = _loader(built, path, schema, "repeat")
    batch = loader.next_step()
    tokens = np.array([s.length for s in loader.load_samples(batch.keys)])
    image = Image.open(io.BytesIO(shapes_rows(1)[0]["image"]["bytes"]))
    one_image = loader.cost_model.encoder_cost(  # what the tower runs for a real image
        "vision", np.array(built.item_processors["vision"].measure(image).cost_seqs()))
    expected = loader.cost_model.llm_cost(tokens).sum() + len(batch.micro_batches) * one_image.sum()
    assert batch.modelled_cost == pytest.approx(expected, rel=1e-9)


def test_a_nonfinite_step_is_skipped_with_its_samples_recorded_or_stops_naming_them(built, tmp_path):
    from ds_omni.train.nonfinite import NonFiniteError
    path, schema = write("json", text_rows(8), tmp_path / "data", files=1)
    nan = FakeEngine(loss_per_target=float("nan"))
    _train(tmp_path / "skip", nan, _loader(built, path, schema, "repeat"), on_nonfinite="skip")
    records = read_metrics(tmp_path / "skip")
    assert len(records) == STEPS
    assert all(r["nonfinite_skipped"] == r["sample_keys"] and r["sample_keys"] for r in records)
    with pytest.raises(NonFiniteError, match=r"step 0 are not finite .* 8 samples: \['0/t:0:0'"):
        _train(tmp_path / "stop", nan, _loader(built, path, schema, "repeat"))


def test_stop_after_ends_the_run_there_and_a_resume_goes_on_as_if_uninterrupted(built, tmp_path):
    """`ds-omni train --stop-after N`: N steps of this run, the loader left at that position."""
    path, schema = write("json", text_rows(60), tmp_path / "data", files=1)
    _train(tmp_path / "full", FakeEngine(), _loader(built, path, schema, "repeat"))
    first = _loader(built, path, schema, "repeat")
    out = tmp_path / "run"
    out.mkdir()
    cfg = tiny_config(str(out), steps=STEPS, log_samples=True)
    logger = MetricsLogger(out, total_steps=STEPS, start_step=0, enabled=True)
    assert _loop(cfg, FakeEngine(), first, ONE_RANK, logger, None, 0, 0, stop_after=2) == 2
    logger.close()
    resumed = _loader(built, path, schema, "repeat")
    resumed.load_state_dict(first.state_dict())
    assert _train(out, FakeEngine(), resumed, start=2) == STEPS
    expected = [r["sample_keys"] for r in read_metrics(tmp_path / "full")]
    assert [r["sample_keys"] for r in read_metrics(out)] == expected
