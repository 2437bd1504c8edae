"""Each class of bad input the protocol issue names: one ProtocolError, skip-and-count, or a
known event that does not decode standing in its batch as `Unreadable` (its blocks forgotten)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from indexer.errors import ProtocolError
from indexer.protocol import Cleared, Removed, Stored, Unreadable, decode_batch
from indexer.protocol.wire import MAX_HASH_BYTES, MAX_HASHES_PER_EVENT

TS = 1767225600.25


def _enc(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def _arr_stored(**over: Any) -> list[Any]:
    slots: dict[str, Any] = {
        "tag": "BlockStored",
        "block_hashes": [-5, 7],
        "parent": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
    }
    slots.update(over)
    return list(slots.values())


def _map_stored(**over: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [-5, 7],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
    }
    event.update(over)
    return event


def _batch(*events: Any, ts: Any = TS, dp_rank: Any = 0) -> bytes:
    return _enc([ts, list(events), dp_rank])


def _rejects(payload: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_batch(payload)
    reason = str(info.value)
    assert reason
    return reason


def _stands_in(payload: bytes) -> Unreadable:
    """The one `Unreadable` a batch decodes to, its other events kept."""
    unread = [e for e in decode_batch(payload).events if isinstance(e, Unreadable)]
    assert len(unread) == 1 and unread[0].reason
    return unread[0]


# --- the shapes that must be accepted -------------------------------------------------------


def test_valid_array_and_map_events_mix_in_one_batch() -> None:
    batch = decode_batch(
        _batch(
            _arr_stored(),
            _map_stored(cache_salt="t"),
            ["BlockRemoved", [7], "GPU"],
            {"type": "AllBlocksCleared"},
        )
    )
    assert [type(e) for e in batch.events] == [Stored, Stored, Removed, Cleared]
    assert isinstance(batch.events[1], Stored)
    assert batch.events[1].cache_salt == "t"
    assert batch.skipped == 0


def test_hash_widths_are_kept() -> None:
    hashes = [-(2**63), 2**63 - 1, 2**64 - 1, 0, b"\x01" * 32]
    batch = decode_batch(_batch(["BlockRemoved", hashes, None]))
    assert isinstance(batch.events[0], Removed)
    assert batch.events[0].block_hashes == hashes


def test_a_store_with_a_key_it_does_not_have_is_unreadable_not_unsalted() -> None:
    """A salted store's `cache_salt` key misspelled or damaged, or a key neither engine writes
    (a namespace component of a later engine, perhaps), in a map or in slot 7's metadata: the
    event is `Unreadable`, its blocks forgotten. Before, unknown keys were ignored, so such a
    store read as unsalted (SGLang leaves the key out of an unsalted map) and its pages were
    predicted to unsalted requests (QA: another tenant's 8 tokens, nothing counted)."""
    batch = decode_batch(
        _batch(
            _map_stored(future_field={"x": [1]}, cache_salt="s"),
            _map_stored(cache_slat="s"),
            _arr_stored(metadata={"cache_salt": "a", "other": 1}),
            _arr_stored(metadata={"cache_slat": "a"}),
            _arr_stored(metadata={}),
            _map_stored(cache_salt="kept", locality="LOCAL", ownership="x"),  # vLLM's keys
        )
    )
    assert [type(e) for e in batch.events] == [Unreadable] * 5 + [Stored]
    kept = batch.events[-1]
    assert isinstance(kept, Stored) and kept.cache_salt == "kept"


def test_empty_salt_means_unsalted() -> None:
    batch = decode_batch(_batch(_map_stored(cache_salt=""), _arr_stored(m={"cache_salt": ""})))
    assert [e.cache_salt for e in batch.events if isinstance(e, Stored)] == [None, None]


# --- unknown tags: skipped and counted -------------------------------------------------------


def test_unknown_tags_are_skipped_and_counted() -> None:
    batch = decode_batch(
        _batch(
            ["BlockPromoted", [1], "CPU"],
            _arr_stored(),
            {"type": "SomethingNew", "x": 1},
            {"type": "BlockRemoved", "block_hashes": [1]},
        )
    )
    assert batch.skipped == 2
    assert [type(e) for e in batch.events] == [Stored, Removed]


def test_batch_of_only_unknown_tags_is_empty_not_an_error() -> None:
    batch = decode_batch(_batch(["Future"], {"type": "Future"}))
    assert batch.events == []
    assert batch.skipped == 2


def test_known_tag_with_bad_body_is_forgotten_not_skipped() -> None:
    batch = decode_batch(_batch(["Future"], _arr_stored(block_size="4"), ["BlockRemoved", [9]]))
    assert batch.skipped == 1
    unread, removed = batch.events
    assert isinstance(unread, Unreadable) and isinstance(removed, Removed)
    assert (unread.kind, unread.block_hashes) == ("BlockStored", [-5, 7])
    assert "event 1" in unread.reason


@pytest.mark.parametrize(
    "event",
    [
        ["BlockRemoved", [7, 8], 5],
        ["BlockRemoved", [7, 8], "GPU", "group"],
        {"type": "BlockRemoved", "block_hashes": [7, 8], "medium": ["GPU"]},
    ],
)
def test_a_removal_that_does_not_decode_still_names_its_blocks(event: Any) -> None:
    unread = _stands_in(_batch(_arr_stored(), event))
    assert (unread.kind, unread.block_hashes) == ("BlockRemoved", [7, 8])


@pytest.mark.parametrize(
    "event",
    [
        ["BlockRemoved", ["x"], "GPU"],
        ["BlockRemoved", 7],
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        {"type": "BlockRemoved"},
        _arr_stored(block_hashes=[b"\x00" * (MAX_HASH_BYTES + 1)]),
    ],
)
def test_an_event_whose_hashes_do_not_read_fails_its_whole_batch(event: Any) -> None:
    """It could be a removal of anything: keeping the rest would keep blocks it took away."""
    assert "event 1" in _rejects(_batch(_arr_stored(), event))


def test_the_group_and_kind_of_an_unreadable_store_are_read_when_they_can_be() -> None:
    swa = _arr_stored(
        block_size="x", lora_name=None, extra_keys=None, group_idx=1, kind="sliding_window"
    )
    unread = _stands_in(_batch(swa))
    assert (unread.group_idx, unread.kv_cache_spec_kind) == (1, "sliding_window")
    bad = _map_stored(block_size=0, group_idx="one", kv_cache_spec_kind=7)
    unread = _stands_in(_batch(bad))
    assert (unread.group_idx, unread.kv_cache_spec_kind) == (None, None)  # nothing said


def test_a_group_that_is_not_indexed_may_leave_blocks_out_of_its_hashes() -> None:
    """vLLM 0.33 leaves a sliding-window or Mamba group's null and masked blocks out of
    block_hashes while token_ids span the whole range: the count rule is not theirs."""
    swa = _map_stored(
        block_hashes=[7], token_ids=[1, 2, 3, 4, 5, 6, 7, 8], kv_cache_spec_kind="mamba"
    )
    (event,) = decode_batch(_batch(swa)).events
    assert isinstance(event, Stored) and event.kv_cache_spec_kind == "mamba"
    full = {**swa, "kv_cache_spec_kind": "full_attention"}
    assert "token_ids" in _stands_in(_batch(full)).reason


# --- wrong types ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        _arr_stored(block_hashes=["abc"]),
        _arr_stored(block_hashes=[1.5]),
        _arr_stored(block_hashes=[True, False]),
        _arr_stored(block_hashes=7),
        _map_stored(block_hashes=None),
        {"block_hashes": [1]},
        {"type": 5},
        [5, [1]],
        [],
        5,
        "BlockStored",
        None,
    ],
)
def test_wrong_types_are_rejected(event: Any) -> None:
    _rejects(_batch(event))


