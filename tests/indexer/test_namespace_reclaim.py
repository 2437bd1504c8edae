"""Namespace ids are released when nothing refers to them, so salt churn stays bounded."""

from __future__ import annotations

import os
import random

from indexer.backend import Backend
from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol.events import EventBatch, Removed, Stored
from tests.indexer.test_index_invariants import check_invariants

PAGE = 4


def store(index: PrefixIndex, stream: str, hashes: list[int], tokens: list[int], salt: str) -> None:
    ev = Stored(
        block_hashes=hashes,  # type: ignore[arg-type]
        parent=None,
        token_ids=tokens,  # type: ignore[arg-type]
        block_size=PAGE,
        cache_salt=salt,
    )
    index.apply(stream, EventBatch(0.0, [ev]))


def test_salt_churn_keeps_the_registry_bounded_and_isolated(backend: Backend) -> None:
    seed = int(os.environ.get("KVROUTE_TEST_SEED", "41"))
    print(f"reclaim seed={seed} backend={backend.name}")
    rng = random.Random(seed)
    now = [0.0]
    index = PrefixIndex(
        clock=lambda: now[0], pending_ttl_s=1.0, backend=backend, namespace_sweep=16
    )
    index.add_stream("s", model="m", block_size=PAGE)
    index.add_stream("t", model="m", block_size=PAGE)
    keeper = [1, 2, 3, 4, 5, 6, 7, 8]
    store(index, "s", [1, 2], keeper, "keeper")  # lives through every sweep
    peak = 0
    for i in range(3000):
        salt = f"user-{i}"
        tokens = [rng.randrange(5) for _ in range(8)]
        roll = rng.random()
        if roll < 0.4:  # a request routed (pending) and never stored
            index.add_pending(rng.choice("st"), Namespace("m", None, salt), tokens)
        else:  # stored, queried, then evicted by the worker
            h = 10 + 2 * i
            store(index, "t", [h, h + 1], tokens, salt)
            assert index.query(Namespace("m", None, salt), tokens)["t"].blocks == 2
            index.apply("t", EventBatch(0.0, [Removed(block_hashes=[h, h + 1])]))
        now[0] += 0.01  # pending entries expire after 100 requests
        peak = max(peak, len(index._registry))
        if i % 250 == 0:
            check_invariants(index)
    # ~100 live pending namespaces at a time: the registry stays near twice that, not 3000
    assert peak < 400, peak
    assert len(index._registry.names) < 400
    check_invariants(index)
    assert index.query(Namespace("m", None, "keeper"), keeper)["s"].blocks == 2
    # a released namespace matches nothing, even where its id now names another one
    tokens = [9, 9, 9, 9]
    store(index, "s", [99], tokens, "user-0")
    for old in ("user-1", "user-2", "user-3"):
        assert index.query(Namespace("m", None, old), tokens)["s"].blocks == 0
    assert index.query(Namespace("m", None, "user-0"), tokens)["s"].blocks == 1


def test_reclaim_spares_pending_and_partial_namespaces(backend: Backend) -> None:
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=5.0, backend=backend)
    index.add_stream("s", model="m", block_size=PAGE)
    index.add_pending("s", Namespace("m", None, "pending"), [1, 2, 3, 4])
    partial = Stored(
        block_hashes=[7],
        parent=None,
        token_ids=[1, 2],
        block_size=2,  # a trailing partial page
        cache_salt="partial",
    )
    index.apply("s", EventBatch(0.0, [partial]))
    store(index, "s", [8], [5, 6, 7, 8], "gone")
    index.apply("s", EventBatch(0.0, [Removed(block_hashes=[8])]))
    assert index.reclaim_namespaces() == 1  # only "gone"
    names = {ns.cache_salt for ns in index._registry.names if ns is not None}
    assert names == {"pending", "partial"}
    now[0] = 10.0  # the pending entry expires: its namespace goes at the next sweep
    assert index.reclaim_namespaces() == 1
    check_invariants(index)


def test_held_namespaces_name_those_of_pending_marks_alone(backend: Backend) -> None:
    """What an eviction must reach: a namespace of pending marks alone (an extra_key's, or one
    whose events are on their way) is held, though `namespaces` (with blocks) lists it not."""
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=5.0, backend=backend)
    index.add_stream("s", model="m", block_size=PAGE)
    marked = Namespace("m", None, "t", extra_key="view")
    index.add_pending("s", marked, [1, 2, 3, 4])
    store(index, "s", [8], [5, 6, 7, 8], "t")
    store(index, "s", [9], [5, 6, 7, 9], "gone")
    index.apply("s", EventBatch(0.0, [Removed(block_hashes=[9])]))
    assert {s.namespace for s in index.namespaces()} == {Namespace("m", None, "t")}
    assert set(index.held_namespaces()) == {marked, Namespace("m", None, "t")}
    assert index.query(marked, [1, 2, 3, 4])["s"].pending_blocks == 1
    index.evict_namespace(marked)
    assert index.query(marked, [1, 2, 3, 4])["s"].pending_blocks == 0
    now[0] = 10.0
    assert index.held_namespaces() == [Namespace("m", None, "t")]
