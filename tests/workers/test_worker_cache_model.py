"""The radix cache against a brute-force model under seeded random operations."""

from __future__ import annotations

import random
from typing import Any

import pytest

from indexer.protocol.events import Removed
from workers.cache import Match, Namespace, PagedRadixCache

PAGE = 2
NAMESPACES = [
    Namespace(),
    Namespace(cache_salt="s1"),
    Namespace(cache_salt="s2"),
    Namespace(extra_key="s1"),
    Namespace(extra_key="e", cache_salt="s1"),
]
SALT_OF = {ns: ns.cache_salt for ns in NAMESPACES}


def _brute_match(pages: set[tuple[Namespace, tuple[int, ...]]], ns: Namespace, q: list[int]) -> int:
    best = 0
    for end in range(PAGE, len(q) + 1, PAGE):
        if (ns, tuple(q[:end])) in pages:
            best = end
        else:
            break
    return best


@pytest.mark.parametrize("seed", [11, 23, 5077, 90210])
def test_cache_matches_a_brute_force_model(seed: int, event_consumer: Any) -> None:
    print(f"seed={seed}")
    rng = random.Random(seed)
    capacity_pages = rng.choice([6, 12, 40])
    cache = PagedRadixCache(page_size=PAGE, capacity_tokens=capacity_pages * PAGE)
    consumer = event_consumer()
    inserted: set[tuple[Namespace, tuple[int, ...]]] = set()  # since the last flush
    locked: list[Match] = []
    reservations: list[int] = []

    def random_tokens() -> list[int]:
        # a small alphabet and shared stems, so prefixes overlap and nodes split
        stem = rng.choice([[1, 2, 3, 4], [1, 2, 5, 6], [7, 8], []])
        return stem + [rng.randint(1, 4) for _ in range(rng.randint(0, 9))]

    for _ in range(400):
        ns = rng.choice(NAMESPACES)
        tokens = random_tokens()
        op = rng.random()
        before = cache.stats()
        if op < 0.45:
            cache.insert(ns, tokens)
            aligned = tokens[: len(tokens) - len(tokens) % PAGE]
            inserted.update((ns, tuple(aligned[:e])) for e in range(PAGE, len(aligned) + 1, PAGE))
        elif op < 0.60:
            found = cache.match(ns, tokens)
            if rng.random() < 0.5 and found.length and len(locked) < 3:
                cache.lock(found.node)
                locked.append(found)
        elif op < 0.72 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))).node)
        elif op < 0.76:
            want = rng.randint(1, 4)
            fits = before.free_pages + before.tree_pages - before.protected_pages >= want
            assert cache.reserve(want) == fits
            if fits:
                reservations.append(want)
        elif op < 0.78 and reservations:
            cache.release(reservations.pop())
        elif op < 0.80:
            cache.evict(rng.randint(1, 6))
        elif op < 0.86:
            salt = rng.choice(["s1", "s2", None])
            cache.flush_namespace(salt)
            # only pages that a running request protects survive in that salt
            kept = {(n, t) for n, t in cache.cached_pages() if n.cache_salt == salt}
            held = {
                (m.node.namespace, tuple(_path_tokens(m)[:e]))
                for m in locked
                for e in range(PAGE, m.length + 1, PAGE)
            }
            assert kept <= held
            inserted = {(n, t) for n, t in inserted if n.cache_salt != salt} | kept
        elif op < 0.90 and not locked and not reservations:
            cache.flush()
            inserted.clear()
        else:
            assert cache.peek(ns, tokens) == _brute_match(cache.cached_pages(), ns, tokens)
        events = cache.take_events()
        consumer.apply(events)
        removed = [e for e in events if isinstance(e, Removed)]
        if removed and op < 0.45:
            # eviction only when the pool could not hold the new pages
            assert before.free_pages < capacity_pages

        stats = cache.stats()
        assert stats.tree_pages + stats.reserved_pages <= capacity_pages
        assert stats.reserved_pages == sum(reservations)
        pages = cache.cached_pages()
        assert len(pages) == stats.tree_pages
        assert pages <= inserted
        # the events alone reproduce exactly the cached pages
        assert consumer.prefixes() == {(n.cache_salt, t) for n, t in pages}
        for match in locked:
            assert cache.peek(match.node.namespace, _path_tokens(match)) == match.length
        q = random_tokens()
        qns = rng.choice(NAMESPACES)
        assert cache.peek(qns, q) == _brute_match(pages, qns, q)


def _path_tokens(found: Match) -> list[int]:
    tokens: list[int] = []
    node = found.node
    while node.parent is not None:
        tokens = node.key + tokens
        node = node.parent
    return tokens


def test_without_pressure_the_cache_holds_everything_inserted() -> None:
    seed = 7
    print(f"seed={seed}")
    rng = random.Random(seed)
    cache = PagedRadixCache(page_size=PAGE, capacity_tokens=100_000)
    inserted: set[tuple[Namespace, tuple[int, ...]]] = set()
    for _ in range(300):
        ns = rng.choice(NAMESPACES)
        tokens = [rng.randint(1, 3) for _ in range(rng.randint(0, 12))]
        cache.insert(ns, tokens)
        aligned = tokens[: len(tokens) - len(tokens) % PAGE]
        inserted.update((ns, tuple(aligned[:e])) for e in range(PAGE, len(aligned) + 1, PAGE))
    assert cache.cached_pages() == inserted
    assert not [e for e in cache.take_events() if isinstance(e, Removed)]
