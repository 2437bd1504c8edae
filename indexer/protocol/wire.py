"""Decode-side wire shapes of every KV-event layout, as msgspec Structs.

Two families, because msgspec cannot put array-like and map Structs in one union:

- array layouts, tag first: SGLang <= 0.5.17 (7 slots), SGLang 0.5.18-0.5.19 salted (8 slots,
  slot 7 a `{"cache_salt": ...}` map), vLLM <= 0.23 (12 slots, slot 7 `lora_name`);
  `BlockRemoved` with 3 (SGLang) or 4 (vLLM, `group_idx`) slots. vLLM's `kv_cache_spec_kind`
  (slot 10) says which KV-cache group the blocks are in (hybrid models); trailing slots we do
  not declare are skipped by msgspec.
- map layouts tagged by `"type"`: SGLang >= 0.5.20 and vLLM >= 0.24. One Struct per tag holds
  the union of both engines' keys; unknown keys are ignored.

Every wire Struct knows how to `normalize()` itself into the model of `events`, checking the
cross-field rules msgspec cannot express. Limits are declared once, as `Meta` constraints, so
msgspec enforces them while parsing (before any large list is materialized in Python).
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec
from msgspec import Meta

from indexer.errors import ProtocolError
from indexer.protocol.events import REUSABLE_SPEC_KINDS, Cleared, Event, Removed, Stored

__all__ = [
    "KNOWN_TAGS",
    "MAX_BLOCK_SIZE",
    "MAX_EVENTS_PER_BATCH",
    "MAX_HASHES_PER_EVENT",
    "MAX_HASH_BYTES",
    "MAX_TOKENS_PER_EVENT",
    "ArrayBatch",
    "ArrayEvent",
    "ArrayHashes",
    "ArrayTag",
    "MapBatch",
    "MapEvent",
    "MapHashes",
    "MapTag",
    "RawBatch",
]

MAX_HASHES_PER_EVENT = 1 << 20
# Bounds a single event's token list (16 Mi tokens is far past any real coalesced step).
MAX_TOKENS_PER_EVENT = 1 << 24
MAX_EVENTS_PER_BATCH = 1 << 20
# The largest page (block) size in tokens anything may name: events, a worker's config or its
# /server_info, a snapshot, a recording. Far past what the engines run: vLLM's --block-size
# choices stop at a few hundred tokens (hybrid Mamba models raise the attention block to match
# a state page, to a few thousand at most), SGLang's --page-size is free but 1-256 in
# practice. Every key chain takes the block size in (`indexer.namespace`: a msgpack int in the
# namespace seed, a tuple of that many tokens per block), so a size past it is refused where
# it comes in; 2**64 made every request of a model a 500 (an OverflowError in the seed).
MAX_BLOCK_SIZE = 1 << 16
# vLLM sends 32-byte SHA-256 digests; leave room for a wider digest, refuse anything larger.
MAX_HASH_BYTES = 64
KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})

# msgpack ints are at most 64 bits (signed or unsigned), so int range needs no extra check.
_WireHash: TypeAlias = int | Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]
_Hashes: TypeAlias = Annotated[list[_WireHash], Meta(max_length=MAX_HASHES_PER_EVENT)]
_Tokens: TypeAlias = Annotated[list[int | tuple[int, int]], Meta(max_length=MAX_TOKENS_PER_EVENT)]
_BlockSize: TypeAlias = Annotated[int, Meta(gt=0, le=MAX_BLOCK_SIZE)]
_ExtraKeys: TypeAlias = Annotated[list[list[object] | None], Meta(max_length=MAX_HASHES_PER_EVENT)]
_GroupIdx: TypeAlias = Annotated[int, Meta(ge=0)]
# A Unix time from the publisher's clock: never negative (NaN/inf are refused by the decoder).
_Ts: TypeAlias = Annotated[float, Meta(ge=0)]
_SpecKind: TypeAlias = Annotated[str, Meta(max_length=64)]
_DpRank: TypeAlias = Annotated[int, Meta(ge=0)]
# vLLM's lookahead hashing: per block, the tokens after it that its hash covers. The most of
# them is the stream's lookahead, which a snapshot stores and checks against this same bound.
_Lookahead: TypeAlias = Annotated[
    list[Annotated[list[int], Meta(max_length=MAX_TOKENS_PER_EVENT)]],
    Meta(max_length=MAX_HASHES_PER_EVENT),
]


def _stored(
    block_hashes: list[int | bytes],
    parent: int | bytes | None,
    token_ids: list[int | tuple[int, int]],
    block_size: int,
    lora_id: int | None,
    lora_name: str | None,
    medium: str | None,
    cache_salt: str | None,
    extra_keys: list[list[object] | None] | None,
    session_id: str | None,
    group_idx: int | None,
    kv_cache_spec_kind: str | None = None,
    lookahead_token_ids: list[list[int]] | None = None,
) -> Stored:
    # The one rule msgspec cannot check: the tokens must fill exactly the announced pages.
    # Not for a group whose blocks are not indexed (sliding window, Mamba): vLLM 0.33 leaves
    # its null and masked blocks out of block_hashes but publishes token_ids for the whole
    # range, and the index skips the event without reading its tokens.
    if (kv_cache_spec_kind is None or kv_cache_spec_kind in REUSABLE_SPEC_KINDS) and len(
        token_ids
    ) != len(block_hashes) * block_size:
        raise ProtocolError(
            f"BlockStored has {len(token_ids)} token_ids for {len(block_hashes)} hashes of "
            f"block_size {block_size}"
        )
    # SGLang normalizes an empty salt to "no salt" (`cache_salt or None`); so do we, so that
    # "" can never become a namespace of its own.
    return Stored(
        block_hashes,
        parent,
        token_ids,
        block_size,
        lora_id,
        lora_name,
        medium,
        cache_salt or None,
        extra_keys,
        session_id,
        group_idx,
        kv_cache_spec_kind,
        max(map(len, lookahead_token_ids), default=0) if lookahead_token_ids else 0,
    )


# --- array layouts ------------------------------------------------------------------------


class StoredMetadata(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Slot 7 of SGLang 0.5.18-0.5.19's 8-slot `BlockStoredWithMetadata`: its
    `BlockStoredMetadata`, written only for a salted store, whose one field is the salt.

    A map without a string `cache_salt`, or with a key it does not have, does not decode (the
    event is `Unreadable`): before, such a map read as no salt, and a salted store whose key
    was misspelled or damaged was predicted to unsalted requests (QA: 8 tokens of another
    tenant's pages, nothing counted). A key SGLang adds later may be a namespace component."""

    cache_salt: str


class ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    """`BlockStored` as an array: SGLang 7 or 8 slots, vLLM 12 slots."""

    block_hashes: _Hashes
    parent_block_hash: _WireHash | None
    token_ids: _Tokens
    block_size: _BlockSize
    lora_id: int | None = None
    medium: str | None = None
    # SGLang: the metadata map; vLLM: lora_name.
    slot7: StoredMetadata | str | None = None
    extra_keys: _ExtraKeys | None = None
    group_idx: _GroupIdx | None = None
    kv_cache_spec_kind: _SpecKind | None = None
    kv_cache_spec_sliding_window: int | None = None
    # vLLM 0.33's further slots (`vllm/distributed/kv_events.py`, in this order)
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: _Lookahead | None = None

    def normalize(self) -> Event:
        """The normalized `Stored`."""
        slot7 = self.slot7
        if slot7 is None or type(slot7) is str:
            lora_name, cache_salt = slot7, None
        else:
            assert isinstance(slot7, StoredMetadata)
            lora_name, cache_salt = None, slot7.cache_salt
        return _stored(
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            lora_name,
            self.medium,
            cache_salt,
            self.extra_keys,
            self.session_id,
            self.group_idx,
            self.kv_cache_spec_kind,
            self.lookahead_token_ids,
        )


class ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    """`BlockRemoved` as an array: `[tag, hashes, medium]`, vLLM adds `group_idx`."""

    block_hashes: _Hashes
    medium: str | None = None
    group_idx: _GroupIdx | None = None

    def normalize(self) -> Event:
        """The normalized `Removed`."""
        return Removed(self.block_hashes, self.medium, self.group_idx)


class ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    """`AllBlocksCleared` as an array: just the tag."""

    def normalize(self) -> Event:
        """The normalized `Cleared`."""
        return Cleared()


ArrayEvent: TypeAlias = ArrayStored | ArrayRemoved | ArrayCleared


class ArrayTag(msgspec.Struct, array_like=True, gc=False):
    """Just slot 0 of an array event, to tell an unknown tag from a malformed known event."""

    tag: str


