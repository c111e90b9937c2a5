"""One reader per SP group (`ds_omni/data/shared_read.py`) on simulated ranks (threads): the
peers get exactly the shards they would pack themselves, read and decode nothing, keep the
reader's state; a failing or dead reader is a clear error, never a hang."""

import re

import pytest
import torch

from ds_omni.config import DataConfig, SchemaConfig, SourceConfig
from ds_omni.data.build import cost_model_for
from ds_omni.data.loader import OmniLoader
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.rank_place import LoaderComms, RankPlace, SharedReading
from ds_omni.data.sources import Source
from ds_omni.errors import DataError
from ds_omni.parallel.plan import ParallelPlan
from tests import plants
from tests.data_files import conversation_rows, text_rows, write
from tests.data_sim import on_ranks, thread_shard_comms

SP = 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ds_omni.model.build import build_model
    from tests.fixtures import tiny_config
    return build_model(tiny_config(str(tmp_path_factory.mktemp("m"))).model)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> DataConfig:
    """Images (two corrupt: skipped by policy) and texts."""
    tmp = tmp_path_factory.mktemp("data")
    rows = conversation_rows(24)
    for i in (3, 17):
        rows[i]["image"] = {"bytes": b"corrupt", "path": None}
    img, img_schema = write("parquet", rows, tmp / "img")
    txt, txt_schema = write("json", text_rows(20), tmp / "txt")
    return DataConfig(sources=[
        SourceConfig(name="img", path=img, schema=SchemaConfig(**img_schema), weight=3.0,
                     on_bad_sample="skip"),
        SourceConfig(name="txt", path=txt, schema=SchemaConfig(**txt_schema))],
        max_seq_len=128, chunk_rows=4)


def _group(built, cfg, shared: bool, timeout: float = 60, sp: int = SP,
           tp: int = 1) -> list[OmniLoader]:
    """The sp x tp loaders of one reader group (data-parallel rank 0 of 1), in (sp, tp) order:
    rank g packs SP shard g // tp (sp 1: whole rows)."""
    procs = {s.name: SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                                     item_processors=built.item_processors,
                                     markers={"vision": "<image>"}, max_seq_len=128)
             for s in cfg.sources}
    comms = thread_shard_comms(sp * tp, timeout)
    return [OmniLoader([Source(s, cfg.chunk_rows) for s in cfg.sources], procs,
                       cost_model_for(built, []), cfg, global_batch_size=8,
                       place=RankPlace(plan=ParallelPlan(world_size=sp * tp, dp=1, sp=sp, tp=tp),
                                       rank=g, num_micro=2),
                       comms=LoaderComms(shared=SharedReading(comms[g]) if shared else None))
            for g in range(sp * tp)]


def _logged(loader):
    return [{**e, "reason": re.sub(" at 0x[0-9a-f]+", "", e["reason"])}
            for e in loader.take_skipped()]


def _tensors(mb):
    route = mb.route
    return [mb.input_ids, mb.targets, mb.position_ids, mb.cu_seqlens,
            *[t for e in sorted(mb.encoder_inputs) for _, t in sorted(mb.encoder_inputs[e].items())],
            *[t for e in sorted(route.split_inputs) for d in route.split_inputs[e]
              for _, t in sorted(d.items())]]


def _same(a, b) -> None:
    assert a.keys == b.keys and a.error == b.error and a.stats == b.stats
    assert a.modelled_cost == pytest.approx(b.modelled_cost, rel=1e-12)
    for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
        tx, ty = _tensors(x), _tensors(y)
        assert len(tx) == len(ty) and all(torch.equal(u, v) for u, v in zip(tx, ty))
        assert x.route.reshard == y.route.reshard and x.pad_tokens == y.pad_tokens


def test_peers_get_their_own_shards_and_read_nothing(built, cfg):
    """6 steps (every row once and again; the corrupt images skipped on the way): each SP rank's
    batches equal those it packs itself, its state and skipped samples the reader's; only the
    reader read rows and decoded images, and a peer holds no pixels of items it does not
    encode."""
    alone, shared = _group(built, cfg, False), _group(built, cfg, True)
    for _ in range(6):
        want = on_ranks(lambda r: alone[r].next_step(), SP)
        got = on_ranks(lambda r: shared[r].next_step(), SP)
        for w, g in zip(want, got):
            _same(w, g)
        for mb in got[1].micro_batches:
            plan = mb.route.reshard
            for enc, items in mb.items.items():
                for k, item in enumerate(items):
                    assert bool(item.inputs) == (k in plan.encode.get(enc, [])), (enc, k)
    assert [lo.skipped for lo in shared] == [lo.skipped for lo in alone] == [{"img": 4, "txt": 0}] * SP
    assert [_logged(lo) for lo in shared] == [_logged(lo) for lo in alone]
    states = [on_ranks(lambda r: group[r].state_dict(), SP) for group in (alone, shared)]
    assert states[0] == states[1] and states[1][0] == states[1][1]
    before, after = [lo.counts for lo in alone], [lo.counts for lo in shared]
    assert before[0] == before[1] and before[0].items > 0 and before[0].bytes > 0
    assert after[0] == before[0]  # the reader does what every rank did
    assert (after[1].rows, after[1].bytes, after[1].items) == (0, 0, 0)
    # a rewind on every rank: the peer goes back to the reader's position too
    on_ranks(lambda r: shared[r].rewind(), SP)
    on_ranks(lambda r: alone[r].rewind(), SP)
    for w, g in zip(on_ranks(lambda r: alone[r].next_step(), SP),
                    on_ranks(lambda r: shared[r].next_step(), SP)):
        _same(w, g)


