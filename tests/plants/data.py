"""Planted errors of the data layer: the readers, the loader process and its hand-over
(tests/unit/data/, tests/dist/test_loader_process.py)."""

from tests.plants.registry import patched, plant


# ------------------------------- the sp x tp group's reader (tests/unit/data/test_shared_read.py)
@plant("reader_group_tp_major", "the reader of an sp x tp group hands group rank g the shard "
       "of SP rank g % sp (as if the group were in (tp, sp) order)", "reader_group")
def _reader_group_tp_major(rank: int):
    from ds_omni.data import shared_read

    def planted(own, shards, group_size):
        sp = len(shards) + 1
        return [own if g % sp == 0 else shards[g % sp - 1] for g in range(1, group_size)]
    yield from patched(shared_read, "peer_shards", lambda f: planted)


# ------------------------------------------- the loader process (tests/dist/test_loader_process.py)
@plant("loader_process_stale_position", "the loader process sends back, with each step, the "
       "loader's position before that step instead of after it (a resume reads it again)",
       "loader_process")
def _loader_process_stale_position(rank: int):
    from ds_omni.data import loader_serve
    yield from patched(loader_serve, "serve", lambda f: _stale_serve)


def _stale_serve(*args) -> None:
    """The loader process's loop with the plant in (it runs in a spawned process of its own, so
    the trainer's patch names this function, which the loader process imports)."""
    from ds_omni.data import loader_serve
    loader_serve.sent_position = lambda made: made.before
    loader_serve.serve(*args)


@plant("early_reply_dropped", "a request made while the reply to a \"next\" sent early is "
       "pending drops that reply, also where the request leaves the loader where it is (a "
       "state_dict for a checkpoint): the step made for it is lost", "early_reply")
def _early_reply_dropped(rank: int):
    from ds_omni.data.loader_process import LoaderProcess
    yield from patched(LoaderProcess, "_ask", lambda f: lambda self, op, *args, moves=False:
                       f(self, op, *args, moves=True))


# -------------------------------- the loader process's hand-over (tests/unit/data/test_handover.py)
@plant("handover_no_copy_out", "the trainer's tensors view the loader process's shared-memory "
       "slot instead of a copy of it: the next step's hand-over overwrites a step still held",
       "handover")
def _handover_no_copy_out(rank: int):
    from ds_omni.data import handover
    yield from patched(handover.Receiver, "_copy_out",
                       lambda f: lambda self, written, end: self.shm.buf[:end])
