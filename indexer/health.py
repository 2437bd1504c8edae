"""What a stream's answers depend on besides the index: its state and when it last heard.

The subscriber owns one `StreamHealth` per stream and updates it; the per-worker query answers
(`indexer.worker_matches`) read it, so they need nothing of the subscriber's sockets or
sequence logic. Pure: no I/O.
"""

from __future__ import annotations

from indexer.stats import StreamState

__all__ = ["StreamHealth"]


class StreamHealth:
    """One stream's state, the times it heard anything, its block size once known, its rank."""

    __slots__ = (
        "block_size",
        "dp_rank",
        "last_event_at",
        "last_heard_at",
        "stale_after_s",
        "started_at",
        "state",
        "stream_id",
    )

    def __init__(
        self,
        stream_id: str,
        *,
        started_at: float,
        stale_after_s: float,
        block_size: int | None = None,
        state: StreamState = StreamState.SYNCING,
        dp_rank: int = 0,
    ) -> None:
        self.stream_id = stream_id
        self.dp_rank = dp_rank  # which data-parallel rank of its worker this stream is
        # what the subscriber last decided: never STALE (that is time), but a fed stream's when
        # the relay it follows is not known alive now (`indexer.fed_stream`)
        self.state = state
        self.started_at = started_at
        self.stale_after_s = stale_after_s
        self.last_event_at: float | None = None  # last batch applied
        self.last_heard_at: float | None = None  # last replay probe answered
        self.block_size = block_size  # configured, or learned from the first store

    def heard_at(self) -> float:
        """When the stream last heard anything (event or probe answer): what STALE counts from."""
        heard = [t for t in (self.last_event_at, self.last_heard_at) if t is not None]
        return max(heard) if heard else self.started_at

    def current_state(self, now: float) -> StreamState:
        """The state, STALE when nothing (event or probe answer) arrived for stale_after_s."""
        return StreamState.STALE if now - self.heard_at() > self.stale_after_s else self.state
