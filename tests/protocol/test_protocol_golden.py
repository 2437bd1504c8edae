"""Golden captures decode to exactly their `expected`; SGLang ones re-encode byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from indexer.protocol import (
    Cleared,
    Event,
    EventBatch,
    Removed,
    ReplayData,
    ReplayEnd,
    Stored,
    WireLayout,
    decode_batch,
    encode_batch,
    parse_live,
    parse_replay_reply,
)

FIXTURE_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "kv-events"
LIVE = sorted(p.name for p in FIXTURE_DIR.glob("*-live-*.json"))
REPLAY = sorted(p.name for p in FIXTURE_DIR.glob("*-replay*.json"))
SGLANG_LIVE = [name for name in LIVE if name.startswith("sglang-")]
EXPECTED_KEYS = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "cache_salt",
    "lora_name",
    "extra_keys",
    "session_id",
    "group_idx",
}

Load = Callable[[str], dict[str, Any]]


def _unjson(value: Any) -> Any:
    """Fixture JSON to Python values: `{"bytes_hex": ...}` becomes bytes."""
    if isinstance(value, dict):
        if set(value) == {"bytes_hex"}:
            return bytes.fromhex(value["bytes_hex"])
        return {key: _unjson(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unjson(item) for item in value]
    return value


def _as_expected(event: Event) -> dict[str, Any]:
    """Our event in the fixtures' 12-key form (pairs as lists, like JSON)."""
    row: dict[str, Any] = dict.fromkeys(EXPECTED_KEYS)
    if isinstance(event, Stored):
        row.update(
            type="BlockStored",
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent,
            token_ids=[list(t) if isinstance(t, tuple) else t for t in event.token_ids],
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            cache_salt=event.cache_salt,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            session_id=event.session_id,
            group_idx=event.group_idx,
        )
    elif isinstance(event, Removed):
        row.update(
            type="BlockRemoved",
            block_hashes=event.block_hashes,
            medium=event.medium,
            group_idx=event.group_idx,
        )
    else:
        assert isinstance(event, Cleared)
        row["type"] = "AllBlocksCleared"
    return row


def _check_batch(batch: EventBatch, expected: dict[str, Any]) -> None:
    assert batch.ts == expected["ts"]
    assert type(batch.ts) is float
    assert batch.dp_rank == expected["dp_rank"]
    assert batch.skipped == 0
    want = _unjson(expected["events"])
    for row in want:
        assert set(row) == EXPECTED_KEYS
    assert [_as_expected(event) for event in batch.events] == want
    # Pairs are normalized to tuples, hashes keep their wire type.
    for event in batch.events:
        if isinstance(event, Stored):
            assert all(type(t) in (int, tuple) for t in event.token_ids)
        if isinstance(event, Stored | Removed):
            assert all(type(h) in (int, bytes) for h in event.block_hashes)


@pytest.mark.parametrize("name", LIVE)
def test_live_capture_decodes_to_expected(name: str, load_fixture: Load) -> None:
    data = load_fixture(name)
    message = parse_live([bytes.fromhex(frame) for frame in data["frames"]])
    expected = data["expected"]
    assert message.topic == expected["topic"].encode()
    assert message.seq == expected["seq"]
    _check_batch(decode_batch(message.payload), expected)


@pytest.mark.parametrize("name", REPLAY)
def test_replay_capture_decodes_to_expected(name: str, load_fixture: Load) -> None:
    data = load_fixture(name)
    expected = data["expected"]
    replies = [parse_replay_reply([bytes.fromhex(f) for f in r]) for r in data["replies"]]
    assert isinstance(replies[-1], ReplayEnd)
    batches = replies[:-1]
    assert all(isinstance(reply, ReplayData) for reply in batches)
    assert [reply.seq for reply in batches if isinstance(reply, ReplayData)] == expected["seqs"]
    assert len(batches) == len(expected["batches"])
    for reply, want in zip(batches, expected["batches"], strict=True):
        assert isinstance(reply, ReplayData)
        assert reply.seq == want["seq"]
        if reply.topic is not None:
            assert reply.topic == want["topic"].encode()
        _check_batch(decode_batch(reply.payload), want)


def test_scenario_decodes_to_expected(load_fixture: Load) -> None:
    data = load_fixture("scenario-radix-salted.json")
    published = [op for op in data["operations"] if op["published"]]
    assert len(published) >= 10
    for op in published:
        message = parse_live([bytes.fromhex(frame) for frame in op["frames"]])
        assert message.seq == op["expected"]["seq"], op["step"]
        _check_batch(decode_batch(message.payload), op["expected"])


def _layout(payload: bytes) -> WireLayout:
    events = msgspec.msgpack.decode(payload)[1]
    return "map" if isinstance(events[0], dict) else "array"


def test_every_sglang_payload_reencodes_byte_identical(
    golden_payloads: list[tuple[str, bytes]],
) -> None:
    checked = {"array": 0, "map": 0}
    for label, payload in golden_payloads:
        if not label.startswith(("sglang-", "scenario-")):
            continue
        layout = _layout(payload)
        assert encode_batch(decode_batch(payload), layout) == payload, label
        checked[layout] += 1
    assert checked["array"] >= 5
    assert checked["map"] >= 15


@pytest.mark.parametrize("name", SGLANG_LIVE)
def test_sglang_live_capture_reencodes_byte_identical(name: str, load_fixture: Load) -> None:
    payload = bytes.fromhex(load_fixture(name)["frames"][2])
    assert encode_batch(decode_batch(payload), _layout(payload)) == payload


def test_salted_array_capture_has_both_slot_counts(load_fixture: Load) -> None:
    # The 0.5.18 capture is the seed's contract: unsalted stays 7 slots, salted gets slot 7.
    payload = bytes.fromhex(load_fixture("sglang-0.5.18-live-salted-array.json")["frames"][2])
    ours = msgspec.msgpack.decode(encode_batch(decode_batch(payload), "array"))
    stored = [event for event in ours[1] if event[0] == "BlockStored"]
    assert [len(event) for event in stored] == [7, 7, 8, 8]
    assert stored[2][7] == {"cache_salt": "tenant-a"}