@pytest.mark.parametrize(
    "event",
    [
        _arr_stored(parent="x"),
        _arr_stored(token_ids=["a", "b", "c", "d"]),
        _arr_stored(token_ids=[[1, 2, 3], [1, 2, 3], 3, 4]),
        _arr_stored(block_size="2"),
        _arr_stored(lora_id="x"),
        _arr_stored(medium=5),
        _map_stored(cache_salt=5),
        _map_stored(session_id=[1]),
        _map_stored(extra_keys="x"),
    ],
)
def test_wrong_types_beside_readable_hashes_stand_in_as_unreadable(event: Any) -> None:
    assert _stands_in(_batch(event)).block_hashes == [-5, 7]


# --- block sizes and counts -----------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -4, 2**20])
def test_bad_block_sizes(block_size: int) -> None:
    _stands_in(_batch(_arr_stored(block_size=block_size)))
    _stands_in(_batch(_map_stored(block_size=block_size)))


@pytest.mark.parametrize("tokens", [[1, 2, 3], [1, 2, 3, 4, 5], []])
def test_token_hash_count_mismatch(tokens: list[int]) -> None:
    assert "token_ids" in _stands_in(_batch(_arr_stored(token_ids=tokens))).reason
    assert "token_ids" in _stands_in(_batch(_map_stored(token_ids=tokens))).reason


