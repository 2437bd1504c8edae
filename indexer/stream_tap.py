"""A tap on the index's streams: what a relay republishes (`router.cluster.relay`).

A `StreamTap` is told, in order, everything one stream's subscriber makes its index do: each
batch applied, each clear, each seq forgotten, each state entered. `TappedSink` puts one between
a subscriber and its `IndexSink`, so the tap sees exactly what the index took, in the order it
took it, with the subscriber's repairs and proofs already done. The tap must not block.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from indexer.fence import BatchFence
from indexer.index import StreamCounters
from indexer.sink import Applied, IndexSink, keeps_entries
from indexer.stats import StreamState

__all__ = ["StreamHead", "StreamTap", "TappedSink"]


class StreamHead(NamedTuple):
    """Where one subscribed stream stands, for a relay's heartbeat."""

    stream: str
    state: StreamState  # what the subscriber decided, STALE when it has not heard its publisher
    heard_age_s: float  # since it last heard its publisher (an event or a probe's answer)
    seq: int | None  # its last batch, and that batch's digest (b"": none)
    digest: bytes
    checks: int  # restart checks made so far (verifications and restarts)
    # publisher restarts counted on the stream while its worker is registered (across its
    # registrations anew, as /admin/streams counts them)
    restarts: int = 0


class StreamTap(Protocol):
    """Told what each stream's index took (see the module docstring)."""

    def batch(self, stream: str, seq: int, payload: bytes, *, replayed: bool) -> None:
        """Batch `seq` was taken (decodable or not: it is the stream's fence either way)."""

    def cleared(self, stream: str) -> None:
        """The stream's entries were dropped."""

    def seq_forgotten(self, stream: str) -> None:
        """The stream will be rebuilt from 0."""

    def state(self, stream: str, state: StreamState) -> None:
        """The stream entered `state` (never STALE: that is time)."""

    def new_epoch(self) -> None:
        """The index was replaced (a snapshot loaded): what followed it must start afresh."""

    def follows(self, stream: str, source: str) -> None:
        """From now on the stream is read from the KV-event endpoint `source` (its worker
        registered, or registered anew): what the tap is told of it after this is of that
        endpoint's publisher."""


class TappedSink:
    """An `IndexSink` whose every change is also told to a `StreamTap`."""

    def __init__(self, inner: IndexSink, tap: StreamTap) -> None:
        self.inner = inner
        self.tap = tap
        self.stream_id = inner.stream_id

    def apply(
        self, topic: bytes, seq: int, payload: bytes, *, replayed: bool, run_start: bool = False
    ) -> Applied | None:
        """Apply to the index, then tell the tap (which sees the batch the index took)."""
        applied = self.inner.apply(topic, seq, payload, replayed=replayed, run_start=run_start)
        self.tap.batch(self.stream_id, seq, payload, replayed=replayed)
        return applied

    def clear(self) -> int:
        """Clear the index's stream, and say so."""
        dropped = self.inner.clear()
        self.tap.cleared(self.stream_id)
        return dropped

    def forget_seq(self) -> None:
        """Forget the seq, and say so."""
        self.inner.forget_seq()
        self.tap.seq_forgotten(self.stream_id)

    def fence(self) -> BatchFence | None:
        """The index's fence of the stream."""
        return self.inner.fence()

    def last_seq(self) -> int | None:
        """The index's seq of the stream."""
        return self.inner.last_seq()

    def entries(self) -> int:
        """Blocks the stream holds."""
        return self.inner.entries()

    def held_events(self) -> int:
        """Events the stream holds back until its page size is known."""
        return self.inner.held_events()

    @property
    def keeps_entries(self) -> bool:
        """The index's answer (`indexer.sink.keeps_entries`)."""
        return keeps_entries(self.inner)

    def block_size(self) -> int | None:
        """Configured or learned."""
        return self.inner.block_size()

    def counters(self) -> StreamCounters | None:
        """The index's counters of the stream."""
        return self.inner.counters()
