"""The host tier of the radix cache: write-through backup, demotion, host eviction, load back,
and what the events say (SGLang 0.5.23's HiCache, `unified_tree_core.py`).

Seeded random operations on a small cache with a host pool; after every step the pools add up,
GPU nodes stay prefix-closed, and a real `PrefixIndex` fed only the published events reports
every cached path at the best tier the cache holds its pages in, and holds as many pages on
the GPU and in all as the cache does (what the router's tier forecast reads).
"""

from __future__ import annotations

import os
import random

import pytest

from indexer.index import PrefixIndex
from indexer.namespace import Namespace as IndexNamespace
from indexer.protocol.events import Event, EventBatch, Removed, Stored
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
    gpu = sum(len(n.key) // PAGE for n in nodes if n.on_gpu)
    host = sum(len(n.key) // PAGE for n in nodes if n.on_host)
    stats = cache.stats()
    assert (stats.tree_pages, stats.host_pages) == (gpu, host)
    assert host <= stats.host_total_pages and gpu + stats.reserved_pages <= stats.total_pages
    # the router's pools: GPU pages, and pages in any tier (`IndexService.held_tokens`)
    assert index.default_medium_entries("w") == gpu
    assert index.entries("w") == sum(len(n.key) // PAGE for n in nodes)
    for node in nodes:
        assert node.parent is not None and (node.on_gpu or node.on_host)
        # GPU nodes are prefix-closed: a host-only node's descendants are all host-only
        if node.on_gpu and node.parent.parent is not None:
            assert node.parent.on_gpu
        # the index, fed the events alone, holds the path at the best tier the cache does
        path = _path(node)
        tokens = [t for n in path for t in n.key]
        want: dict[str, int] = {}
        for n in path:
            tier = MEDIUM if n.on_gpu else HOST_MEDIUM
            want[tier] = want.get(tier, 0) + len(n.key) // PAGE
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


def _kinds(events: list[Event]) -> list[tuple[str, str | None, int]]:
    return [
        (type(e).__name__, e.medium, len(e.block_hashes))
        for e in events
        if isinstance(e, Stored | Removed)
    ]


def test_the_host_tier_publishes_what_hicache_publishes() -> None:
    """Write-through: `Stored` CPU_PINNED while the node stays on the GPU; evicted from the GPU,
    `Removed` GPU alone (the host copy stays); loaded back, `Stored` GPU alone (the host copy is
    kept). Before, a node was in one tier: offload published `Stored` CPU_PINNED then `Removed`
    GPU at eviction, and a load-back `Removed` the host copy."""
    cache = PagedRadixCache(page_size=PAGE, capacity_tokens=2 * PAGE, host_capacity_tokens=4 * PAGE)
    ns = Namespace(cache_salt="t")
    cache.take_events()
    cache.insert(ns, [1, 2, 3, 4])
    assert _kinds(cache.take_events()) == [("Stored", MEDIUM, 2), ("Stored", HOST_MEDIUM, 2)]
    assert cache.stats().host_pages == 2 and cache.stats().tree_pages == 2
    cache.insert(ns, [5, 6, 7, 8])  # [1..4] leaves the GPU for it
    assert _kinds(cache.take_events()) == [
        ("Removed", MEDIUM, 2),
        ("Stored", MEDIUM, 2),
        ("Stored", HOST_MEDIUM, 2),
    ]
    found = cache.match(ns, [1, 2, 3, 4])
    assert (found.length, found.host_length) == (0, 4) and found.host_node is not None
    assert cache.peek(ns, [1, 2, 3, 4]) == 4 and cache.peek_gpu(ns, [1, 2, 3, 4]) == 0
    cache.lock(found.host_node)
    cache.load_back(found.host_node)
    cache.unlock(found.host_node)
    # [5..8] leaves the GPU (its host copy stays), [1..4] comes back, its host copy kept
    assert _kinds(cache.take_events()) == [("Removed", MEDIUM, 2), ("Stored", MEDIUM, 2)]
    assert cache.peek_gpu(ns, [1, 2, 3, 4]) == 4
    assert cache.stats().host_pages == 4 and cache.stats().tree_pages == 2


def test_a_full_host_pool_evicts_its_oldest_host_only_leaf() -> None:
    cache = PagedRadixCache(page_size=PAGE, capacity_tokens=2 * PAGE, host_capacity_tokens=4 * PAGE)
    ns = Namespace()
    cache.take_events()
    for stem in ([1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]):
        cache.insert(ns, stem)
    # [3..]'s backup needs room: [1..], on the host alone, goes (`Removed` CPU_PINNED); [2..]
    # stays on the host, [3..] on both tiers
    events = cache.take_events()
    host_drops = [e for e in events if isinstance(e, Removed) and e.medium == HOST_MEDIUM]
    assert len(host_drops) == 1 and len(host_drops[0].block_hashes) == 2
    assert cache.peek(ns, [1, 1, 1, 1]) == 0 and cache.peek(ns, [2, 2, 2, 2]) == 4
    assert cache.peek_gpu(ns, [3, 3, 3, 3]) == 4 and cache.stats().host_pages == 4


def test_a_node_the_full_host_pool_cannot_back_up_is_dropped_from_the_gpu() -> None:
    """A host pool full of copies the GPU still holds backs up nothing more; such a node is
    dropped when the GPU evicts it (`Removed` GPU, nothing left), as HiCache does."""
    cache = PagedRadixCache(page_size=PAGE, capacity_tokens=4 * PAGE, host_capacity_tokens=2 * PAGE)
    ns = Namespace()
    cache.take_events()
    cache.insert(ns, [1, 1, 1, 1])  # backed up: the host pool is full
    cache.insert(ns, [2, 2, 2, 2])  # not backed up
    assert _kinds(cache.take_events()) == [
        ("Stored", MEDIUM, 2),
        ("Stored", HOST_MEDIUM, 2),
        ("Stored", MEDIUM, 2),
    ]
    cache.match(ns, [1, 1, 1, 1])  # [2..] is the older now
    cache.evict(4)
    assert _kinds(cache.take_events()) == [("Removed", MEDIUM, 2)]
    assert cache.peek(ns, [2, 2, 2, 2]) == 0 and cache.peek_gpu(ns, [1, 1, 1, 1]) == 4
