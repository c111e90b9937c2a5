"""Core placement (`data.pin_cores`, ds_omni/data/cores.py): the pure plan over simulated
nodes, and a spawned loader process that really runs on its cores (read back from it)."""

import os

import pytest
import torch

from ds_omni.config import DataConfig, from_dict
from ds_omni.data import cores
from ds_omni.data.cores import local_ranks, plan_cores
from ds_omni.errors import ConfigError
from tests.unit.data.test_loader import built  # noqa: F401


def test_eight_local_ranks_on_96_cores_each_get_their_own_slice():
    plans = [plan_cores(range(96), workers=2, local_rank=r, local_world=8) for r in range(8)]
    used = []
    for r, p in enumerate(plans):
        mine = list(range(12 * r, 12 * r + 12))  # rank r's slice: 12 cores, contiguous
        assert p.pinned and p.trainer == tuple(mine[:10])
        assert p.loader == (mine[10],) and p.pack_workers == ((mine[11],),)
        used += [*p.trainer, *p.loader, *(c for w in p.pack_workers for c in w)]
    assert sorted(used) == list(range(96))  # every core used once, none shared


def test_one_rank_on_two_cores_the_trainer_and_the_loader_process_a_core_each():
    p = plan_cores({0, 1}, workers=1)
    assert (p.trainer, p.loader, p.pack_workers) == ((0,), (1,), ())
    assert p.record() == {"pinned": True, "trainer": [0], "loader": [1], "pack_workers": [],
                          "why_not": ""}


def test_too_few_cores_nothing_pinned_and_the_reason_names_the_numbers():
    p = plan_cores({0, 1}, workers=2)  # trainer + loader process + 1 pack worker on 2 cores
    assert not p.pinned and not p.loader and "need 3" in p.why_not and "gets 2" in p.why_not
    p = plan_cores(range(4), workers=1, local_rank=0, local_world=8)  # half a core a rank
    assert not p.pinned and "gets 0 of the 4" in p.why_not
    assert not plan_cores(range(96), workers=2, local_world=None).pinned  # node size unknown


def test_workers_0_false_or_no_setaffinity_pin_nothing():
    assert "workers is 0" in plan_cores(range(8), workers=0).why_not
    assert not plan_cores(range(8), workers=1, setting=False).pinned
    assert "sched_setaffinity" in plan_cores(range(8), workers=1, can_pin=False).why_not
    assert plan_cores(range(8), workers=1, setting=True).pinned


def test_uneven_slices_and_a_bad_local_rank():
    plans = [plan_cores(range(10), workers=1, local_rank=r, local_world=3) for r in range(3)]
    assert [len(p.trainer) + 1 for p in plans] == [3, 3, 4]  # 10 cores over 3: 3, 3, 4
    with pytest.raises(ValueError, match="local rank 3"):
        plan_cores(range(8), workers=1, local_rank=3, local_world=3)


def test_the_launchers_say_the_local_world_and_one_rank_alone_is_its_own_node():
    assert local_ranks({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == (3, 8)  # torchrun
    assert local_ranks({"LOCAL_RANK": "1", "LOCAL_SIZE": "4", "WORLD_SIZE": "8"}) == (1, 4)
    assert local_ranks({}) == (0, 1)
    assert local_ranks({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}) == (1, None)  # not said


def test_the_config_field_takes_auto_true_false_only():
    src = [{"name": "a", "path": "x.jsonl"}]
    assert from_dict(DataConfig, {"sources": src}).pin_cores == "auto"
    assert from_dict(DataConfig, {"sources": src, "pin_cores": False}).pin_cores is False
    with pytest.raises(ConfigError, match="pin_cores"):
        from_dict(DataConfig, {"sources": src, "pin_cores": "yes"})


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and 2 cores")
def test_a_spawned_loader_process_runs_on_its_cores_and_the_trainer_gets_its_own_back(
        built, tmp_path):
    from tests.unit.data.test_loader_process import _parts
    from ds_omni.data.loader_process import LoaderProcess
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first, second = sorted(before)[:2]
    # (a pack worker beside the trainer: on 2 cores only a hand-made plan has one)
    plan = cores.CorePlan(trainer=(first,), loader=(second,), pack_workers=((first,),))
    loader = LoaderProcess(_parts(built, tmp_path), 2, timeout_s=60, cores=plan)
    try:
        assert os.sched_getaffinity(0) == {first} and torch.get_num_threads() == 1
        placed = loader.placement()  # what the loader process itself reads back
        assert placed == {"loader": [second], "threads": 1, "pack_workers": [[first]]}
        assert loader.next_step().error is None
    finally:
        loader.close()
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
