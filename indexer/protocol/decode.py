"""Payload decoder: every SGLang and vLLM KV-event layout into `EventBatch`.

A payload is `[ts, events, dp_rank]`. Real streams are homogeneous, so the whole batch is
first decoded in one msgspec call as all-array events, then as all-map events; msgspec does
the per-element work (hashes, tokens, limits) in C. Only when both fail (a batch that mixes
layouts, carries an unknown event tag, or is malformed) do we fall back to decoding event by
event, which skips and counts unknown tags and names the event that is malformed.

Event by event, an event of a known kind that does not decode costs its batch only when
dropping it could leave a stale page predicted. The rule: an undecodable event is replaced by
the most it could have taken away. A `BlockStored` or `BlockRemoved` whose tag and hashes
still read becomes an `Unreadable` that makes the index forget those blocks (a removal drops
them; a store may replace what a hash names) or, for a KV-cache group whose blocks are not
indexed, skip them (an `AllBlocksCleared` is only its tag: it always decodes). An event whose
tag or hashes do not read could be a removal of anything: the whole batch fails (the
subscriber refetches it, or clears the stream). So the other events of a batch survive a bad
one, and the stream never holds a block the worker may have let go.

Every failure surfaces as `ProtocolError`: msgspec errors, RecursionError from hostile
nesting, and anything else a parser could raise are translated here, in one place.
"""

from __future__ import annotations

import math

import msgspec

from indexer.errors import ProtocolError
from indexer.protocol.encode import WireLayout
from indexer.protocol.events import Event, EventBatch, Unreadable
from indexer.protocol.wire import (
    KNOWN_TAGS,
    ArrayBatch,
    ArrayEvent,
    ArrayHashes,
    ArrayTag,
    MapBatch,
    MapEvent,
    MapHashes,
    MapTag,
    RawBatch,
)

__all__ = ["batch_dp_rank", "batch_layout", "decode_batch"]

# Built once: msgspec decoders cache their type plans.
_ARRAY_BATCH = msgspec.msgpack.Decoder(ArrayBatch)
_MAP_BATCH = msgspec.msgpack.Decoder(MapBatch)
_RAW_BATCH = msgspec.msgpack.Decoder(RawBatch)
_ARRAY_EVENT: msgspec.msgpack.Decoder[ArrayEvent] = msgspec.msgpack.Decoder(ArrayEvent)
_MAP_EVENT: msgspec.msgpack.Decoder[MapEvent] = msgspec.msgpack.Decoder(MapEvent)
_ARRAY_TAG = msgspec.msgpack.Decoder(ArrayTag)
_MAP_TAG = msgspec.msgpack.Decoder(MapTag)
_ARRAY_HASHES = msgspec.msgpack.Decoder(ArrayHashes)
_MAP_HASHES = msgspec.msgpack.Decoder(MapHashes)

