"""The normalized KV-event model every wire layout decodes into.

SGLang (arrays, 8-slot salted arrays, maps) and vLLM (12-slot arrays, maps) all land here, so
the index and the recorder never see a wire layout. Field names follow the engines' own.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

__all__ = [
    "BlockHash",
    "Cleared",
    "Event",
    "EventBatch",
    "Removed",
    "Stored",
    "TokenId",
]

# Engine block hashes are opaque ids: SGLang sends signed int64, vLLM unsigned uint64 or 32 raw
# bytes. Ints stay ints and bytes stay bytes, so equal wire values always give equal ids.
BlockHash: TypeAlias = int | bytes

# A token is an int, or a (prev, next) pair on SGLang EAGLE bigram pages.
TokenId: TypeAlias = int | tuple[int, int]


class Stored(msgspec.Struct, frozen=True, gc=False):
    """Pages stored in a worker's cache: `BlockStored` in every layout.

    `parent` applies to the first page; page i > 0 has `block_hashes[i - 1]` as parent.
    `len(token_ids) == len(block_hashes) * block_size` (a trailing partial page comes as its
    own event with a smaller block_size).
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


Event: TypeAlias = Stored | Removed | Cleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One published payload: `[ts, events, dp_rank]` on the wire.

    `skipped` counts events of unknown kinds that the decoder dropped from an otherwise valid
    batch (never fatal, always counted).
    """

    ts: float
    events: list[Event]
    dp_rank: int | None = None
    skipped: int = 0
