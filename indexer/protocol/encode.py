"""Payload encoder for the reference workers: SGLang's array and map layouts.

The bytes must equal what SGLang's own `ZmqEventPublisher` writes (the golden captures check
it), so the Structs below re-declare SGLang's wire structs field for field:

- `"array"` (SGLang <= 0.5.19): `[tag, block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium]`, plus slot 7 `{"cache_salt": ...}` only when the event is salted (the
  seed's `BlockStoredWithMetadata`: unsalted events keep the legacy 7 slots exactly);
  `[tag, block_hashes, medium]`; `[tag]`.
- `"map"` (SGLang >= 0.5.20, 0.5.23 key order): `type` first, the five core keys always, then
  `medium`, `cache_salt`, `session_id`, `lora_name` only when set (SGLang omits defaults).

The batch is `[ts (float64), events, dp_rank]`. Fields SGLang's layout has no slot for
(`lora_name`/`session_id` in the array layout, vLLM's `extra_keys`/`group_idx` in both) are not
written: a reference worker that needs them must use the layout that carries them. An adapter's
name becomes a number in the array layout's `lora_id` (which kvroute files under a namespace no
request names: such pages are never predicted, as with SGLang's own ids).
"""

from __future__ import annotations

import zlib
from typing import Literal, TypeAlias

import msgspec

from indexer.protocol.events import BlockHash, Cleared, Event, EventBatch, Removed, Stored, TokenId

__all__ = ["WireLayout", "encode_batch"]

WireLayout: TypeAlias = Literal["array", "map"]


# --- SGLang <= 0.5.19 array layout --------------------------------------------------------


class _ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: int
    lora_id: int | None
    medium: str | None


class _StoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class _ArrayStoredWithMetadata(_ArrayStored, tag="BlockStored", kw_only=True):
    metadata: _StoredMetadata


class _ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


# --- SGLang >= 0.5.20 map layout ----------------------------------------------------------


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _MapRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False
):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Struct]
    dp_rank: int | None


_ENCODER = msgspec.msgpack.Encoder()


def _adapter_id(event: Stored) -> int | None:
    """The array layout's `lora_id`: it has no slot for a name, so an adapter is its number
    there, as SGLang up to 0.5.17 sent its own (a stable one per name here, never 0)."""
    if event.lora_id is not None or not event.lora_name:
        return event.lora_id
    return zlib.crc32(event.lora_name.encode("utf-8")) or 1


def _array_event(event: Event) -> msgspec.Struct:
    if isinstance(event, Stored):
        if event.cache_salt:
            return _ArrayStoredWithMetadata(
                event.block_hashes,
                event.parent,
                event.token_ids,
                event.block_size,
                _adapter_id(event),
                event.medium,
                metadata=_StoredMetadata(event.cache_salt),
            )
        return _ArrayStored(
            event.block_hashes,
            event.parent,
            event.token_ids,
            event.block_size,
            _adapter_id(event),
            event.medium,
        )
    if isinstance(event, Removed):
        return _ArrayRemoved(event.block_hashes, event.medium)
    assert isinstance(event, Cleared)
    return _ArrayCleared()


def _map_event(event: Event) -> msgspec.Struct:
    if isinstance(event, Stored):
        return _MapStored(
            event.block_hashes,
            event.parent,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.cache_salt or None,
            event.session_id,
            event.lora_name,
        )
    if isinstance(event, Removed):
        return _MapRemoved(event.block_hashes, event.medium)
    assert isinstance(event, Cleared)
    return _MapCleared()


def encode_batch(batch: EventBatch, layout: WireLayout = "array") -> bytes:
    """Encode a batch exactly as SGLang's publisher does (byte-identical)."""
    if layout == "array":
        events = [_array_event(event) for event in batch.events]
    elif layout == "map":
        events = [_map_event(event) for event in batch.events]
    else:
        raise ValueError(f"unknown wire layout {layout!r}; expected 'array' or 'map'")
    # SGLang's ts is a Python float, always a msgpack float64, even when integral.
    return _ENCODER.encode(_Batch(float(batch.ts), events, batch.dp_rank))
