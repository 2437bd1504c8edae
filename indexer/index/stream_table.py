"""What the prefix index keeps per stream, and the counters it reports.

`PrefixIndex` (`indexer.index.prefix_index`) owns one `IndexedStream` per (worker, dp rank)
stream: its slot (the stream's bit in table values), its engine-hash map and the side tables
for rare cases (see the layout in the prefix index's docstring). Whole-stream operations
(clearing, a namespace's eviction) are its methods; entry by entry it is written by the
index's `BatchWriter`, whose fast paths keep those updates inline.
"""

from __future__ import annotations

import msgspec

from indexer.engines import EngineSpec
from indexer.fence import BatchFence
from indexer.index.held import HeldEvents
from indexer.index.removal_log import RemovalLog
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
    # blocks of KV-cache groups that make no reusable prefix (sliding window, Mamba), not kept
    skipped_group_blocks: int = 0
    # blocks keyed by more than their tokens, LoRA and salt (vLLM's multimodal inputs, prompt
    # embeddings: `indexer.namespace.vllm_plain_blocks`), and those after them: not kept
    unindexable_blocks: int = 0
    # events whose pages are of the other kind than the stream's (SGLang EAGLE (prev, next)
    # pairs on a stream of int tokens, or the reverse) while it holds entries: not kept
    token_kind_mismatches: int = 0


class ApplyOutcome(msgspec.Struct, gc=False):
    """What one batch did (the subscriber logs mismatches from it)."""

    stored: int = 0
    removed: int = 0
    cleared: bool = False
    unknown_parents: int = 0
    block_size_mismatches: int = 0
    skipped: int = 0
    skipped_group_blocks: int = 0
    unindexable_blocks: int = 0
    token_kind_mismatches: int = 0


class IndexedStream:
    """Everything the index knows about one (worker, dp rank) stream."""

    __slots__ = (
        "again",
        "bigram",
        "bit",
        "block_size",
        "blocks",
        "cleared_at",
        "counters",
        "dup_keys",
        "engine",
        "fence",
        "held",
        "last_seq",
        "lookahead",
        "lora_by_id",
        "media",
        "model",
        "ns_cache",
        "ns_counts",
        "partial",
        "refs",
        "removals",
        "sbit",
        "singles",
        "skipped_groups",
        "slot",
        "unknown_removed_at",
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
        # its events while its page size is unknown and no page has proven it (SGLang:
        # `indexer.index.held`); None when nothing is held
        self.held: HeldEvents | None = None
        # whether its pages are SGLang EAGLE (prev, next) pairs (`indexer.namespace.Bigrams`):
        # learned from its first stored page like the block size (None: no page seen yet)
        self.bigram: bool | None = None
        self.last_seq: int | None = None
        # what proves the publisher's batch `last_seq` is still the one applied (indexer.fence)
        self.fence: BatchFence | None = None
        self.counters = StreamCounters()
        # when its entries and pending marks were last dropped wholesale (the index's clock;
        # None: never): another replica's mark made before then is not taken
        self.cleared_at: float | None = None
        # when a batch last removed pages there the index did not know, or had an event that
        # did not decode (the index's clock; None: never): another replica's mark held up past
        # it may stand for pages gone since that no key names (`add_pending`)
        self.unknown_removed_at: float | None = None
        # the keys its batches removed, for the pending TTL, in a replica of a cluster
        # (`PrefixIndex.log_removals`): a mark of a block removed since it was made is refused
        self.removals = RemovalLog()
        # whether its events named a LoRA adapter by number only (SGLang <= 0.5.19's array
        # layout): its pages of a named adapter come under another namespace than the name's
        self.lora_by_id = False
        # engine hash -> block key, values packed as int64 in the compiled map
        self.blocks = int_map(True)
        self.refs: dict[BlockHash, int] = {}  # engine hash -> reference count, only when > 1
        self.dup_keys: dict[int, int] = {}  # key -> extra engine hashes of this stream on it
        # key -> copies stored again in the default tier since its last removal (SGLang: each
        # a radix node of its own), only when > 0 (`PrefixIndex.copies`)
        self.again: dict[int, int] = {}
        # engine hash -> copies per tier (indexer.index.media), only when not all in the default
        self.media: dict[BlockHash, dict[str, int]] = {}
        self.partial: dict[BlockHash, tuple[int, int]] = {}  # engine hash -> (key, ns id)
        self.ns_counts: dict[int, int] = {}  # ns id -> indexed blocks of this stream
        # (lora, salt) -> ns id, so steady traffic builds no Namespace per event
        self.ns_cache: dict[tuple[str | None, str | None], int] = {}
        self.singles: dict[int, int] = {}  # ns id -> table value (sbit | ns code), shared
        # group_idx of KV-cache groups whose kind makes no reusable prefix (hybrid models)
        self.skipped_groups: set[int] = set()
        # the most tokens after a block its engine's hash covers (vLLM's lookahead hashing), as
        # its events showed; 0: none
        self.lookahead = 0

    def entries(self) -> int:
        """Blocks the stream holds now (partial pages included)."""
        return len(self.blocks) + len(self.partial)

    def forget_entries(self) -> None:
        """Drop every entry and side table of the stream (the caller unlinked the keys)."""
        self.blocks.clear()
        self.refs.clear()
        self.again.clear()
        self.media.clear()
        self.partial.clear()
        self.ns_counts.clear()
        self.held = None

    def evict(self, doomed: PyIntMap, ns_id: int) -> int:
        """Drop the entries of namespace `ns_id` whose keys are in `doomed`; returns how many.

        The caller already took those keys out of the shared table and the tiers.
        """
        gone = self.blocks.pop_by_value(doomed)
        if gone:
            for h, _ in gone:
                self.refs.pop(h, None)
                self.media.pop(h, None)
            for k in [k for k in self.dup_keys if k in doomed]:
                del self.dup_keys[k]
            for k in [k for k in self.again if k in doomed]:
                del self.again[k]
            self.ns_counts.pop(ns_id, None)
        lost = [h for h, (_, pns) in self.partial.items() if pns == ns_id]
        for h in lost:
            del self.partial[h]
            self.refs.pop(h, None)
        return len(gone) + len(lost)
