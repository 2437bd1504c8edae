"""The paged radix cache: SGLang's scenario event for event, and the seed's unit tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from indexer.index import PrefixIndex
from indexer.namespace import Namespace as IndexNamespace
from indexer.protocol.events import Cleared, Event, EventBatch, Removed, Stored
from workers.cache import Namespace, PagedRadixCache, RadixNode, event_digests
from workers.errors import CacheBusyError
from workers.hashing import digest_to_hash, page_digests, salt_seed

T1 = Namespace(cache_salt="tenant-1")
T2 = Namespace(cache_salt="tenant-2")
PLAIN = Namespace()


def _as_expected(event: Event) -> dict[str, Any]:
    """Our normalized event in the fixtures' `expected` shape (the keys SGLang fills)."""
    base: dict[str, Any] = {
        "block_hashes": None,
        "parent_block_hash": None,
        "token_ids": None,
        "block_size": None,
        "lora_id": None,
        "medium": None,
        "cache_salt": None,
    }
    if isinstance(event, Stored):
        return base | {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "cache_salt": event.cache_salt,
        }
    if isinstance(event, Removed):
        return base | {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
        }
    assert isinstance(event, Cleared)
    return base | {"type": "AllBlocksCleared"}


def _fixture_events(step: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
    keys += ["medium", "cache_salt"]
    return [{k: e[k] for k in keys} for e in step["expected"]["events"]]


def run_scenario(cache: PagedRadixCache, tokens: dict[str, list[int]]) -> list[list[Event]]:
    """Drive the cache through the fixture's operations; one event list per step."""
    a, b, c = tokens["A"], tokens["B"], tokens["C"]
    steps: list[list[Event]] = [cache.take_events()]
    ops: list[Callable[[], object]] = [
        lambda: cache.insert(T1, a),
        lambda: cache.insert(T1, a + b),
        lambda: cache.insert(T2, a),
        lambda: cache.insert(T1, a[:8]),
        lambda: cache.evict(8),
        lambda: cache.evict(4),
        lambda: cache.evict(4),
        cache.flush,
        lambda: cache.insert(T1, a),
        lambda: cache.insert(PLAIN, c),
    ]
    for op in ops:
        op()
        steps.append(cache.take_events())
    return steps


def test_reproduces_sglang_radix_scenario(scenario: Any) -> None:
    cache = PagedRadixCache(page_size=scenario["page_size"], capacity_tokens=1024)
    steps = run_scenario(cache, scenario["tokens"])
    assert len(steps) == len(scenario["operations"])
    for ours, step in zip(steps, scenario["operations"], strict=True):
        assert [_as_expected(e) for e in ours] == _fixture_events(step), step["op"]
        assert bool(ours) == step["published"], step["op"]


def test_keys_are_rounded_down_to_whole_pages() -> None:
    cache = PagedRadixCache(page_size=4, capacity_tokens=64)
    cache.take_events()
    found, _ = cache.insert(PLAIN, list(range(10, 17)))
    assert found.length == 4
    assert cache.peek(PLAIN, list(range(10, 30))) == 4
    assert cache.peek(PLAIN, [10, 11, 12]) == 0
    assert cache.stats().tree_pages == 1


def test_slicing_keeps_the_salt() -> None:
    cache = PagedRadixCache(page_size=2, capacity_tokens=64)
    cache.insert(T1, [1, 2, 3, 4, 5, 6])
    found = cache.match(T1, [1, 2, 9, 9])
    assert found.length == 2
    assert found.node.namespace == T1
    assert found.node.parent is not None
    child = next(iter(found.node.children.values()))
    assert child.namespace == T1
    assert cache.peek(T1, [1, 2, 3, 4, 5, 6]) == 6
    assert cache.peek(PLAIN, [1, 2, 3, 4, 5, 6]) == 0


def test_isolation_is_independent_of_extra_key() -> None:
    cache = PagedRadixCache(page_size=1, capacity_tokens=64)
    concatenated = Namespace(extra_key="a:b")
    split = Namespace(extra_key="a", cache_salt="b")
    cache.insert(concatenated, [1, 2, 3])
    assert cache.peek(split, [1, 2, 3]) == 0
    assert cache.peek(Namespace(extra_key="a"), [1, 2, 3]) == 0
    assert cache.peek(Namespace(cache_salt="a:b"), [1, 2, 3]) == 0
    cache.insert(split, [1, 2, 3])
    assert cache.peek(split, [1, 2, 3]) == 3
    assert cache.peek(Namespace(extra_key="ab", cache_salt="c"), [1, 2, 3]) == 0
    assert cache.stats().nodes == 2


def test_store_and_remove_events_carry_the_salt_and_same_hashes() -> None:
    cache = PagedRadixCache(page_size=2, capacity_tokens=64)
    cache.take_events()
    cache.insert(T1, [1, 2, 3, 4])
    (stored,) = cache.take_events()
    assert isinstance(stored, Stored)
    assert stored.cache_salt == "tenant-1"
    assert stored.medium == "GPU"
    expected = page_digests([1, 2, 3, 4], 2, salt_seed("tenant-1"))
    assert stored.block_hashes == [digest_to_hash(d) for d in expected]
    cache.evict(100)
    (removed,) = cache.take_events()
    assert isinstance(removed, Removed)
    assert removed.block_hashes == stored.block_hashes


def test_unsalted_events_carry_no_salt() -> None:
    cache = PagedRadixCache(page_size=2, capacity_tokens=64)
    cache.take_events()
    cache.insert(Namespace(extra_key="x"), [1, 2])
    (stored,) = cache.take_events()
    assert isinstance(stored, Stored)
    assert stored.cache_salt is None
    assert stored.block_hashes == [digest_to_hash(page_digests([1, 2], 2, None)[0])]


def test_salted_hashes_survive_a_node_split() -> None:
    tokens = list(range(100, 112))
    cache = PagedRadixCache(page_size=4, capacity_tokens=64)
    cache.take_events()
    cache.insert(T1, tokens)
    (whole,) = cache.take_events()
    assert isinstance(whole, Stored)
    cache.insert(T1, tokens[:4])  # splits the node after its first page
    assert cache.take_events() == []
    cache.insert(T1, [*tokens, 7, 7, 7, 7])
    (child,) = cache.take_events()
    assert isinstance(child, Stored)
    assert child.parent == whole.block_hashes[-1]
    cache.evict(4)  # the new leaf
    (leaf,) = cache.take_events()
    cache.evict(4)  # the tail of the split node: exactly its two hashes
    (tail,) = cache.take_events()
    assert isinstance(leaf, Removed) and isinstance(tail, Removed)
    assert (leaf.block_hashes, tail.block_hashes) == (child.block_hashes, whole.block_hashes[1:])


def test_events_are_merged_as_sglang_merges_them() -> None:
    """SGLang's `KVCacheEventRecorder.enqueue`: a `Removed` after a `Removed` of the same
    medium joins it, a `Stored` whose parent is the last hash of the `Stored` before it extends
    it. Before, one step evicting two leaves published two `Removed`, and a node stored with
    its child two chained `Stored`."""
    cache = PagedRadixCache(page_size=2, capacity_tokens=8)
    cache.insert(T1, [1, 2, 3, 4])
    cache.insert(T1, [5, 6, 7, 8])
    cache.take_events()
    assert cache.reserve(4)  # evicts both leaves in one step
    (removed,) = cache.take_events()
    assert isinstance(removed, Removed) and len(removed.block_hashes) == 4
    cache.release(4)
    cache.insert(T1, [1, 2])
    cache.insert(T1, [1, 2, 3, 4])  # its child, in the same step
    (stored,) = cache.take_events()
    assert isinstance(stored, Stored) and stored.parent is None
    assert len(stored.block_hashes) == 2 and stored.token_ids == [1, 2, 3, 4]
    # a store that does not continue the one before stays its own event, as do other kinds
    roomy = PagedRadixCache(page_size=2, capacity_tokens=32)
    roomy.take_events()
    roomy.insert(T1, [1, 2])
    roomy.insert(T1, [9, 9])  # a sibling, not a child
    roomy.insert(T2, [1, 2, 3, 4])  # another salt: a chain of its own
    roomy.evict(2)
    events = roomy.take_events()
    assert [type(e).__name__ for e in events] == ["Stored", "Stored", "Stored", "Removed"]
    # an index fed the merged events holds what the cache holds
    index = PrefixIndex()
    index.add_stream("w", block_size=2)
    fresh = PagedRadixCache(page_size=2, capacity_tokens=8)
    fresh.insert(T1, [1, 2])
    fresh.insert(T1, [1, 2, 3, 4, 5, 6])
    index.apply("w", EventBatch(ts=0.0, events=fresh.take_events()))
    assert index.query(IndexNamespace("", None, T1.cache_salt), [1, 2, 3, 4, 5, 6])["w"].blocks == 3


def test_event_hashes_are_memoized() -> None:
    cache = PagedRadixCache(page_size=2, capacity_tokens=64)
    cache.insert(T1, [1, 2, 3, 4])
    hashed = cache.stats().hashed_pages
    assert hashed == 2
    cache.insert(T1, [1, 2, 3, 4, 5, 6])  # the parent's digests are not computed again
    assert cache.stats().hashed_pages == hashed + 1
    cache.evict(100)
    assert cache.stats().hashed_pages == hashed + 1


def test_event_hash_walk_is_iterative_over_1100_pages(hash_vectors: Any) -> None:
    vector = next(v for v in hash_vectors["vectors"] if v["name"] == "p1-long-1100")
    tokens: list[int] = vector["token_ids"]
    root = RadixNode(0, None, [], Namespace(), 0)
    node = root
    chain = []
    for i, token in enumerate(tokens):  # one single-page node per token, none hashed yet
        node = RadixNode(i + 1, node, [token], Namespace(), 0)
        chain.append(node)
    digests, hashed = event_digests(node, 1)
    assert hashed == 1100
    assert [digest_to_hash(n.digests[0]) for n in chain if n.digests] == vector["block_hashes"]
    assert event_digests(node, 1) == (digests, 0)


def test_1100_page_path_in_the_cache() -> None:
    cache = PagedRadixCache(page_size=1, capacity_tokens=4096)
    tokens = [(i * 7919) % 50000 for i in range(1100)]
    for end in range(1, 1101):
        cache.insert(T1, tokens[:end])
    assert cache.stats().nodes == 1100
    assert cache.flush_namespace("tenant-1") == 1100
    # Cleared, then the 1100 chained stores and the 1100 removals merged as SGLang merges them
    cleared, stored, removed = cache.take_events()
    assert (
        isinstance(cleared, Cleared)
        and isinstance(stored, Stored)
        and len(stored.block_hashes) == 1100
    )
    assert isinstance(removed, Removed) and len(removed.block_hashes) == 1100


def test_locked_prefix_is_never_evicted() -> None:
    cache = PagedRadixCache(page_size=2, capacity_tokens=8)
    found, _ = cache.insert(T1, [1, 2, 3, 4])
    cache.lock(found.node)
    assert not cache.reserve(3)  # 2 free pages, the other 2 protected
    assert cache.reserve(2)
    assert cache.evict(100) == 0
    cache.release(2)
    cache.unlock(found.node)
    assert cache.evict(100) == 4
    with pytest.raises(ValueError):
        cache.unlock(found.node)


def test_reserve_evicts_lru_leaves_first() -> None:
    cache = PagedRadixCache(page_size=1, capacity_tokens=4)
    cache.insert(PLAIN, [1, 2])
    cache.insert(PLAIN, [3, 4])
    cache.match(PLAIN, [1, 2])  # [1, 2] is now more recent than [3, 4]
    cache.take_events()
    assert cache.reserve(1)
    (removed,) = cache.take_events()
    assert isinstance(removed, Removed)
    assert cache.peek(PLAIN, [3, 4]) == 0
    assert cache.peek(PLAIN, [1, 2]) == 2


def test_insert_from_a_reservation_does_not_evict() -> None:
    cache = PagedRadixCache(page_size=2, capacity_tokens=8)
    cache.insert(PLAIN, [9, 9, 9, 9])
    assert cache.reserve(2)
    cache.take_events()
    found, used = cache.insert(T1, [1, 2, 3, 4, 5], reserved_pages=2)
    assert (found.length, used) == (4, 2)
    assert [type(e) for e in cache.take_events()] == [Stored]
    assert cache.stats().reserved_pages == 0


def test_insert_that_does_not_fit_caches_what_fits() -> None:
    cache = PagedRadixCache(page_size=2, capacity_tokens=8)
    found, _ = cache.insert(PLAIN, [1, 2])
    cache.lock(found.node)
    found2, _ = cache.insert(T1, list(range(20)))
    assert found2.length == 6
    assert cache.stats().free_pages == 0


def test_flush_refuses_while_requests_run_and_flush_namespace_keeps_locked() -> None:
    cache = PagedRadixCache(page_size=2, capacity_tokens=64)
    found, _ = cache.insert(T1, [1, 2, 3, 4])
    cache.insert(T1, [5, 6])
    cache.insert(T2, [1, 2])
    cache.lock(found.node)
    with pytest.raises(CacheBusyError):
        cache.flush()
    cache.take_events()
    assert cache.flush_namespace("tenant-1") == 1
    assert cache.peek(T1, [1, 2, 3, 4]) == 4
    assert cache.peek(T2, [1, 2]) == 2
    assert [type(e) for e in cache.take_events()] == [Removed]
    cache.unlock(found.node)
    cache.flush()
    assert cache.take_events() == [Cleared()]
    assert cache.stats().tree_pages == 0