# --- hashes ------------------------------------------------------------------------------------


def test_oversized_and_empty_byte_hashes() -> None:
    decode_batch(_batch(_arr_stored(block_hashes=[b"\x00" * MAX_HASH_BYTES, b"\x01"])))
    _rejects(_batch(_arr_stored(block_hashes=[b"\x00" * (MAX_HASH_BYTES + 1), 1])))
    _rejects(_batch(_arr_stored(block_hashes=[b"", 1])))
    _stands_in(_batch(_arr_stored(parent=b"\x00" * (MAX_HASH_BYTES + 1))))  # hashes read


# --- huge lists ------------------------------------------------------------------------------


def test_too_many_hashes_in_one_event() -> None:
    hashes = [1] * (MAX_HASHES_PER_EVENT + 1)
    _rejects(_batch(["BlockRemoved", hashes, "GPU"]))
    _rejects(_batch({"type": "BlockRemoved", "block_hashes": hashes}))


def test_lying_length_headers_do_not_allocate() -> None:
    # array32 claiming 2**32 - 1 elements, with almost nothing behind it.
    head = b"\x93" + _enc(TS)
    _rejects(head + b"\xdd\xff\xff\xff\xff\x00")
    _rejects(head + b"\x91\x93\xacBlockRemoved\xdd\xff\xff\xff\xff")
    _rejects(b"\xdd\xff\xff\xff\xff")
    _rejects(b"\xdf\xff\xff\xff\xff")


# --- payload-level problems -----------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93",
        _batch(_arr_stored())[:-3],
        _enc({"ts": TS, "events": []}),
        _enc(5),
        _enc("payload"),
        _enc(None),
        _enc([]),
        _enc([TS]),
        _enc([TS, {"a": 1}, 0]),
        _enc([TS, None, 0]),
        _batch(ts="now"),
        _batch(ts=None),
        _batch(ts=float("nan")),
        _batch(ts=float("inf")),
        _batch(ts=float("-inf")),
        _batch(ts=-1.0),
        _batch(ts=True),
        _batch(dp_rank=-1),
        _batch(dp_rank="0"),
        bytes(range(256)),
        _batch() + b"trailing",
    ],
)
def test_bad_payloads(payload: bytes) -> None:
    _rejects(payload)


def test_integral_ts_is_accepted_as_float() -> None:
    batch = decode_batch(_batch(ts=1767225600))
    assert batch.ts == 1767225600.0
    assert type(batch.ts) is float
    assert decode_batch(_batch(dp_rank=None)).dp_rank is None


def test_deep_nesting_is_a_protocol_error() -> None:
    deep = b"\x91" * 200_000 + b"\x01"
    head = b"\x93" + _enc(TS)
    _rejects(deep)
    assert "deeply" in _rejects(head + b"\x91" + deep + b"\x00")
    # Inside vLLM's `extra_keys`, whose entries are arbitrary values.
    event = _enc(_arr_stored(lora_name=None, extra_keys=[["PLACEHOLDER"]]))
    event = event.replace(_enc("PLACEHOLDER"), deep)
    assert "deeply" in _rejects(head + b"\x91" + event + b"\x00")


def test_reasons_name_the_offending_event() -> None:
    assert "event 1" in _stands_in(_batch(_arr_stored(), _arr_stored(token_ids=[1]))).reason
    bad = _batch(_map_stored(), _map_stored(), _map_stored(block_size=0))
    assert "event 2" in _stands_in(bad).reason
    assert "event 1" in _rejects(_batch(_map_stored(), _map_stored(block_hashes=[None])))
