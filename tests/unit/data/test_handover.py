"""The loader process's hand-over of a step (`ds_omni/data/handover.py`), in one process: every
kind of field comes back exactly, the slot is reused only after the copy-out (a step written too
early is an error, not a wrong batch), a step larger than the slot grows it (or goes over the
pipe), and no shared-memory segment is left behind. (Through the loader process itself, its
death and the trainer's: tests/unit/data/test_loader_process.py.)"""

import copy
import dataclasses
import os
import pickle
import secrets
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_omni.batch import EncodedItem, MicroBatch, Route
from ds_omni.data import handover
from ds_omni.data.handover import Receiver, Sender, encode
from ds_omni.data.loader import StepBatch
from ds_omni.data.workers import dumps
from ds_omni.errors import DataError
from tests import plants

SHM = Path("/dev/shm")


def _micro(seed: int, tokens: int = 6, pixels: int = 4) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (1, tokens), generator=g)
    pix = torch.randn(2, 3, pixels, pixels, generator=g)
    item = EncodedItem({"pixel_values": pix[0], "grid": torch.tensor([1, 2, 2])}, 3,
                       meta={"grid": (1, 2, 2), "patches": 4}, encoder_seqs=[4])
    return MicroBatch(
        input_ids=ids, targets=torch.roll(ids, -1, 1),
        position_ids=torch.arange(3 * tokens).reshape(tokens, 3).T.reshape(3, 1, tokens),  # a view
        cu_seqlens=torch.tensor([0, 2, tokens], dtype=torch.int32), max_seqlen=4,
        encoder_inputs={"vision": {"pixel_values": pix, "pixel_mask": pix > 0,
                                   "half": pix.half(), "bf16": pix.bfloat16()},
                        "audio": {"features": torch.empty(0, 80)}},
        sample_ids=[f"s{seed}", f"t{seed}"], pad_tokens=1,
        blocks=torch.tensor([[1, 3]]), items={"vision": [item]},
        route=Route(split_inputs={"vision": [{"pixel_values": pix[1:]}]},
                    row_positions={("vision", 0): np.arange(3)}, sp_block=(0, 2),
                    encode_calls={"vision": 2}))


def _step(seed: int, **kw) -> StepBatch:
    return StepBatch(step=seed, micro_batches=[_micro(seed), _micro(seed + 100, tokens=9)],
                     keys=["a", "b"], modelled_cost=1.5, stats={"skipped": {"x": 1}},
                     filler=_micro(seed + 200), **kw)


def _same(a, b, where="step") -> None:
    """Equal as data: types, every field, tensors' dtype, shape and values (not their strides)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture
def ends():
    prefix = f"dso_test_{os.getpid()}_{secrets.token_hex(3)}_"
    sender, receiver = Sender(prefix), Receiver(prefix)
    yield sender, receiver
    receiver.close()
    sender.close()
    assert not list(SHM.glob(f"{prefix}*")), "a shared-memory segment was left behind"


def test_a_step_comes_back_exactly_as_pickling_it_whole(ends):
    sender, receiver = ends
    for step in (_step(1), _step(2, error="a data error", stop="ran out")):
        step.micro_batches[1].encoder_inputs = {}  # no encoder inputs, no items
        step.micro_batches[1].items, step.micro_batches[1].blocks = {}, None
        header = sender.send(encode(step))
        assert header[0] == 0 and len(pickle.dumps(header)) < 20_000  # the bytes are in the slot
        got = receiver.receive(header)
        _same(step, got)
        _same(pickle.loads(dumps(step)), got)  # the pipe's hand-over, before the slot
        pix = got.micro_batches[0].encoder_inputs["vision"]["pixel_values"]
        pix += 1  # the trainer's own, writable memory (no warning, no effect on the slot)


def test_the_slot_is_reused_only_after_the_copy_out(ends):
    """Step 2 is written into the slot step 1 came through: step 1's tensors, still held, keep
    their values (they were copied out); one slot served both."""
    sender, receiver = ends
    first, second = _step(1), _step(2)
    want = copy.deepcopy(first)
    got = receiver.receive(sender.send(encode(first)))
    got2 = receiver.receive(sender.send(encode(second)))
    assert sender.index == receiver.index == 0
    _same(want, got)
    _same(second, got2)


@pytest.mark.parametrize("plant", plants.for_launch("handover"))
def test_plant_handover(ends, plant):
    with plants.applied(plant, 0), pytest.raises(AssertionError):
        test_the_slot_is_reused_only_after_the_copy_out(ends)


def test_a_step_written_before_the_last_was_copied_out_is_an_error(ends):
    sender, receiver = ends
    header = sender.send(encode(_step(1)))
    sender.send(encode(_step(2)))  # too early: the trainer has not read step 1
    with pytest.raises(DataError, match="before this one was copied out"):
        receiver.receive(header)


def test_a_step_larger_than_the_slot_grows_it_or_goes_over_the_pipe(ends, monkeypatch):
    sender, receiver = ends
    small, big = _step(1), _step(2)
    big.micro_batches[0].encoder_inputs["vision"]["large"] = torch.arange(3 << 18)  # 6 MiB
    _same(small, receiver.receive(sender.send(encode(small))))
    assert sender.shm.size == handover.MIN_SLOT
    _same(big, receiver.receive(sender.send(encode(big))))
    assert sender.index == 1 and sender.shm.size == 8 << 20
    assert not (SHM / f"{sender.prefix}0").exists()  # the small slot is gone
    _same(small, receiver.receive(sender.send(encode(small))))  # the large slot serves it
    bigger = _step(3)
    bigger.micro_batches[0].encoder_inputs["vision"]["large"] = torch.arange(3 << 20)
    monkeypatch.setattr(handover, "_room", lambda size: False)  # /dev/shm too small
    header = sender.send(encode(bigger))
    assert header[0] is None and sender.shm is None
    _same(bigger, receiver.receive(header))
    monkeypatch.undo()
    _same(small, receiver.receive(sender.send(encode(small))))  # a slot again
    assert sender.index == 2


def test_the_trainer_unlinks_what_a_dead_loader_process_left(ends):
    sender, receiver = ends
    receiver.receive(sender.send(encode(_step(1))))
    big = _step(2)
    big.micro_batches[0].encoder_inputs["vision"]["large"] = torch.arange(3 << 18)
    sender.send(encode(big))  # a reply in flight made the next slot; then the loader died
    sender.shm.close()
    sender.shm = None
    assert list(SHM.glob(f"{sender.prefix}*")) == [SHM / f"{sender.prefix}1"]
    receiver.close(sender_gone=True)
    assert not list(SHM.glob(f"{sender.prefix}*"))