class ArrayHashes(msgspec.Struct, array_like=True, gc=False):
    """What an array `BlockStored` or `BlockRemoved` that does not decode may still show: its
    tag, hashes and KV-cache group (`events.Unreadable`); the other slots are not read."""

    tag: str
    block_hashes: _Hashes
    slot2: msgspec.Raw = msgspec.Raw()  # BlockStored: parent; BlockRemoved: medium
    slot3: msgspec.Raw = msgspec.Raw()  # BlockStored: token_ids; BlockRemoved: group_idx
    block_size: msgspec.Raw = msgspec.Raw()
    lora_id: msgspec.Raw = msgspec.Raw()
    medium: msgspec.Raw = msgspec.Raw()
    slot7: msgspec.Raw = msgspec.Raw()
    extra_keys: msgspec.Raw = msgspec.Raw()
    group_idx: msgspec.Raw = msgspec.Raw()
    kv_cache_spec_kind: msgspec.Raw = msgspec.Raw()


# --- map layouts --------------------------------------------------------------------------


class MapStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", forbid_unknown_fields=True, gc=False
):
    """`BlockStored` as a map: SGLang >= 0.5.20 and vLLM >= 0.24 keys together.

    A key neither engine writes makes the event `Unreadable` (fail closed): SGLang leaves
    `cache_salt` out of an unsalted store, so a salted one whose key was misspelled or damaged
    read as unsalted, and an unknown key may be a namespace component of a later engine
    (before, unknown keys were ignored: QA, another tenant's pages predicted, nothing
    counted)."""

    block_hashes: _Hashes
    token_ids: _Tokens
    block_size: _BlockSize
    parent_block_hash: _WireHash | None = None
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None
    extra_keys: _ExtraKeys | None = None
    group_idx: _GroupIdx | None = None
    kv_cache_spec_kind: _SpecKind | None = None
    lookahead_token_ids: _Lookahead | None = None
    # vLLM's further keys, known and not read (as its array slots: `ArrayStored`)
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def normalize(self) -> Event:
        """The normalized `Stored`."""
        return _stored(
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            self.lora_name,
            self.medium,
            self.cache_salt,
            self.extra_keys,
            self.session_id,
            self.group_idx,
            self.kv_cache_spec_kind,
            self.lookahead_token_ids,
        )


class MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    """`BlockRemoved` as a map."""

    block_hashes: _Hashes
    medium: str | None = None
    group_idx: _GroupIdx | None = None

    def normalize(self) -> Event:
        """The normalized `Removed`."""
        return Removed(self.block_hashes, self.medium, self.group_idx)


class MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    """`AllBlocksCleared` as a map."""

    def normalize(self) -> Event:
        """The normalized `Cleared`."""
        return Cleared()


MapEvent: TypeAlias = MapStored | MapRemoved | MapCleared


class MapTag(msgspec.Struct, gc=False):
    """Just the `type` key of a map event."""

    type: str


class MapHashes(msgspec.Struct, gc=False):
    """What a map `BlockStored` or `BlockRemoved` that does not decode may still show."""

    type: str
    block_hashes: _Hashes
    group_idx: msgspec.Raw = msgspec.Raw()
    kv_cache_spec_kind: msgspec.Raw = msgspec.Raw()


# --- batches ------------------------------------------------------------------------------


class ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    """Fast path: a batch whose events are all arrays (SGLang <= 0.5.19, vLLM <= 0.23)."""

    ts: _Ts
    events: Annotated[list[ArrayEvent], Meta(max_length=MAX_EVENTS_PER_BATCH)]
    dp_rank: _DpRank | None = None


class MapBatch(msgspec.Struct, array_like=True, gc=False):
    """Fast path: a batch whose events are all maps (SGLang >= 0.5.20, vLLM >= 0.24)."""

    ts: _Ts
    events: Annotated[list[MapEvent], Meta(max_length=MAX_EVENTS_PER_BATCH)]
    dp_rank: _DpRank | None = None


class RawBatch(msgspec.Struct, array_like=True, gc=False):
    """Slow path: events left undecoded, for mixed layouts and unknown tags."""

    ts: _Ts
    events: Annotated[list[msgspec.Raw], Meta(max_length=MAX_EVENTS_PER_BATCH)]
    dp_rank: _DpRank | None = None
