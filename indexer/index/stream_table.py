"""What the prefix index keeps per stream, and the counters it reports.

`PrefixIndex` (indexer/index.py) owns one `IndexedStream` per (worker, dp rank) stream: its
slot (the stream's bit in table values), its engine-hash map and the side tables for rare
cases (see the layout in indexer/index.py's docstring).
"""

from __future__ import annotations

import msgspec

from indexer.engines import EngineSpec
from indexer.fence import BatchFence
from indexer.index.values import CODE_BITS
from indexer.int_map import PyIntMap
from indexer.protocol.events import BlockHash

__all__ = ["ApplyOutcome", "IndexedStream", "StreamCounters"]


class StreamCounters(msgspec.Struct):
    """What the index did with one stream's events, cumulative."""

    blocks_stored: int = 0
    blocks_removed: int = 0
    unknown_parents: int = 0
    unknown_removes: int = 0
    block_size_mismatches: int = 0
    skipped_events: int = 0
    clears: int = 0


class ApplyOutcome(msgspec.Struct, gc=False):
    """What one batch did (the subscriber logs mismatches from it)."""

    stored: int = 0
    removed: int = 0
    cleared: bool = False
    unknown_parents: int = 0
    block_size_mismatches: int = 0
    skipped: int = 0


class IndexedStream:
    """Everything the index knows about one (worker, dp rank) stream."""

    __slots__ = (
        "bit",
        "block_size",
        "blocks",
        "counters",
        "dup_keys",
        "engine",
        "fence",
        "last_seq",
        "media",
        "model",
        "ns_cache",
        "ns_counts",
        "partial",
        "refs",
        "sbit",
        "singles",
        "slot",
    )

    def __init__(
        self,
        slot: int,
        model: str,
        engine: EngineSpec,
        block_size: int | None,
        int_map: type[PyIntMap] = PyIntMap,
    ) -> None:
        self.slot = slot
        self.bit = 1 << slot
        self.sbit = 1 << (slot + CODE_BITS)
        self.model = model
        self.engine = engine  # whose wire rules its events follow (indexer.engines)
        self.block_size = block_size
        self.last_seq: int | None = None
        # what proves the publisher's batch `last_seq` is still the one applied (indexer.fence)
        self.fence: BatchFence | None = None
        self.counters = StreamCounters()
        # engine hash -> block key, values packed as int64 in the compiled map
        self.blocks = int_map(True)
        self.refs: dict[BlockHash, int] = {}  # engine hash -> reference count, only when > 1
        self.dup_keys: dict[int, int] = {}  # key -> extra engine hashes of this stream on it
        self.media: dict[BlockHash, str] = {}  # engine hash -> medium, only when not default
        self.partial: dict[BlockHash, tuple[int, int]] = {}  # engine hash -> (key, ns id)
        self.ns_counts: dict[int, int] = {}  # ns id -> indexed blocks of this stream
        # (lora, salt) -> ns id, so steady traffic builds no Namespace per event
        self.ns_cache: dict[tuple[str | None, str | None], int] = {}
        self.singles: dict[int, int] = {}  # ns id -> table value (sbit | ns code), shared
