"""How a finished step goes from the loader process to the trainer: the tensors' bytes through one
shared-memory slot, everything else pickled over the pipe.

`encode` pickles a step once, when it is made (protocol 5, tensors as numpy arrays with their bytes
out of band); `Sender.send` copies the buffers into the slot at the reply and sends the pickle and
the spans; `Receiver.receive` copies the slot out in one memcpy and unpickles over it. One slot is
safe because requests and replies alternate and the trainer copies before its request returns; a
step-number guard in the slot's first 8 bytes turns any overlap into a `DataError`, never a wrong
batch. A step larger than the slot grows it (next power of two, a new name); without room in
/dev/shm (checked first: writing past a tmpfs is a SIGBUS) the buffers go inline over the pipe.
Whoever ends first unlinks the slot. Why not torch's `share_memory_()`: a file and a descriptor
per tensor per step, and the trainer's tensors would alias memory the loader reuses.
More: docs/internals.md, "The loader process".
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
