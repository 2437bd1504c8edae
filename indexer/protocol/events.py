"""The normalized KV-event model every wire layout decodes into.

SGLang (arrays, 8-slot salted arrays, maps) and vLLM (12-slot arrays, maps) all land here, so
the index and the recorder never see a wire layout. Field names follow the engines' own.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

__all__ = [
    "REUSABLE_SPEC_KINDS",
    "BlockHash",
    "Cleared",
    "Event",
    "EventBatch",
    "Removed",
    "Stored",
    "TokenId",
    "Unreadable",
]

# Engine block hashes are opaque ids: SGLang sends signed int64, vLLM unsigned uint64 or 32 raw
# bytes. Ints stay ints and bytes stay bytes, so equal wire values always give equal ids.
BlockHash: TypeAlias = int | bytes

# A token is an int, or a (prev, next) pair on SGLang EAGLE bigram pages.
TokenId: TypeAlias = int | tuple[int, int]

# vLLM's KV-cache group kinds whose blocks form a prefix a later request reuses
# (`vllm.v1.kv_cache_interface.KVCacheSpecKind`, 0.33): full attention in its three forms.
# Every other kind (sliding_window, sliding_window_mla, chunked_local_attention, mamba,
# encoder_only_attention, cross_attention, unknown) is not indexed. Events without the field
# (SGLang, older vLLM) describe a single-group model and are indexed as before.
REUSABLE_SPEC_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class Stored(msgspec.Struct, frozen=True, gc=False):
    """Pages stored in a worker's cache: `BlockStored` in every layout.

    `parent` applies to the first page; page i > 0 has `block_hashes[i - 1]` as parent.
    `len(token_ids) == len(block_hashes) * block_size` (a trailing partial page comes as its
    own event with a smaller block_size), except for a `kv_cache_spec_kind` that is not
    reusable: vLLM leaves such a group's null and masked blocks out of `block_hashes` but not
    out of `token_ids`, and nothing reads the tokens of an event the index skips.
    """

    block_hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[TokenId]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    cache_salt: str | None = None
    # vLLM: one entry per block (None or a list); the salt sits in extra_keys[0] of the first
    # block of a request. SGLang never sends it.
    extra_keys: list[list[object] | None] | None = None
    session_id: str | None = None
    group_idx: int | None = None
    # vLLM >= 0.33: the kind of the KV-cache group the blocks belong to ("full_attention",
    # "sliding_window", "mamba", ...; `vllm.v1.kv_cache_interface.KVCacheSpecKind`)
    kv_cache_spec_kind: str | None = None
    # vLLM >= 0.33 with lookahead hashing (on by default beside an EAGLE-style drafter): how
    # many tokens after each block its hash covers (the most of `lookahead_token_ids`), 0: none
    lookahead: int = 0


class Removed(msgspec.Struct, frozen=True, gc=False):
    """Pages evicted from a worker's cache: `BlockRemoved`."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class Cleared(msgspec.Struct, frozen=True, gc=False):
    """`AllBlocksCleared`: the worker flushed; drop everything known about this stream."""


class Unreadable(msgspec.Struct, frozen=True, gc=False):
    """An event of a known kind that does not decode, in its place in the batch (`reason`).

    Only what the index needs to fail closed could be read: its tag (`kind`), the hashes it
    names and its KV-cache group. Nothing of it is indexed; the index forgets the blocks it
    names (`indexer.index.writer.BatchWriter.forget`), the most that a store or a removal of
    them could have taken away. An event that does not show even that fails its whole batch.
    """

    kind: str  # "BlockStored" or "BlockRemoved"
    block_hashes: list[BlockHash]
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    reason: str = ""


Event: TypeAlias = Stored | Removed | Cleared | Unreadable


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One published payload: `[ts, events, dp_rank]` on the wire.

    `skipped` counts events of unknown kinds that the decoder dropped from an otherwise valid
    batch (never fatal, always counted); an event of a known kind that does not decode is an
    `Unreadable` among `events`.
    """

    ts: float
    events: list[Event]
    dp_rank: int | None = None
    skipped: int = 0
