"""Evidence that sequence parallelism ran: counts of the exchanges a rank issued, since start.

A parallel plan that silently falls back to a simpler one (every rank of an SP group computing
the whole row, a per-sequence block's row run without its group) can leave the loss and the
gradients exactly right: ZeRO sums the SP ranks' gradients, so doubled targets and a doubled loss
cancel. What such a fallback cannot fake is the work it skipped, so the model counts it where it
happens, as plain ints (no collective, no device sync): the tests assert them next to the
oracle, and the training log reports them (`as_metrics`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SPCounts:
    """One rank's sequence-parallel work since the model was built, as forward passes (training
    and evaluation) issue it: each exchange runs once more in backward, uncounted; a decoder
    layer recomputed in backward (activation checkpointing) calls its attention again, counted."""

    ulysses_calls: int = 0
    """LLM attention calls that ran Ulysses over an SP group: each one all-to-alls q, k, v
    and the output (DeepSpeed's `DistributedAttention`)."""
    reshard_exchanges: int = 0
    """All-to-alls of the embedding resharding (`ReshardEmbeddings`), one per row with items."""
    rows_sent: int = 0
    """Embedding rows this rank encoded and sent to another rank's shard."""
    rows_received: int = 0
    """Embedding rows this rank's shard received from the rank that encoded them."""
    encoder_pieces: int = 0
    """Pieces of long items this rank encoded, Ulysses inside the tower (long-short SP)."""
    aux_reductions: int = 0
    """Forwards of a split row whose MoE aux-loss statistics (each sample's expert picks,
    router probabilities, tokens) this rank summed over the row's group (`model.moe_aux`)."""
    ring_steps: int = 0
    """Ring-attention passes (parallel.cp): key/value blocks this rank sent to the next rank."""
    ring_bytes: int = 0
    """Bytes of those blocks."""

    def resharded(self, plan) -> None:
        """One resharding all-to-all of `plan` (a `RankReshard`) issued by this rank."""
        self.reshard_exchanges += 1
        self.rows_sent += plan.rows_moved()
        self.rows_received += plan.rows_in - plan.recv_counts[plan.rank]

    def as_metrics(self) -> dict[str, int]:
        """The counts as log fields, `sp_<name>`."""
        return {f"sp_{name}": value for name, value in asdict(self).items()}
