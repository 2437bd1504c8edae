"""vLLM's lookahead hashing: a block's hash covers tokens after it, so its last block is not
the request's to reuse unless what follows matches too.

vLLM 0.33 (`vllm/v1/core/kv_cache_utils.py`, on by default beside an EAGLE-style drafter)
folds the next L tokens into each block's hash and publishes them (`BlockStored.
lookahead_token_ids`). The index keys blocks by their own tokens, so a prompt that matches the
blocks but diverges right after them was predicted the last one, which vLLM does not reuse.
"""

from __future__ import annotations

import msgspec

from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol.decode import decode_batch
from indexer.protocol.events import Stored, TokenId

BS = 4
NS = Namespace("m", None, None)


def _frame(lookahead: list[list[int]] | None, layout: str) -> bytes:
    tokens = list(range(100, 108))
    if layout == "map":
        event: object = {
            "type": "BlockStored", "block_hashes": [b"\x01" * 32, b"\x02" * 32],
            "parent_block_hash": None, "token_ids": tokens, "block_size": BS,
            "lookahead_token_ids": lookahead,
        }  # fmt: skip
    else:  # vLLM 0.33's array: ... sliding window, locality, ownership, session, lookahead
        event = ["BlockStored", [b"\x01" * 32, b"\x02" * 32], None, tokens, BS, None, "GPU",
                 None, None, 0, "full_attention", None, None, None, None, lookahead]  # fmt: skip
    return msgspec.msgpack.encode([1.0, [event], None])


def _index(frame: bytes) -> PrefixIndex:
    index = PrefixIndex()
    index.add_stream("v", model="m", engine="vllm", block_size=BS)
    index.apply("v", decode_batch(frame), 0)
    return index


def _blocks(index: PrefixIndex, tokens: list[TokenId]) -> int:
    return index.match(NS, tokens).blocks.get("v", 0)


def test_the_last_matched_block_of_a_lookahead_stream_is_not_predicted() -> None:
    for layout in ("map", "array"):
        index = _index(_frame([[104], [108]], layout))
        stored = [e for e in decode_batch(_frame([[104], [108]], layout)).events]
        assert isinstance(stored[0], Stored) and stored[0].lookahead == 1
        # the stored prompt went on with 108; this one diverges there: block 2 is not reused
        assert _blocks(index, [*range(100, 108), 999, 5]) == 1, layout
        assert _blocks(index, [*range(100, 104), 999]) == 0, layout
        # without lookahead hashing, both blocks as before
        plain = _index(_frame(None, layout))
        assert _blocks(plain, [*range(100, 108), 999, 5]) == 2, layout


def test_a_loaded_snapshot_keeps_the_streams_lookahead() -> None:
    from indexer.snapshot import dump_index, load_index

    loaded = load_index(dump_index(_index(_frame([[104], [108]], "map"))))
    assert _blocks(loaded, [*range(100, 108), 999, 5]) == 1
