"""The host tier of the radix cache: offload, host eviction, load back, and what the events say.

Seeded random operations on a small cache with a host pool; after every step the pools add up,
GPU nodes stay prefix-closed, and a real `PrefixIndex` fed only the published events reports
every cached path in exactly the tiers the cache holds its pages in.
"""

from __future__ import annotations

import os
import random

import pytest

from indexer.index import PrefixIndex
from indexer.namespace import Namespace as IndexNamespace
from indexer.protocol.events import EventBatch, Removed, Stored
from workers.cache import HOST_MEDIUM, MEDIUM, Match, Namespace, PagedRadixCache, RadixNode

PAGE = 2
# no extra_key: the events cannot tell extra_keys apart, so their tiers would merge
NAMESPACES = [Namespace(), Namespace(cache_salt="s1"), Namespace(cache_salt="s2")]


def _path(node: RadixNode) -> list[RadixNode]:
    nodes = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    return nodes[::-1]


def _check(cache: PagedRadixCache, index: PrefixIndex) -> None:
    nodes = list(cache._nodes.values())
    gpu = sum(len(n.key) // PAGE for n in nodes if n.tier == MEDIUM)
    host = sum(len(n.key) // PAGE for n in nodes if n.tier == HOST_MEDIUM)
    stats = cache.stats()
    assert (stats.tree_pages, stats.host_pages) == (gpu, host)
    assert host <= stats.host_total_pages and gpu + stats.reserved_pages <= stats.total_pages
    for node in nodes:
        # GPU nodes are prefix-closed: a host node's descendants are all on the host
        assert node.parent is not None
        if node.tier == MEDIUM:
            assert node.parent.tier == MEDIUM
        # the index, fed the events alone, holds the path in the tiers the cache does
        path = _path(node)
        tokens = [t for n in path for t in n.key]
        want: dict[str, int] = {}
        for n in path:
            want[n.tier] = want.get(n.tier, 0) + len(n.key) // PAGE
        salt = node.namespace.cache_salt
        got = index.query(IndexNamespace("", None, salt), tokens)["w"]
        assert got.blocks == len(tokens) // PAGE
        assert got.by_medium == want, (tokens, want, got.by_medium)


@pytest.mark.parametrize("seed", [3, 17, int(os.environ.get("KVROUTE_TEST_SEED", "41"))])
def test_the_host_tier_and_its_events_agree_under_random_operations(seed: int) -> None:
    print(f"seed={seed}")
    rng = random.Random(seed)
    cache = PagedRadixCache(
        page_size=PAGE, capacity_tokens=rng.choice([8, 16]) * PAGE, host_capacity_tokens=12 * PAGE
    )
    index = PrefixIndex()
    index.add_stream("w", block_size=PAGE)
    locked: list[Match] = []

    def tokens() -> list[int]:
        stem = rng.choice([[1, 2, 3, 4], [1, 2, 5, 6], [7, 8], []])
        return stem + [rng.randint(1, 4) for _ in range(rng.randint(0, 9))]

    moved = 0
    for step in range(500):
        ns = rng.choice(NAMESPACES)
        op = rng.random()
        if op < 0.5:
            cache.insert(ns, tokens())
        elif op < 0.7:
            found = cache.match(ns, tokens())
            if found.host_node is not None and rng.random() < 0.7:
                cache.load_back(found.host_node)
        elif op < 0.8:
            found = cache.match(ns, tokens())
            held = found.host_node or found.node
            if len(locked) < 2 and held.parent is not None:
                cache.lock(held)
                locked.append(Match(node=held, length=found.length + found.host_length))
        elif op < 0.9 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))).node)
        else:
            cache.evict(rng.randint(1, 8))
        events = cache.take_events()
        moved += sum(1 for e in events if isinstance(e, Stored) and e.medium == HOST_MEDIUM)
        index.apply("w", EventBatch(ts=float(step), events=events))
        _check(cache, index)
    assert moved > 0, f"seed {seed}: nothing was ever offloaded"


def test_an_evicted_page_moves_to_the_host_and_comes_back_on_a_hit() -> None:
    cache = PagedRadixCache(page_size=PAGE, capacity_tokens=4 * PAGE, host_capacity_tokens=4 * PAGE)
    ns = Namespace(cache_salt="t")
    cache.insert(ns, [1, 2, 3, 4])
    cache.take_events()
    cache.insert(ns, [9, 9, 8, 8, 7, 7])  # needs 3 pages of 4 while [1..4] holds 2
    events = cache.take_events()
    offload = [e for e in events if isinstance(e, Stored) and e.medium == HOST_MEDIUM]
    dropped = [e for e in events if isinstance(e, Removed) and e.medium == MEDIUM]
    assert offload and dropped and offload[0].block_hashes == dropped[0].block_hashes
    found = cache.match(ns, [1, 2, 3, 4])
    assert (found.length, found.host_length) == (0, 4) and found.host_node is not None
    assert cache.peek(ns, [1, 2, 3, 4]) == 4 and cache.peek_gpu(ns, [1, 2, 3, 4]) == 0
    cache.load_back(found.host_node)
    back = cache.take_events()
    tail = [(type(e).__name__, e.medium) for e in back if isinstance(e, Stored | Removed)]
    assert tail[-2:] == [("Stored", MEDIUM), ("Removed", HOST_MEDIUM)]
    assert cache.peek_gpu(ns, [1, 2, 3, 4]) == 4


def test_a_full_host_pool_evicts_its_oldest_leaf() -> None:
    cache = PagedRadixCache(page_size=PAGE, capacity_tokens=2 * PAGE, host_capacity_tokens=2 * PAGE)
    ns = Namespace()
    for stem in ([1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]):
        cache.insert(ns, stem)
    events = cache.take_events()
    host_drops = [e for e in events if isinstance(e, Removed) and e.medium == HOST_MEDIUM]
    assert len(host_drops) == 1  # [1..] went to the host, then made room for [2..]
    assert cache.peek(ns, [1, 1, 1, 1]) == 0 and cache.peek(ns, [2, 2, 2, 2]) == 4
    assert cache.stats().host_pages == 2
