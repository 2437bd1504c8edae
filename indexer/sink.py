"""Where a subscriber hands the batches it accepts: the index, or a recording.

A `StreamSubscriber` (`indexer.stream`) keeps one stream in sequence: it repairs gaps
through the replay socket, proves epochs, detects restarts. What it accepts goes, in the order
it is accepted, to one `StreamSink`:
- `IndexSink`: decodes and applies to a `PrefixIndex` (the router's indexer service);
- `RecordingSink` (`indexer.recording.capture`): writes the exact bytes to a recording file
  (`kvroute record`), so a capture repairs and proves streams exactly as the router does.

The subscriber's decisions need a few answers back: whether a payload decoded (a batch that
does not is fetched again), the batch the stream's state last took (its epoch fence), whether
anything is held, and the block size once learned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from indexer.fence import BatchFence
from indexer.index import PrefixIndex, StreamCounters
from indexer.protocol.decode import decode_batch
from indexer.protocol.events import EventBatch

__all__ = ["Applied", "IndexSink", "StreamSink", "keeps_entries"]


class Applied(NamedTuple):
    """What one accepted batch held (None instead, when its payload did not decode)."""

    events: int
    block_size_mismatches: int = 0  # pages that do not fit the stream's block size: not kept
    dp_rank: int | None = None  # the rank the batch says it is from (None: it says none)


class StreamSink(Protocol):
    """The receiving end of one stream's accepted batches (see the module docstring)."""

    def apply(
        self, topic: bytes, seq: int, payload: bytes, *, replayed: bool, run_start: bool = False
    ) -> Applied | None:
        """Take batch `seq`; None when the payload does not decode (it is the fence anyway).

        `run_start`: the first batch of a replay run the subscriber counts (a recording keeps
        it, so an offline replay counts the same runs).
        """

    def clear(self) -> int:
        """Forget the stream's state (restart, lost gap, lost batch); returns entries dropped."""

    def forget_seq(self) -> None:
        """The stream will be rebuilt from 0: no seq and no fence are known any more."""

    def fence(self) -> BatchFence | None:
        """What identifies the last batch taken (None: nothing can prove it)."""

    def last_seq(self) -> int | None:
        """The seq of the last batch taken, as the sink remembers it."""

    def entries(self) -> int:
        """What the stream's state holds now (0 when the sink keeps no state)."""

    def held_events(self) -> int:
        """Events held back unapplied while the page size is unknown (`indexer.index.held`):
        no entries, yet a clear drops them too (0 when the sink holds none)."""

    def block_size(self) -> int | None:
        """The stream's block size once configured or learned."""

    def counters(self) -> StreamCounters | None:
        """Cumulative counters of what the events did, where the sink keeps them."""


def keeps_entries(sink: StreamSink) -> bool:
    """Whether `sink` holds entries that predict hits, so the subscriber's messages may speak
    of them ("cleared 12 entries"). A sink says so with `keeps_entries = True` (an index's);
    one that does not (a recording's: bytes, no cache state) is told of in other words."""
    return getattr(sink, "keeps_entries", False) is True


class IndexSink:
    """Decodes each batch and applies it to one stream of a `PrefixIndex`."""

    keeps_entries = True

    def __init__(
        self,
        index: PrefixIndex,
        stream_id: str,
        decode: Callable[[bytes], EventBatch] = decode_batch,
    ) -> None:
        self.index = index
        self.stream_id = stream_id
        self._decode = decode

    def apply(
        self, topic: bytes, seq: int, payload: bytes, *, replayed: bool, run_start: bool = False
    ) -> Applied | None:
        """Decode and apply; an undecodable payload still becomes the stream's fence."""
        try:
            batch = self._decode(payload)
        except Exception:  # decode_batch raises ProtocolError; anything else is a bug there
            # these bytes are what the publisher has at `seq`, decodable or not
            self.index.set_last_seq(self.stream_id, seq, payload)
            return None
        outcome = self.index.apply(self.stream_id, batch, seq, payload)
        return Applied(len(batch.events), outcome.block_size_mismatches, batch.dp_rank)

    def clear(self) -> int:
        """Drop the stream's entries."""
        return self.index.clear_stream(self.stream_id)

    def forget_seq(self) -> None:
        """No seq and no fence are known any more."""
        self.index.set_last_seq(self.stream_id, None)

    def fence(self) -> BatchFence | None:
        """The index's fence of the stream."""
        return self.index.fence(self.stream_id) if self._has() else None

    def last_seq(self) -> int | None:
        """The seq the stream's entries correspond to (a loaded snapshot's, at first)."""
        return self.index.last_seq(self.stream_id) if self._has() else None

    def entries(self) -> int:
        """Blocks the stream holds."""
        return self.index.entries(self.stream_id) if self._has() else 0

    def held_events(self) -> int:
        """Events the stream holds back until its page size is known."""
        return self.index.held_events(self.stream_id) if self._has() else 0

    def block_size(self) -> int | None:
        """Configured or learned from the first store."""
        return self.index.block_size(self.stream_id) if self._has() else None

    def counters(self) -> StreamCounters | None:
        """The index's counters of the stream."""
        return self.index.counters(self.stream_id) if self._has() else None

    def _has(self) -> bool:
        return self.index.has_stream(self.stream_id)
