"""The chunked query walk on long prompts: drops in every chunk, holes, pending, collisions.

The differential test uses short documents; these prompts span all the walk's chunks (64, 128,
256, then 256 again), so a stream can stop matching in any of them and the chunk boundaries are
crossed with streams still alive. Every answer is checked against a per-stream brute force.
"""

from __future__ import annotations

import os
import random

import pytest

from indexer.backend import Backend
from indexer.index import PrefixIndex
from indexer.namespace import Namespace, chain_keys, namespace_seed, request_keys
from indexer.protocol.events import EventBatch, Removed, Stored

NS = Namespace("m", None, "salt")
PAGE = 2
BLOCKS = 800  # 64 + 128 + 256 + 256 + 96: five chunks


def brute_depths(index: PrefixIndex, tokens: list[int]) -> dict[str, int]:
    keys = request_keys(NS, tokens, PAGE)
    ns_id = index._registry.find(NS)
    out = {}
    for name, st in index._streams.items():
        held = {k for k in st.blocks.values() if index._table[k] & 0xFFFFFF == ns_id}
        depth = 0
        while depth < len(keys) and keys[depth] in held:
            depth += 1
        out[name] = depth
    return out


@pytest.mark.parametrize("seed", [1, 2, int(os.environ.get("KVROUTE_TEST_SEED", "3"))])
def test_long_prompts_match_brute_force_across_chunks(seed: int, backend: Backend) -> None:
    print(f"walk seed={seed}")
    rng = random.Random(seed)
    tokens = [rng.randrange(50) for _ in range(BLOCKS * PAGE)]
    index = PrefixIndex(clock=lambda: 0.0, pending_ttl_s=10.0, backend=backend)
    for s in range(12):
        name = f"s{s}"
        index.add_stream(name, model="m", block_size=PAGE)
        # a prefix of a random length, ending in any chunk (or past the prompt's end)
        held = rng.choice(
            [0, 1, 63, 64, 65, 191, 192, 447, 448, 700, BLOCKS, rng.randrange(BLOCKS)]
        )
        hashes = [s * 10_000 + i for i in range(held)]
        if held:
            ev = Stored(
                block_hashes=hashes,  # type: ignore[arg-type]
                parent=None,
                token_ids=tokens[: held * PAGE],  # type: ignore[arg-type]
                block_size=PAGE,
                cache_salt="salt",
            )
            index.apply(name, EventBatch(0.0, [ev]))
        if held > 10 and rng.random() < 0.4:  # a hole: the stream's match stops there
            hole = rng.randrange(held)
            index.apply(name, EventBatch(0.0, [Removed(block_hashes=[hashes[hole]])]))
        if rng.random() < 0.3:
            index.add_pending(name, NS, tokens[: rng.randrange(BLOCKS) * PAGE])
    want = brute_depths(index, tokens)
    got = index.query(NS, tokens)
    assert {name: m.blocks for name, m in got.items()} == want
    # `limit` looks at a prefix without copying it: the same answer as the copied prefix
    for limit in (0, 15, 16, 1023, 1024, 1025, rng.randrange(len(tokens)), len(tokens) + 5):
        cut = index.query(NS, tokens, limit)
        assert cut == index.query(NS, tokens[:limit]), limit
        assert all(m.blocks <= limit // PAGE for m in cut.values())
    # pending extends a real match only where it continues it, block for block
    seed_key = namespace_seed(NS, PAGE)
    keys = chain_keys(seed_key, tokens, PAGE)
    for name, st in index._streams.items():
        depth = want[name]
        while (
            depth < len(keys)
            and (
                index._table.get(keys[depth], 0) >> 48
                | index.pending.bits.get(keys[depth], 0) >> 48
            )
            & st.bit
        ):
            depth += 1
        assert got[name].blocks + got[name].pending_blocks == depth, name
    # a forged PENDING entry of another namespace in the second chunk ends the pending walk
    # there, and leaves every real match alone
    other = Namespace("m", None, "other")
    index.add_pending("s1", other, tokens[:PAGE])
    foreign_mark = index.pending.bits[request_keys(other, tokens, PAGE)[0]]
    saved_mark = index.pending.bits.get(keys[100])
    index.pending.bits[keys[100]] = foreign_mark
    marked = index.query(NS, tokens)
    assert {name: m.blocks for name, m in marked.items()} == want
    assert all(m.blocks >= 100 or m.blocks + m.pending_blocks <= 100 for m in marked.values())
    if saved_mark is None:
        del index.pending.bits[keys[100]]
    else:
        index.pending.bits[keys[100]] = saved_mark
    # a forged entry of another namespace deep in the third chunk ends every match there
    forged_ev = Stored(
        block_hashes=[-1],
        parent=None,
        token_ids=tokens[:PAGE],  # type: ignore[arg-type]
        block_size=PAGE,
        cache_salt="other",
    )
    index.apply("s0", EventBatch(0.0, [forged_ev]))
    forged = index._table[request_keys(other, tokens, PAGE)[0]]
    index._table[keys[300]] = forged
    capped = index.query(NS, tokens)
    assert all(m.blocks <= 300 for m in capped.values())
    assert all(m.blocks + m.pending_blocks <= 300 for m in capped.values())
