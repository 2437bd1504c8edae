"""Seeded fuzzing of decode_batch: only ProtocolError escapes, and what decodes is consistent.

Set KVROUTE_FUZZ_SEED to replay a failing run; the seed is in every failure message.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import msgspec

from indexer.errors import ProtocolError
from indexer.protocol import EventBatch, Removed, Stored, decode_batch

CASES = 24_000
INTERESTING = [0x00, 0x7F, 0x80, 0x90, 0xC0, 0xC1, 0xC2, 0xC4, 0xCB, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE]
INTERESTING += [0xDF, 0xFF]


def _random_tree(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(12 if depth < 4 else 8)
    leaves: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randrange(-(2**63), 2**64),
        lambda: rng.randrange(-5, 40),
        lambda: rng.choice([rng.random() * 1e10, float("nan"), float("inf"), -0.0]),
        lambda: rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "", "x"]),
        lambda: rng.randbytes(rng.randrange(0, 70)),
        lambda: rng.choice(["type", "block_hashes", "token_ids", "block_size", "cache_salt"]),
    ]
    if choice < len(leaves):
        return leaves[choice]()
    if choice < 10:
        return [_random_tree(rng, depth + 1) for _ in range(rng.randrange(0, 9))]
    return {
        rng.choice(["type", "block_hashes", "token_ids", "block_size", "medium", "k"]): (
            _random_tree(rng, depth + 1)
        )
        for _ in range(rng.randrange(0, 6))
    }


def _swap_subtree(rng: random.Random, tree: Any) -> Any:
    """Replace one random node of a decoded payload with a random value (a type swap)."""
    if not isinstance(tree, list | dict) or not tree or rng.random() < 0.25:
        return _random_tree(rng)
    if isinstance(tree, list):
        copy = list(tree)
        index = rng.randrange(len(copy))
        copy[index] = _swap_subtree(rng, copy[index])
        return copy
    copy_map = dict(tree)
    key = rng.choice(list(copy_map))
    if rng.random() < 0.1:
        del copy_map[key]
    else:
        copy_map[key] = _swap_subtree(rng, copy_map[key])
    return copy_map


def _mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    base = rng.choice(seeds)
    kind = rng.randrange(7)
    if kind == 0:  # bit flips
        data = bytearray(base)
        for _ in range(rng.randrange(1, 9)):
            bit = rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
        return bytes(data)
    if kind == 1:  # truncation
        return base[: rng.randrange(len(base))]
    if kind == 2:  # splice of two real payloads
        other = rng.choice(seeds)
        return base[: rng.randrange(len(base) + 1)] + other[rng.randrange(len(other) + 1) :]
    if kind == 3:  # interesting bytes overwritten or inserted
        data = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            if rng.random() < 0.5:
                data[at] = rng.choice(INTERESTING)
            else:
                data[at:at] = bytes([rng.choice(INTERESTING)]) * rng.randrange(1, 5)
        return bytes(data)
    if kind == 4:  # type swap inside a real payload, re-encoded by msgspec
        tree = msgspec.msgpack.decode(base)
        return msgspec.msgpack.encode(_swap_subtree(rng, tree))
    if kind == 5:  # a random msgspec-encoded tree, usually shaped like a batch
        tree = _random_tree(rng)
        if rng.random() < 0.7:
            tree = [rng.random() * 1e9, [_random_tree(rng, 1) for _ in range(3)], 0]
        return msgspec.msgpack.encode(tree)
    return rng.randbytes(rng.randrange(0, 200))


def _check_consistent(batch: EventBatch) -> None:
    assert isinstance(batch, EventBatch)
    assert type(batch.ts) is float
    assert batch.skipped >= 0
    for event in batch.events:
        if isinstance(event, Stored):
            assert event.block_size > 0
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
        if isinstance(event, Stored | Removed):
            for block_hash in event.block_hashes:
                assert type(block_hash) in (int, bytes)
                if type(block_hash) is int:
                    assert -(2**63) <= block_hash < 2**64


def test_fuzz_only_protocol_error_escapes(golden_payloads: list[tuple[str, bytes]]) -> None:
    seed = int(os.environ.get("KVROUTE_FUZZ_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    seeds = [payload for _, payload in golden_payloads]
    decoded = rejected = 0
    for case in range(CASES):
        payload = _mutate(rng, seeds)
        try:
            batch = decode_batch(payload)
        except ProtocolError as exc:
            assert str(exc), f"seed={seed} case={case}: empty reason"
            # The catch-all translation exists for the contract; on fuzz input only the
            # expected failure kinds may occur, so a hit here is a decoder bug.
            assert "undecodable" not in str(exc), f"seed={seed} case={case}: {exc}"
            rejected += 1
            continue
        except Exception as exc:  # pragma: no cover - the failure this test exists for
            raise AssertionError(
                f"seed={seed} case={case}: {type(exc).__name__} escaped for {payload.hex()}"
            ) from exc
        try:
            _check_consistent(batch)
        except AssertionError as exc:
            raise AssertionError(f"seed={seed} case={case}: {payload.hex()}") from exc
        decoded += 1
    print(f"seed={seed} decoded={decoded} rejected={rejected}")
    # Both outcomes must be well represented, or the mutations are not probing anything.
    assert decoded > CASES // 50, f"seed={seed}: only {decoded} payloads decoded"
    assert rejected > CASES // 2, f"seed={seed}: only {rejected} payloads rejected"