# First byte of a msgpack value: fixarray, array16, array32 / fixmap, map16, map32.
_ARRAY_HEADS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload; raises ProtocolError (and nothing else) on bad input."""
    try:
        return _decode(payload)
    except ProtocolError:
        raise
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"malformed KV-event payload: {exc}") from exc
    except RecursionError as exc:
        raise ProtocolError("KV-event payload nests too deeply") from exc
    except Exception as exc:
        # The contract is that only ProtocolError escapes (a subscriber counts and skips it);
        # the exception type stays in the reason so a decoder bug is still visible in logs.
        raise ProtocolError(f"undecodable KV-event payload ({type(exc).__name__}: {exc})") from exc


def batch_layout(payload: bytes) -> tuple[WireLayout, int | None] | None:
    """The layout of a batch's events (its first event's: real streams are homogeneous) and
    its dp_rank, so a batch made to follow it (`encode_batch`) reads alike; None when it has
    no event or is no batch. Never raises."""
    try:
        raw = _RAW_BATCH.decode(payload)
    except (msgspec.MsgspecError, RecursionError):
        return None
    head = memoryview(raw.events[0])[0] if raw.events and len(raw.events[0]) else -1
    if head in _ARRAY_HEADS:
        return "array", raw.dp_rank
    if head in _MAP_HEADS:
        return "map", raw.dp_rank
    return None


def batch_dp_rank(payload: bytes) -> int | None:
    """The dp rank a batch says it is from (None: it says none, or it is no batch), read
    without decoding its events, so a replayed batch of another rank can be refused before it
    is applied. Never raises."""
    try:
        return _RAW_BATCH.decode(payload).dp_rank
    except (msgspec.MsgspecError, RecursionError):
        return None


def _decode(payload: bytes) -> EventBatch:
    wire: ArrayBatch | MapBatch
    try:
        wire = _ARRAY_BATCH.decode(payload)
    except msgspec.ValidationError:
        try:
            wire = _MAP_BATCH.decode(payload)
        except msgspec.ValidationError:
            return _decode_mixed(payload)
    _check_ts(wire.ts)
    try:
        events = [event.normalize() for event in wire.events]
    except ProtocolError:
        # Rare (a bad token count); redo it event by event to name the offending event.
        return _decode_mixed(payload)
    return EventBatch(wire.ts, events, wire.dp_rank)


def _check_ts(ts: float) -> None:
    if not math.isfinite(ts):
        raise ProtocolError(f"batch ts is not a finite number: {ts!r}")


def _decode_mixed(payload: bytes) -> EventBatch:
    # Raises the batch-level error (not an array, bad ts, bad dp_rank) with its msgspec path.
    raw = _RAW_BATCH.decode(payload)
    _check_ts(raw.ts)
    events: list[Event] = []
    skipped = 0
    for index, item in enumerate(raw.events):
        event = _decode_event(index, item)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return EventBatch(raw.ts, events, raw.dp_rank, skipped)


def _decode_event(index: int, item: msgspec.Raw) -> Event | None:
    """One event of a batch; None for a well-formed event of an unknown kind."""
    view = memoryview(item)
    head = view[0] if len(view) else -1
    try:
        if head in _ARRAY_HEADS:
            try:
                return _ARRAY_EVENT.decode(item).normalize()
            except msgspec.ValidationError:
                if _ARRAY_TAG.decode(item).tag not in KNOWN_TAGS:
                    return None
                raise
        if head in _MAP_HEADS:
            try:
                return _MAP_EVENT.decode(item).normalize()
            except msgspec.ValidationError:
                if _MAP_TAG.decode(item).type not in KNOWN_TAGS:
                    return None
                raise
    except (msgspec.ValidationError, ProtocolError) as exc:
        reason = f"event {index}: {exc}"
        standin = _in_place_of(item, head, reason)
        if standin is None:
            raise ProtocolError(reason) from exc
        return standin
    raise ProtocolError(f"event {index} is neither an array nor a map")


def _in_place_of(item: msgspec.Raw, head: int, reason: str) -> Event | None:
    """What stands in for a known event that does not decode (the module docstring's rule);
    None when nothing safe can: its batch must fail."""
    found: ArrayHashes | MapHashes
    try:
        if head in _ARRAY_HEADS:
            found = _ARRAY_HASHES.decode(item)
            tag = found.tag
            # a BlockRemoved array is [tag, hashes, medium, group_idx]
            group = found.slot3 if tag == "BlockRemoved" else found.group_idx
        else:
            found = _MAP_HASHES.decode(item)
            tag = found.type
            group = found.group_idx
    except msgspec.ValidationError:
        return None
    if tag not in ("BlockStored", "BlockRemoved"):  # AllBlocksCleared is a tag: it decodes
        return None
    kind = _lenient_str(found.kv_cache_spec_kind) if tag == "BlockStored" else None
    group_idx = _lenient_int(group)
    return Unreadable(
        tag,
        list(found.block_hashes),
        group_idx if group_idx is not None and group_idx >= 0 else None,
        kind,
        reason,
    )


_INT = msgspec.msgpack.Decoder(int | None)
_STR = msgspec.msgpack.Decoder(str | None)


def _lenient_int(raw: msgspec.Raw) -> int | None:
    """`raw` as an int, or None (absent, or not an int: then it says nothing)."""
    try:
        return _INT.decode(raw) if raw else None
    except msgspec.ValidationError:
        return None


def _lenient_str(raw: msgspec.Raw) -> str | None:
    """`raw` as a str, or None (absent, or not a str: then it says nothing)."""
    try:
        return _STR.decode(raw) if raw else None
    except msgspec.ValidationError:
        return None