def test_a_failing_reader_stops_its_peers_with_its_error(built, cfg):
    """A failure of the reader's data path reaches every rank of the group as the step's error,
    naming the reader's rank and the sample (its file); the peers do not wait for a batch."""
    group = _group(built, cfg, True)
    proc = group[0].processors["img"]
    real = type(proc).__call__

    def failing(self, **kw):
        raise RuntimeError("planted decoder crash")
    type(proc).__call__ = failing
    try:
        batches = on_ranks(lambda r: group[r].next_step(), SP)
    finally:
        type(proc).__call__ = real
    for b in batches:
        assert b.error is not None and "planted decoder crash" in b.error
        assert "data-parallel rank 0" in b.error and "loading sample" in b.error
        assert ".parquet" in b.error  # the sample's file
    assert batches[0].error == batches[1].error
    group[0].batches.load = lambda *a: (_ for _ in ()).throw(RuntimeError("load broke"))
    batches = on_ranks(lambda r: group[r].next_step(), SP)
    assert all("load broke" in b.error and "reader group" in b.error for b in batches)
    assert len(batches[1].micro_batches) == 2


def test_a_dead_reader_is_a_clear_error_not_a_hang(built, cfg):
    peer = _group(built, cfg, True, timeout=2)[1]
    with pytest.raises(DataError, match=r"rank 1 of the reader group of data-parallel rank 0 .* "
                                        r"got no batch from the group's reader \(rank 0\)"):
        peer.next_step()  # its reader never calls


def _check_reader_group(built, cfg, sp: int, tp: int, steps: int = 3) -> None:
    """Each rank of an sp x tp reader group trains on exactly what it packs alone (its SP
    shard, whole rows without SP), keeps the reader's state, and only the reader reads."""
    n = sp * tp
    alone, shared = _group(built, cfg, False, sp=sp, tp=tp), _group(built, cfg, True, sp=sp, tp=tp)
    for _ in range(steps):
        want = on_ranks(lambda g: alone[g].next_step(), n)
        got = on_ranks(lambda g: shared[g].next_step(), n)
        for w, g in zip(want, got):
            _same(w, g)
    states = on_ranks(lambda g: shared[g].state_dict(), n)
    assert states == on_ranks(lambda g: alone[g].state_dict(), n)
    counts = [lo.counts for lo in shared]
    assert counts[0] == alone[0].counts and counts[0].rows > 0 and counts[0].items > 0
    assert all((c.rows, c.bytes, c.items) == (0, 0, 0) for c in counts[1:]), counts


@pytest.mark.parametrize("sp, tp", [(1, 2), (2, 2)])
def test_tp_ranks_share_one_reader(built, cfg, sp, tp):
    """parallel.tp: the TP ranks of a row read nothing and get the reader's micro-batches
    (sp 1); with SP too (a group the config does not allow yet, the loader does), group rank g
    gets SP shard g // tp."""
    _check_reader_group(built, cfg, sp, tp)


def test_shard_of_a_group_rank():
    from ds_omni.data.shared_read import peer_shards, shard_of
    assert [shard_of(g, 4, 2) for g in range(4)] == [0, 0, 1, 1]
    assert [shard_of(g, 2, 1) for g in range(2)] == [0, 0]
    assert peer_shards(["own"], [["s1"]], 4) == [["own"], ["s1"], ["s1"]]
    with pytest.raises(ValueError, match="does not hold 2 SP ranks"):
        shard_of(1, 3, 2)


@pytest.mark.parametrize("plant", plants.for_launch("reader_group"))
def test_plant_reader_group_is_caught(plant, built, cfg):
    with plants.applied(plant, 0), pytest.raises(AssertionError):
        _check_reader_group(built, cfg, 2, 2, steps=1)
