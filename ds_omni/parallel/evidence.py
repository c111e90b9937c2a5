"""Evidence that sequence parallelism ran: counts of the exchanges a rank issued, since start.

A parallel plan that silently falls back to a simpler one (every rank of an SP group computing
the whole row, a per-sequence block's row run without its group) can leave the loss and the
gradients exactly right: ZeRO sums the SP ranks' gradients, so doubled targets and a doubled loss
cancel. What such a fallback cannot fake is the work it skipped, so the model counts it where it
happens, as plain ints (no collective, no device sync): the tests assert them next to the
oracle, and the training log reports them (`as_metrics`). A feature declares its counters in the
module that counts them (`register`, as `ds_omni.model.ring_attention` does for parallel.cp).
"""

from __future__ import annotations

COUNTERS: dict[str, tuple[str, str]] = {}
"""counter -> (the composition table's feature it shows ran, what it counts), as registered."""


def register(feature: str, **counters: str) -> None:
    """Declare `feature`'s counters (name="what it counts"), each 0 on every `SPCounts` until
    counted; once, where the module that counts them is imported."""
    for name, what in counters.items():
        if COUNTERS.get(name, (feature,))[0] != feature:
            raise ValueError(f"evidence counter {name!r} is {COUNTERS[name][0]}'s already")
        COUNTERS[name] = (feature, what)


register(
    "sp",
    ulysses_calls="LLM attention calls that ran Ulysses over an SP group: each one all-to-alls "
    "q, k, v and the output (DeepSpeed's `DistributedAttention`)",
    reshard_exchanges="all-to-alls of the embedding resharding (`ReshardEmbeddings`), one per "
    "row with items",
    rows_sent="embedding rows this rank encoded and sent to another rank's shard",
    rows_received="embedding rows this rank's shard received from the rank that encoded them",
    encoder_pieces="pieces of long items this rank encoded, Ulysses inside the tower "
    "(long-short SP)",
    aux_reductions="forwards of a split row whose MoE aux-loss statistics (each sample's expert "
    "picks, router probabilities, tokens) this rank summed over the row's group (`model.moe_aux`)")


class SPCounts:
    """One rank's sequence-parallel work since the model was built, as forward passes (training
    and evaluation) issue it: each exchange runs once more in backward, uncounted; a decoder
    layer recomputed in backward (activation checkpointing) calls its attention again, counted.
    Every registered counter (`COUNTERS`) is an int attribute, 0 until counted."""

    def __init__(self, **counts: int):
        if unknown := set(counts) - set(COUNTERS):
            raise TypeError(f"no evidence counters {sorted(unknown)}; registered: "
                            f"{sorted(COUNTERS)}")
        self.__dict__.update(counts)

    def __getattr__(self, name: str) -> int:
        if name in COUNTERS:
            return 0
        raise AttributeError(f"'SPCounts' object has no attribute {name!r} (no counter of that "
                             "name is registered: `ds_omni.parallel.evidence.register`)")

    def __eq__(self, other) -> bool:
        return isinstance(other, SPCounts) and self.as_metrics() == other.as_metrics()

    def __repr__(self) -> str:
        return f"SPCounts({', '.join(f'{n}={getattr(self, n)}' for n in COUNTERS)})"

    def resharded(self, plan) -> None:
        """One resharding all-to-all of `plan` (a `RankReshard`) issued by this rank."""
        self.reshard_exchanges += 1
        self.rows_sent += plan.rows_moved()
        self.rows_received += plan.rows_in - plan.recv_counts[plan.rank]

    def as_metrics(self) -> dict[str, int]:
        """The counts as log fields, `sp_<name>`."""
        return {f"sp_{name}": getattr(self, name) for name in COUNTERS}
