"""How a finished step goes from the loader process to the trainer (`loader_process.py`): the
tensors' bytes through one shared-memory slot, everything else pickled over the pipe.

A step is pickled once, when it is made (`encode`, on the loader process's step-ahead thread):
pickle protocol 5 with the tensors as numpy arrays (`workers._Pickler`) and their bytes left
out of band (`pickle.PickleBuffer`, PEP 574), so the pickle holds the structure and every
non-tensor field (a few KB) and the tensors are a list of buffers. At the reply (`Sender.send`)
the loader process copies those buffers into its slot, one shared-memory segment
(`multiprocessing.shared_memory`, 64-byte aligned spans), and the header it sends over the
pipe is the pickle and the spans. The trainer (`Receiver.receive`) copies the slot's bytes out
in one `bytearray` (a memcpy: ~0.05 ms for a 0.4 MB step) and unpickles with those as the
buffers: numpy arrays viewing the copy, `torch.from_numpy` over them. The same tensors (dtype,
shape, values) and fields as pickling the whole step (`workers.dumps`), without the pipe's 64 KiB
reads into a buffer and the unpickler's copy of each tensor.

One slot is enough, and safe by construction: requests and replies alternate on the pipe (one
request in flight), the slot is written only at a reply, and the trainer copies it out before
its request returns, so when the loader process writes step k + 1 (its request has arrived)
the trainer is done with step k. Writing a step into the slot when it is made (ahead) would
overwrite the step the trainer is reading; a guard sees it: the slot's first 8 bytes hold the
number of the step written (0 while writing), the header says which it should be, and the
trainer checks it before and after its copy (a `DataError`, never a wrong batch).

Bad cases. A step larger than the slot: the loader process replaces the slot by one of the next
power of two (at least 1 MiB) under the next name (`prefix` + its number). Where that cannot be
had (no /dev/shm, or too little room left in it: checked first, since writing past a tmpfs's
room is a SIGBUS, not an error), the step's buffers go inline in the header, over the pipe.

Cleanup, whoever ends first: the loader process unlinks its slot when it closes and when it
sees the trainer gone; the trainer unlinks the last slot it was told of and the next name (the
one reply in flight may have made it) when the loader process died. Both share multiprocessing's
resource tracker (spawned children use their parent's), so it has nothing left to warn about.

Why not torch's own sharing (`share_memory_()`, or a `torch.multiprocessing` queue, which
passes file descriptors): each tensor becomes a shared-memory file of its own, made and mapped
per step (a step holds ~50 tensors), with a file descriptor sent per tensor; and the trainer's
tensors would stay views of memory the loader process reuses, unless copied anyway.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from dataclasses import dataclass
from multiprocessing import shared_memory

from ds_omni.data.workers import _Pickler
from ds_omni.errors import DataError

ALIGN = 64  # every span starts on a cache line (and so on any dtype's alignment)
DATA_START = ALIGN  # [0, 8): the number of the step written, 0 while writing
MIN_SLOT = 1 << 20
_SHM_DIR = "/dev/shm"


@dataclass
class Encoded:
    """A step pickled with its tensors' bytes left out: the pickle, and the bytes, in order."""

    pickled: bytes
    buffers: list[memoryview]


def encode(obj) -> Encoded:
    """`obj` pickled (tensors as numpy arrays) with its contiguous arrays' bytes out of band."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return Encoded(out.getvalue(), [b.raw() for b in buffers])


def _spans(buffers: list[memoryview]) -> tuple[list[tuple[int, int]], int]:
    """(offset, length) of each buffer in the slot, and where the last one ends."""
    spans, end = [], DATA_START
    for b in buffers:
        spans.append((end, b.nbytes))
        end += -(-b.nbytes // ALIGN) * ALIGN
    return spans, end


def _room(size: int) -> bool:
    """Whether /dev/shm (where POSIX shared memory lives on Linux) has `size` bytes free."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return True  # another platform: shm_open says
    return st.f_bavail * st.f_frsize >= size


class Sender:
    """The loader process's end: its slot, and the headers of the steps written into it."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.shm: shared_memory.SharedMemory | None = None
        self.index = -1  # the number of the slot's name (prefix + index)
        self.written = 0  # steps written into a slot (the guard's number)

    def send(self, enc: Encoded) -> tuple:
        """Write `enc`'s buffers into the slot; the header the trainer's `Receiver` reads. Call
        only when the trainer's next request has come (it is done with the slot)."""
        spans, end = _spans(enc.buffers)
        if not enc.buffers or not self._fits(end):  # over the pipe, as bytes of their own
            return None, 0, [], enc.pickled, [bytearray(b) for b in enc.buffers]
        self.written += 1
        buf = self.shm.buf
        struct.pack_into("<Q", buf, 0, 0)
        for (offset, n), b in zip(spans, enc.buffers):
            buf[offset:offset + n] = b
        struct.pack_into("<Q", buf, 0, self.written)
        return self.index, self.written, spans, enc.pickled, None

    def _fits(self, size: int) -> bool:
        """A slot of at least `size` bytes: the one there, else a larger one (False: none)."""
        if self.shm is not None and self.shm.size >= size:
            return True
        grown = max(MIN_SLOT, 1 << (size - 1).bit_length())
        self.close()  # unlinked before the next is made: at most one name exists at a time
        if not _room(grown):
            return False
        try:
            self.shm = shared_memory.SharedMemory(f"{self.prefix}{self.index + 1}", create=True,
                                                  size=grown)
        except OSError:
            return False
        self.index += 1
        return True

    def close(self) -> None:
        """Unlink the slot (the trainer's mapping, if any, stays valid until it closes it)."""
        if self.shm is not None:
            shm, self.shm = self.shm, None
            shm.close()
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


class Receiver:
    """The trainer's end: builds each step from its header and the slot, copied out."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.shm: shared_memory.SharedMemory | None = None
        self.index = -1  # the slot last read (its name's number)

    def receive(self, header: tuple):
        index, written, spans, pickled, inline = header
        if index is None:
            return pickle.loads(pickled, buffers=inline)
        if index != self.index:
            self._attach(index)
        data = self._copy_out(written, spans[-1][0] + spans[-1][1])
        view = memoryview(data)
        return pickle.loads(pickled, buffers=[view[o:o + n] for o, n in spans])

    def _copy_out(self, written: int, end: int) -> bytearray:
        """The slot's bytes up to `end`, copied: the loader process may reuse the slot once the
        trainer's next request is sent. Checked to be step `written`'s, before and after."""
        buf = self.shm.buf
        before = struct.unpack_from("<Q", buf, 0)[0]
        data = bytearray(buf[:end])
        after = struct.unpack_from("<Q", buf, 0)[0]
        if before != written or after != written:
            raise DataError(f"the loader process's shared-memory slot {self.shm.name} held "
                            f"step {before}/{after} of its hand-over, not {written}: it wrote "
                            "the next step before this one was copied out (a bug in ds_omni)")
        return data

    def _attach(self, index: int) -> None:
        if self.shm is not None:
            self.shm.close()
        self.shm, self.index = shared_memory.SharedMemory(f"{self.prefix}{index}"), index

    def close(self, sender_gone: bool = False) -> None:
        """Unmap the slot; `sender_gone` (the loader process died): unlink what it left, the
        slot last read and the one a reply in flight may have made."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if sender_gone:
            for index in (self.index, self.index + 1):
                unlink(f"{self.prefix}{index}")


def unlink(name: str) -> None:
    """Remove the shared-memory segment `name` if it exists."""
    try:
        shm = shared_memory.SharedMemory(name)
    except (FileNotFoundError, ValueError):
        return
    shm.close()
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
