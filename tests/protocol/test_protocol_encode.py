"""The SGLang encoder's layout rules, and encode -> decode round trips."""

from __future__ import annotations

import os
import random

import msgspec
import pytest

from indexer.protocol import (
    Cleared,
    Event,
    EventBatch,
    Removed,
    Stored,
    WireLayout,
    decode_batch,
    encode_batch,
)

TS = 1767225600.25


def _stored(salt: str | None = None, **over: object) -> Stored:
    fields: dict[str, object] = {
        "block_hashes": [-3, 2**63 - 1],
        "parent": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "medium": "GPU",
        "cache_salt": salt,
    }
    fields.update(over)
    return msgspec.convert(fields, Stored)


def _wire(batch: EventBatch, layout: WireLayout) -> list[object]:
    decoded: list[object] = msgspec.msgpack.decode(encode_batch(batch, layout))
    return decoded


def test_array_layout_slot_counts() -> None:
    batch = EventBatch(TS, [_stored(), _stored("t"), Removed([1], "GPU"), Cleared()], 0)
    ts, events, dp_rank = _wire(batch, "array")
    assert (ts, dp_rank) == (TS, 0)
    assert events == [
        ["BlockStored", [-3, 2**63 - 1], None, [1, 2, 3, 4], 2, None, "GPU"],
        ["BlockStored", [-3, 2**63 - 1], None, [1, 2, 3, 4], 2, None, "GPU", {"cache_salt": "t"}],
        ["BlockRemoved", [1], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_array_layout_keeps_seven_slots_without_medium_and_for_empty_salt() -> None:
    batch = EventBatch(TS, [_stored("", medium=None)], None)
    assert _wire(batch, "array") == [
        TS,
        [["BlockStored", [-3, 2**63 - 1], None, [1, 2, 3, 4], 2, None, None]],
        None,
    ]


def test_map_layout_omits_what_sglang_omits() -> None:
    full = _stored("t", session_id="s", lora_name="l", lora_id=3, extra_keys=[None], group_idx=0)
    batch = EventBatch(TS, [_stored(), full, Removed([1], None), Cleared()], 1)
    _, events, dp_rank = _wire(batch, "map")
    assert dp_rank == 1
    assert isinstance(events, list)
    core = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
    assert list(events[0]) == [*core, "medium"]
    assert list(events[1]) == [*core, "medium", "cache_salt", "session_id", "lora_name"]
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [1]}
    assert events[3] == {"type": "AllBlocksCleared"}


def test_ts_is_always_float64() -> None:
    payload = encode_batch(EventBatch(1767225600, [], 0))
    assert payload[1] == 0xCB
    assert decode_batch(payload).ts == 1767225600.0


def test_bigram_pairs_and_byte_hashes_encode() -> None:
    stored = _stored(block_hashes=[b"\x01" * 32], token_ids=[(1, 2), (2, 3)], block_size=2)
    for layout in ("array", "map"):
        assert decode_batch(encode_batch(EventBatch(TS, [stored], 0), layout)).events == [stored]


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError):
        encode_batch(EventBatch(TS, [], 0), "json")  # type: ignore[arg-type]


def _random_event(rng: random.Random, layout: WireLayout) -> Event:
    kind = rng.random()
    hashes: list[int | bytes] = [rng.randrange(-(2**63), 2**63) for _ in range(rng.randrange(0, 5))]
    if kind < 0.1:
        return Cleared()
    if kind < 0.3:
        return Removed(hashes, rng.choice([None, "GPU", "CPU"]))
    size = rng.randrange(1, 17)
    bigram = rng.random() < 0.2
    tokens: list[int | tuple[int, int]] = [
        (rng.randrange(2**32), rng.randrange(2**32)) if bigram else rng.randrange(2**32)
        for _ in range(len(hashes) * size)
    ]
    is_map = layout == "map"
    return Stored(
        hashes,
        rng.choice([None, rng.randrange(-(2**63), 2**63)]),
        tokens,
        size,
        rng.choice([None, rng.randrange(100)]),
        rng.choice([None, "adapter"]) if is_map else None,
        rng.choice([None, "GPU"]),
        rng.choice([None, "tenant-ü", "t"]),
        None,
        rng.choice([None, "sess"]) if is_map else None,
        None,
    )


@pytest.mark.parametrize("layout", ["array", "map"])
def test_encode_decode_round_trip(layout: WireLayout) -> None:
    seed = int(os.environ.get("KVROUTE_TEST_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    for _ in range(300):
        batch = EventBatch(
            rng.uniform(0, 2e9),
            [_random_event(rng, layout) for _ in range(rng.randrange(0, 6))],
            rng.choice([None, 0, 3]),
        )
        payload = encode_batch(batch, layout)
        assert decode_batch(payload) == batch, f"seed={seed}"
        assert encode_batch(decode_batch(payload), layout) == payload, f"seed={seed}"
