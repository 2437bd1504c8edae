"""PrefixIndex details the differential test does not reach: sizes, tiers, pending, snapshots."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from indexer.engines import EngineName
from indexer.errors import SnapshotError
from indexer.index import PrefixIndex
from indexer.index.prefix_index import LATE_MARK_S
from indexer.index.registry import NamespaceRegistry
from indexer.index.removal_log import MOST_KEYS_READ, RemovalLog
from indexer.namespace import (
    HASH_PROBE,
    Namespace,
    block_tuples,
    chain_block_keys,
    namespace_seed,
    request_keys,
)
from indexer.protocol.events import BlockHash, Cleared, EventBatch, Removed, Stored, Unreadable
from indexer.snapshot import _seal, _unseal, dump_index, load_index

NS = Namespace("m")
TOKENS = list(range(100, 116))  # 4 blocks of 4


def stored(
    hashes: list[BlockHash], tokens: list[int], parent: int | None = None, **kw: object
) -> Stored:
    page = kw.pop("block_size", 4)
    return Stored(block_hashes=hashes, parent=parent, token_ids=tokens, block_size=page, **kw)  # type: ignore[arg-type]


def batch(*events: object) -> EventBatch:
    return EventBatch(0.0, list(events))  # type: ignore[arg-type]


def make(block_size: int | None = 4, engine: EngineName = "sglang") -> PrefixIndex:
    index = PrefixIndex()
    index.add_stream("a", model="m", block_size=block_size, engine=engine)
    index.add_stream("b", model="m", block_size=block_size, engine=engine)
    return index


def test_block_keys_are_stable_and_namespaced() -> None:
    keys = request_keys(NS, TOKENS, 4)
    assert len(keys) == 4 and keys == request_keys(Namespace("m", None, ""), [*TOKENS, 1], 4)
    assert keys != request_keys(Namespace("m", None, "s"), TOKENS, 4)
    assert namespace_seed(NS, 4) != namespace_seed(NS, 8)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_parents_refcounts_and_unknown_parents(engine: EngineName) -> None:
    index = make(engine=engine)
    out = index.apply("a", batch(stored([1, 2], TOKENS[:8]), stored([3], TOKENS[8:12], parent=2)))
    assert out.stored == 3 and index.query(NS, TOKENS)["a"].blocks == 3
    out = index.apply("a", batch(stored([9], TOKENS[12:], parent=777)))
    assert out.unknown_parents == 1 and index.counters("a").unknown_parents == 1
    index.apply("a", batch(stored([1, 2], TOKENS[:8])))
    assert index.query(NS, TOKENS)["a"].blocks == 3 and index.entries("a") == 3
    assert index.copies("a", index.block_keys("a", NS, TOKENS)) == (
        [1, 1, 1, 0] if engine == "vllm" else [2, 2, 1, 0]
    )
    index.apply("a", batch(Removed(block_hashes=[2])))
    if engine == "vllm":
        # stored again (a twin block, or vLLM re-reporting a reused one): counted once, so
        # the next removal drops it (re-reports had kept evicted blocks predicted for good)
        assert index.query(NS, TOKENS)["a"].blocks == 1
        assert index.entries("a") == 2
        index.apply("a", batch(Removed(block_hashes=[2])))  # its twin's removal: nothing left
        assert index.counters("a").unknown_removes == 1 and index.entries("a") == 2
        return
    # SGLang stores a page again only as another radix node (an extra_key's copy), removed
    # on its own: held until its last copy goes; which one went is not known, so the copies
    # counted since count no more
    assert index.query(NS, TOKENS)["a"].blocks == 3 and index.entries("a") == 3
    assert index.copies("a", index.block_keys("a", NS, TOKENS)) == [2, 1, 1, 0]
    index.apply("a", batch(Removed(block_hashes=[2])))
    assert index.query(NS, TOKENS)["a"].blocks == 1 and index.entries("a") == 2
    assert index.counters("a").unknown_removes == 0


def test_cleared_drops_exactly_that_stream() -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8])))
    index.apply("b", batch(stored([1, 2, 3], TOKENS[:12])))
    index.apply("a", batch(Cleared()))
    got = index.query(NS, TOKENS)
    assert (got["a"].blocks, got["b"].blocks) == (0, 3)
    assert index.counters("a").clears == 1
    assert [(s.blocks, s.holders) for s in index.namespaces()] == [(3, {"b": 3})]


def test_block_size_learned_partial_pages_and_mismatches() -> None:
    index = make(block_size=None)
    index.apply("a", batch(stored([1, 2], TOKENS[:8])))
    assert index.block_size("a") == 4
    # a trailing partial page: held, never matching a full request block
    out = index.apply("a", batch(stored([5], TOKENS[8:10], parent=2, block_size=2)))
    assert out.block_size_mismatches == 0 and index.entries("a") == 3
    assert index.query(NS, TOKENS)["a"].blocks == 2
    index.apply("a", batch(Removed(block_hashes=[5])))
    assert index.entries("a") == 2
    # pages of 8 on a stream of 4, or several short pages: counted, not indexed
    out = index.apply("a", batch(stored([6], TOKENS[:8], block_size=8)))
    out2 = index.apply("a", batch(stored([7, 8], TOKENS[:4], block_size=2)))
    assert out.block_size_mismatches == 1 and out2.block_size_mismatches == 1
    assert index.counters("a").block_size_mismatches == 2 and index.entries("a") == 2


def test_a_vllm_partial_page_alone_does_not_set_the_page_size() -> None:
    """vLLM 0.33 publishes a partial entry inside a block (fine-grained prefix hits) as a
    one-page store of one hash block; learned from it, every later full block was a mismatch
    and nothing more was indexed on the rank."""
    index = make(block_size=None, engine="vllm")
    out = index.apply("a", batch(stored([9], TOKENS[:2], block_size=2)))  # the partial entry
    assert index.block_size("a") is None and out.skipped == 1 and index.entries("a") == 0
    out = index.apply("a", batch(stored([1, 2], TOKENS[:8])))  # full pages: the size
    assert index.block_size("a") == 4 and out.stored == 2 and out.block_size_mismatches == 0
    index.apply("a", batch(stored([3], TOKENS[8:12], parent=2)))  # one full page, now known
    index.apply("a", batch(stored([8], TOKENS[12:14], parent=3, block_size=2)))  # partial
    assert index.query(NS, TOKENS)["a"].blocks == 3 and index.entries("a") == 4


def test_media_are_reported_per_tier() -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], medium="GPU")))
    index.apply("a", batch(stored([3, 4], TOKENS[8:], parent=2, medium="CPU")))
    got = index.query(NS, TOKENS)["a"]
    assert got.blocks == 4 and got.by_medium == {"GPU": 2, "CPU": 2}
    index.apply("a", batch(Removed(block_hashes=[3, 4])))
    assert index.query(NS, TOKENS)["a"].by_medium == {"GPU": 2}


def test_pending_entries_expire_and_are_replaced() -> None:
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=2.0)
    index.add_stream("a", model="m", block_size=4)
    index.apply("a", batch(stored([1], TOKENS[:4])))
    assert index.add_pending("a", NS, TOKENS) == 3  # the first block is already real
    got = index.query(NS, TOKENS)["a"]
    assert (got.blocks, got.pending_blocks) == (1, 3)
    index.apply("a", batch(stored([2], TOKENS[4:8], parent=1)))
    assert len(index.pending) == 2  # the real block replaced its pending entry
    now[0] = 2.5
    got = index.query(NS, TOKENS)["a"]
    assert (got.blocks, got.pending_blocks) == (2, 0) and len(index.pending) == 0


@pytest.mark.parametrize("how", ["event", "restart"])
def test_a_clear_drops_the_streams_pending_marks_and_older_ones_coming_late(how: str) -> None:
    """A clear (AllBlocksCleared, or the stream's restart or lost gap) drops the stream's
    pending marks with its entries: nothing tells whether their requests stored before it (an
    extra_key request's mark is never taken back by an event). A mark another replica made
    before the clear, arriving after it (held up by NATS), marks nothing; one made after does.
    """
    now = [10.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=60.0)
    index.add_stream("a", model="m", block_size=4)
    index.add_stream("b", model="m", block_size=4)
    index.log_removals()  # as a replica of a cluster does at its start
    keyed = Namespace("m", None, "s", extra_key="view-1")
    assert index.add_pending("a", keyed, TOKENS) == 4
    assert index.add_pending("b", keyed, TOKENS) == 4
    now[0] = 11.0
    if how == "event":
        index.apply("a", batch(Cleared()))
    else:
        index.clear_stream("a")
    assert index.query(keyed, TOKENS)["a"].pending_blocks == 0
    assert index.query(keyed, TOKENS)["b"].pending_blocks == 4  # another stream's stay
    now[0] = 12.0
    # routed 1.5 s ago (before the clear), told now: nothing; routed 0.5 s ago: marked
    assert index.add_pending("a", keyed, TOKENS, age_s=1.5) == 0
    assert index.query(keyed, TOKENS)["a"].pending_blocks == 0
    assert index.add_pending("a", keyed, TOKENS, age_s=0.5) == 4
    assert index.query(keyed, TOKENS)["a"].pending_blocks == 4


def test_a_removal_of_the_pages_an_extra_keys_request_stored_drops_its_marks_from_there() -> None:
    """An `extra_key` request's pages come as plain pages of its salt, so no store takes its
    marks back. A removal of one of them took them for up to the TTL (QA: 144 tokens
    predicted after the worker evicted or flushed them, 0 cached); now each removal drops the
    marks of the same blocks (every extra_key's: which copy went no event says) from the block
    it took on, on that stream only, and a removal of another salt's pages changes nothing."""
    index = PrefixIndex(pending_ttl_s=60.0)
    index.add_stream("a", model="m", block_size=4)
    index.add_stream("b", model="m", block_size=4)
    keyed = Namespace("m", None, "s", extra_key="view-1")
    other = Namespace("m", None, "s", extra_key="view-2")
    for ns in (keyed, other):
        assert index.add_pending("a", ns, TOKENS) == 4
    assert index.add_pending("b", keyed, TOKENS) == 4
    index.apply("a", batch(stored([1, 2, 3, 4], TOKENS, cache_salt="s")))
    index.apply("a", batch(stored([9], TOKENS[:4], cache_salt="t")))

    def pending(ns: Namespace, stream: str) -> int:
        return index.query(ns, TOKENS)[stream].pending_blocks

    index.apply("a", batch(Removed(block_hashes=[9])))  # another salt's page
    assert (pending(keyed, "a"), pending(other, "a")) == (4, 4)
    index.apply("a", batch(Removed(block_hashes=[4])))  # the leaf first, as engines evict
    assert (pending(keyed, "a"), pending(other, "a"), pending(keyed, "b")) == (3, 3, 4)
    index.apply("a", batch(Removed(block_hashes=[3, 2, 1])))
    assert (pending(keyed, "a"), pending(other, "a"), pending(keyed, "b")) == (0, 0, 4)
    # a sibling routed after the removal marks its blocks again, and is tied to them again
    assert index.add_pending("a", keyed, TOKENS) == 4
    index.apply("a", batch(stored([5, 6], TOKENS[:8], cache_salt="s")))
    index.apply("a", batch(Removed(block_hashes=[6])))
    assert pending(keyed, "a") == 1


def _keyed_index(now: list[float]) -> tuple[PrefixIndex, Namespace]:
    """An index of streams a and b, a holding TOKENS as plain pages 1-4 of salt s, and an
    extra_key request of that salt marked pending on a."""
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=60.0)
    index.add_stream("a", model="m", block_size=4)
    index.add_stream("b", model="m", block_size=4)
    keyed = Namespace("m", None, "s", extra_key="view-1")
    assert index.add_pending("a", keyed, TOKENS) == 4
    index.apply("a", batch(stored([1, 2, 3, 4], TOKENS, cache_salt="s")))
    return index, keyed


@pytest.mark.parametrize("how", ["unreadable", "evicted_namespace"])
def test_pages_the_index_stops_following_drop_the_extra_key_marks_tied_to_them(how: str) -> None:
    """An event naming the pages that did not decode (a removal, maybe), or an eviction of
    their namespace from the index alone (the worker's removal of them comes later, of pages
    the index no longer knows): either way the marks tied to them went on standing, and a
    sibling was predicted pages the worker evicted since (QA: 160 tokens, 0 cached)."""
    now = [10.0]
    index, keyed = _keyed_index(now)
    if how == "unreadable":
        index.apply("a", batch(Unreadable("BlockRemoved", block_hashes=[3])))
        left = 2
    else:
        assert index.evict_namespace(Namespace("m", None, "s")) == 4
        left = 0
    assert index.query(keyed, TOKENS)["a"].pending_blocks == left


def test_another_replicas_late_mark_is_not_taken_for_blocks_removed_since() -> None:
    """A decision NATS held up past a removal on the stream may stand for pages stored and
    removed meanwhile (QA: a late decision marked 160 tokens after the worker had flushed
    them). A block whose page left the stream after the decision was made is not marked, at
    any lateness (a time threshold let one held 20-50 ms through); a removal of other pages
    there refuses nothing (it refused the whole decision, another salt's too)."""
    now = [10.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=60.0)
    for stream in ("a", "b"):
        index.add_stream(stream, model="m", block_size=4)
    salted = Namespace("m", None, "s")
    # the keys of removals are logged in a replica of a cluster, from its start (a router
    # alone pays nothing for them)
    index.log_removals()
    index.apply("a", batch(stored([1, 2, 3, 4], TOKENS, cache_salt="s")))
    now[0] = 11.0
    index.apply("a", batch(Removed(block_hashes=[4, 3])))  # the two last pages, LRU
    now[0] = 11.0 + LATE_MARK_S / 2
    # routed 10 ms before the removal, taken 15 ms after it: blocks 1-2 are held (no mark
    # needed), 3-4 went since it was made and are not marked (the request's own pages, maybe)
    assert index.add_pending("a", salted, TOKENS, age_s=LATE_MARK_S / 2 + 0.01) == 0
    assert index.query(salted, TOKENS)["a"].pending_blocks == 0
    assert index.late_marks == 1  # counted: `kvroute_cluster_decisions_late`
    # made after the removal: marked, as on time
    assert index.add_pending("a", salted, TOKENS, age_s=LATE_MARK_S / 4) == 2
    assert index.late_marks == 1
    # another salt's request, made long before that removal: its blocks did not go, marked
    other = Namespace("m", None, "t")
    now[0] = 12.0
    assert index.add_pending("a", other, TOKENS, age_s=1.5) == 4
    assert index.add_pending("b", salted, TOKENS, age_s=1.5) == 4  # another stream
    assert index.late_marks == 1
    # a removal of pages the index does not know, or an event that did not decode: what the
    # worker removed is not known, and a decision held past `LATE_MARK_S` across it marks
    # nothing (QA: a late mark taken after either); an on-time one still marks
    third = Namespace("m", None, "u")
    for event in (Removed(block_hashes=[99]), Unreadable("BlockRemoved", block_hashes=[98])):
        now[0] += 10.0
        index.apply("b", batch(event))
        now[0] += 1.0
        assert index.add_pending("b", third, TOKENS[:8], age_s=1.5) == 0
        assert index.add_pending("b", third, TOKENS[:8], age_s=LATE_MARK_S / 2) == 2
    assert index.late_marks == 3


def test_a_late_extra_key_mark_is_not_taken_for_pages_removed_since() -> None:
    """An `extra_key` request's pages come as plain pages of its salt: another replica's late
    decision for one is judged by the removals of those (its own keys never show)."""
    now = [10.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=60.0)
    index.add_stream("a", model="m", block_size=4)
    keyed = Namespace("m", None, "s", extra_key="view-1")
    index.apply("a", batch(stored([1, 2, 3, 4], TOKENS, cache_salt="s")))
    index.log_removals()
    now[0] = 11.0
    index.apply("a", batch(Removed(block_hashes=[4, 3])))
    now[0] = 11.02
    # made 10 ms before the removal: the plain pages of blocks 3-4 went since, so those
    # blocks are not marked; 1-2 are (no store ever shows an extra_key's own pages)
    assert index.add_pending("a", keyed, TOKENS, age_s=0.03) == 2
    assert index.query(keyed, TOKENS)["a"].pending_blocks == 2
    assert index.late_marks == 1
    # the marks made are tied to their pages as a local decision's are: a removal drops them
    index.apply("a", batch(Removed(block_hashes=[2])))
    assert index.query(keyed, TOKENS)["a"].pending_blocks == 1
    # the log keeps a removal as long as a mark can come late (the TTL), no longer
    now[0] = 80.0
    index.apply("a", batch(Removed(block_hashes=[1])))
    assert len(index._streams["a"].removals) == 1


def test_a_removal_log_reads_a_bounded_window_and_forgets_past_it() -> None:
    """A question reads the removals since the mark, newest first: exact for a few, and past
    `MOST_KEYS_READ` keys the mark is refused whole (after a NATS stall the held decisions come
    at once, each reading its whole window: QA measured 24 ms a mark). Forgotten batches
    refuse nothing."""
    log = RemovalLog()
    for t in range(10):
        log.add([100 + t, 200 + t], float(t))
    assert log.gone_since([105, 106, 1], 5.5) == [False, True, False]
    assert log.gone_since([1, 2], 5.5) is None
    log.forget_before(7.0)
    assert len(log) == 3 and log.gone_since([106, 107], 0.0) == [False, True]
    log.add(list(range(1000, 1000 + MOST_KEYS_READ - 6)), 10.0)
    assert log.gone_since([1, 2], 6.5) is None  # the budget read whole: none of them
    log.add([5000], 11.0)
    assert log.gone_since([1, 2], 6.5) == [True, True]  # more than the budget since: all
    assert log.gone_since([5000, 1], 10.5) == [True, False]
    log.clear()
    assert len(log) == 0 and log.gone_since([1], 0.0) is None


@pytest.mark.parametrize("how", ["host_tier", "one_of_two_copies"])
def test_a_late_mark_is_judged_by_a_removal_of_any_copy_of_its_page(how: str) -> None:
    """A page held in two tiers (SGLang's HiCache: GPU, then the host) or as two radix copies
    leaves the stream one removal at a time; each removal is logged, as an `extra_key`
    request's marks go on any of them (QA, critical: a late mark survived the host tier's
    removal of pages the GPU had evicted, 160 tokens predicted, 0 cached; and one of two
    copies' removal)."""
    now = [10.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=60.0)
    index.add_stream("a", model="m", block_size=4)
    index.log_removals()
    keyed = Namespace("m", None, "s", extra_key="view-1")
    salted = Namespace("m", None, "s")
    now[0] = 11.0
    index.apply("a", batch(stored([1, 2, 3, 4], TOKENS, cache_salt="s")))
    if how == "host_tier":
        index.apply("a", batch(stored([1, 2, 3, 4], TOKENS, cache_salt="s", medium="CPU")))
        index.apply("a", batch(Removed(block_hashes=[4, 3])))  # from every tier
    else:
        index.apply("a", batch(stored([1, 2, 3, 4], TOKENS, cache_salt="s")))  # a second copy
        index.apply("a", batch(Removed(block_hashes=[4, 3])))  # one copy of each
    now[0] = 11.02
    assert index.add_pending("a", keyed, TOKENS, age_s=0.03) == 2  # blocks 1-2 only
    assert index.add_pending("a", salted, TOKENS, age_s=0.03) == 0  # held, or removed since


def test_a_late_mark_made_before_the_index_logged_removals_marks_nothing() -> None:
    """What was removed before the log began (a replica's start, an index loaded from a
    snapshot) is not known: a peer's mark made before then marks nothing, whether or not a
    removal was seen since (QA: a replica warm-started from a snapshot taken after a flush
    took a decision held across it, 160 tokens predicted, 0 cached)."""
    now = [10.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=60.0)
    index.add_stream("a", model="m", block_size=4)
    index.log_removals()
    now[0] = 10.5
    assert index.add_pending("a", NS, TOKENS, age_s=1.0) == 0 and index.late_marks == 1
    assert index.add_pending("a", NS, TOKENS, age_s=0.4) == 4  # made after: marked


def test_no_pending_ttl_counts_no_late_mark() -> None:
    """With pending marks off (`pending_ttl_s` 0) another replica's decision marks nothing
    for that reason alone: it is not counted as late (every one was)."""
    index = PrefixIndex(pending_ttl_s=0.0)
    index.add_stream("a", model="m", block_size=4)
    assert index.add_pending("a", NS, TOKENS, age_s=0.01) == 0 and index.late_marks == 0


def test_marks_of_a_named_adapter_go_where_events_number_adapters() -> None:
    """SGLang <= 0.5.19 (the array layout) names an adapter by number only: its pages of an
    adapter come under `anonymous_lora(id)`, never the name's namespace, so an `extra_key`
    request's marks of a named adapter, tied to the name's pages, were never dropped by their
    removal (QA, critical: 160 tokens predicted after a flush or an eviction, 0 cached), nor
    were a plain request's taken back by their store. The first page a stream shows by number
    drops them, and no more are made there."""
    index = PrefixIndex(pending_ttl_s=60.0)
    index.add_stream("a", model="m", block_size=4)
    index.add_stream("b", model="m", block_size=4)
    adapter = Namespace("m", "sql", "s", extra_key="view-1")
    plain = Namespace("m", "sql", "s")  # its marks are never taken back by a store there
    base = Namespace("m", None, "s", extra_key="view-1")
    for stream in ("a", "b"):
        for ns in (adapter, plain, base):
            assert index.add_pending(stream, ns, TOKENS) == 4
    index.apply("a", batch(stored([1, 2, 3, 4], TOKENS, cache_salt="s", lora_id=7)))

    def pending(ns: Namespace, stream: str) -> int:
        return index.query(ns, TOKENS)[stream].pending_blocks

    assert [pending(ns, "a") for ns in (adapter, plain, base)] == [0, 0, 4]
    assert [pending(ns, "b") for ns in (adapter, plain, base)] == [4, 4, 4]
    assert index.add_pending("a", adapter, TOKENS) == 0 == index.add_pending("a", plain, TOKENS)
    assert index.add_pending("a", base, TOKENS) == 4 and index.add_pending("b", adapter, TOKENS)


def test_evict_namespace_and_drop_stream() -> None:
    index = make()
    salted = Namespace("m", None, "s")
    index.apply("a", batch(stored([1, 2], TOKENS[:8]), stored([3, 4], TOKENS[:8], cache_salt="s")))
    index.apply("b", batch(stored([3, 4], TOKENS[:8], cache_salt="s")))
    assert index.evict_namespace(salted) == 4
    assert index.query(salted, TOKENS)["a"].blocks == 0 and index.entries("b") == 0
    assert index.query(NS, TOKENS)["a"].blocks == 2
    assert index.drop_stream("a") == 2 and index.streams() == ["b"]
    assert index.namespaces() == []


def test_snapshot_round_trip() -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], cache_salt="s"), stored([3], TOKENS[:4])), 7)
    index.apply("b", batch(stored([b"x" * 32], TOKENS[:4], medium="CPU")), 3)
    index.apply("b", batch(stored([b"x" * 32], TOKENS[:4], medium="GPU")), 4)  # a second tier
    loaded = load_index(dump_index(index))
    for ns in (NS, Namespace("m", None, "s")):
        assert loaded.query(ns, TOKENS) == index.query(ns, TOKENS)
    assert loaded.namespaces() == index.namespaces()
    assert (loaded.last_seq("a"), loaded.last_seq("b")) == (7, 4)
    loaded.apply("b", batch(Removed(block_hashes=[b"x" * 32], medium="CPU")))
    assert loaded.entries("b") == 1  # the copy per tier survived


def test_a_snapshot_carries_no_namespace_it_holds_nothing_of() -> None:
    """An evicted tenant's salt, or one only a pending mark named, stayed in every snapshot
    (the registry sweeps unused ids only when it grows): a salt kept in the clear for good."""
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], cache_salt="gone"), stored([3], TOKENS[:4])))
    assert index.add_pending("a", Namespace("m", None, "only-pending"), TOKENS) > 0
    assert index.evict_namespace(Namespace("m", None, "gone")) == 2
    data = dump_index(index)
    assert b"gone" not in data and b"only-pending" not in data
    loaded = load_index(data)
    assert loaded.query(NS, TOKENS)["a"].blocks == 1
    assert loaded.namespaces() == index.namespaces()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x81\xa3abc\x01",
        msgspec.msgpack.encode({"format": "kvroute-index", "version": 99}),
        msgspec.msgpack.encode({"format": "kvroute-index", "version": 1, "hash_probe": 1}),
    ],
)
def test_bad_snapshots_raise_snapshot_error(data: bytes) -> None:
    with pytest.raises(SnapshotError):
        load_index(data)


def test_truncated_and_inconsistent_snapshots_raise() -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8])))
    data = dump_index(index)
    for cut in (len(data) // 2, len(data) - 1):
        with pytest.raises(SnapshotError):
            load_index(data[:cut])
    doc = msgspec.msgpack.decode(_unseal(data))
    doc["streams"][0][8] = [99, 99]  # namespace ids that do not exist
    with pytest.raises(SnapshotError):
        load_index(_seal(msgspec.msgpack.encode(doc)))  # past the digest: the body's checks


def test_every_single_bit_flip_of_a_snapshot_is_refused() -> None:
    """One flipped bit in an engine hash made an entry the worker's removal never named again
    (a false hit for good): the digest over the body refuses any damage before decoding."""
    index = make()
    index.apply("a", batch(stored([11, 12], TOKENS[:8], cache_salt="s")), 1)
    index.apply("a", batch(stored([13, 14], TOKENS[8:16], parent=12)), 2)
    data = dump_index(index)
    assert load_index(data).entries("a") == 4
    accepted = []
    for i in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[i] ^= 1 << bit
            try:
                load_index(bytes(damaged))
            except SnapshotError:
                continue
            accepted.append((i, bit))
    assert accepted == []


def test_a_snapshot_of_an_older_version_is_refused_and_says_start_cold() -> None:
    """Versions 1-4 carry no digest, so damage in them cannot be seen: they are refused (a
    cold start after an upgrade: hits lost for a while, never a false one)."""
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8])), 1)
    body = msgspec.msgpack.decode(_unseal(dump_index(index)))
    for version in (1, 4):
        old = msgspec.msgpack.encode({"format": "kvroute-index", "version": version, **body})
        with pytest.raises(SnapshotError, match="no digest: start cold"):
            load_index(old)


# stream fields: 4 block_size, 5 last_seq, 12 counters, 13 fence, 15 skipped groups, 16 lookahead
@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        (5, -1, "last_seq -1"),
        (5, -(2**63), "last_seq -9223372036854775808"),
        (4, 0, "block_size 0"),
        # packed into every namespace seed (2**64 overflowed it), a tuple of as many tokens a
        # block: the wire's largest page is the most
        (4, 2**64 - 1, "block_size 18446744073709551615 is outside 1..65536"),
        (4, 2**16 + 1, "block_size 65537 is outside 1..65536"),
        (13, b"\x00", "fence of 1 bytes"),
        (13, b"\x00" * 1_000_000, "fence of 1000000 bytes"),
        (12, {"blocks_stored": -5}, "counters.blocks_stored -5"),
        (16, -1, "lookahead -1"),
        (16, 2**24 + 1, "lookahead 16777217"),
        (15, [-1], "skipped_groups"),
    ],
)
def test_a_field_out_of_its_range_is_refused_by_name(field: int, value: object, named: str) -> None:
    """The digest proves the bytes, not their writer: a last_seq of -1 was loaded as it was,
    and the stream's subscriber then failed at every start (`seq -1 does not fit in 64
    unsigned bits`), the stream never synced."""
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8])), 7)
    doc = msgspec.msgpack.decode(_unseal(dump_index(index)))
    doc["streams"][0][field] = value
    if field == 4:  # a page size of 0 with no entries: nothing else is wrong with it
        doc["streams"][0][6:9] = [[], [], []]
    with pytest.raises(SnapshotError, match=f"stream 'a': {named}"):
        load_index(_seal(msgspec.msgpack.encode(doc)))
    # the bounds themselves load
    doc = msgspec.msgpack.decode(_unseal(dump_index(index)))
    doc["streams"][0][5] = 2**64 - 1
    doc["streams"][0][16] = 2**24
    loaded = load_index(_seal(msgspec.msgpack.encode(doc)))
    assert (loaded.last_seq("a"), loaded.lookahead("a")) == (2**64 - 1, 2**24)


def test_forged_entries_raise_whole_stream_checks() -> None:
    """The bulk load's checks: a hash twice in a stream, one key in two namespaces (across
    streams and within one), an unknown namespace id among known ones."""
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8]), stored([3], TOKENS[:4], cache_salt="s")))
    index.apply("b", batch(stored([5, 6], TOKENS[:8])))
    doc = msgspec.msgpack.decode(_unseal(dump_index(index)))
    a, b = doc["streams"]
    assert load_index(_seal(msgspec.msgpack.encode(doc))).entries("a") == 3
    salted = next(ns_id for ns_id in a[8] if ns_id != b[8][0])  # map order differs per process
    forged = []
    for stream, field, value in (
        (a, 6, [1, 1, 3]),  # an engine hash twice
        (b, 8, [salted] * 2),  # b's keys in a's salted namespace
        (a, 7, [a[7][0], a[7][0], a[7][0]]),  # one key in both of a's namespaces
        (a, 8, [a[8][0], 99, a[8][2]]),  # an id nobody placed
    ):
        saved = stream[field]
        stream[field] = value
        forged.append(_seal(msgspec.msgpack.encode(doc)))
        stream[field] = saved
    for data in forged:
        with pytest.raises(SnapshotError):
            load_index(data)


def test_an_entry_of_another_namespace_never_matches_even_on_a_key_collision() -> None:
    index = make()
    other = Namespace("m", None, "other")
    index.apply("a", batch(stored([1, 2, 3, 4], TOKENS)))
    index.apply("b", batch(stored([5], TOKENS[:4], cache_salt="other")))
    # forge a collision: block 2 of NS now carries the other namespace's code in the table
    key = request_keys(NS, TOKENS, 4)[2]
    other_value = index._table[request_keys(other, TOKENS, 4)[0]]
    saved = index._table[key]
    index._table[key] = other_value
    got = index.query(NS, TOKENS)
    assert (got["a"].blocks, got["b"].blocks) == (2, 0)
    index._table[key] = saved
    assert index.query(NS, TOKENS)["a"].blocks == 4


def test_block_keys_are_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from indexer.namespace import Namespace, request_keys;"
        "print(request_keys(Namespace('m', 'l', 's'), list(range(64)), 16))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(request_keys(Namespace("m", "l", "s"), list(range(64)), 16))


def test_key_scheme_is_unchanged_and_both_chain_passes_agree() -> None:
    # the value every snapshot so far was made with: a change here orphans all of them
    assert HASH_PROBE == 6160721233254495453
    seed = int.from_bytes(os.urandom(4), "big")
    print(f"seed={seed}")
    tokens = [(seed * 7919 + i * 104729) % 50_000 for i in range(4096)]
    for n_blocks in (0, 1, 7, 64, 65, 256):
        for page in (1, 4, 16):
            want = chain_block_keys(seed, block_tuples(tokens[: n_blocks * page], page))
            got = chain_block_keys(seed, block_tuples(tokens[: n_blocks * page], page), many=True)
            assert got == want and len(got) == n_blocks


def test_namespace_registry_ids_survive_placing_and_interning() -> None:
    registry = NamespaceRegistry()
    a, b = Namespace("m", None, "a"), Namespace("m", None, "b")
    registry.place(3, a)
    with pytest.raises(ValueError):
        registry.place(3, b)  # id taken
    with pytest.raises(ValueError):
        registry.place(5, a)  # namespace already placed
    with pytest.raises(ValueError):
        registry.place(0, b)  # 0 means "no namespace"
    nb = registry.intern(b)  # a hole below the placed id is reused first
    assert nb in (1, 2) and registry.intern(a) == 3 and registry.find(b) == nb
    assert [registry.known(i) for i in range(5)] == [i in (nb, 3) for i in range(5)]
    assert len(registry.codes) == len(registry.blocks) == len(registry.names) == 4
    assert registry.seed(3, 16) == namespace_seed(a, 16)
    c = Namespace("m", None, "c")
    assert registry.intern(c) == 3 - nb  # the other hole
    assert registry.intern(Namespace("m", None, "d")) == 4  # no hole left: appended
    registry.blocks[3] = 1
    with pytest.raises(ValueError):
        registry.release([3])  # still holds blocks
    registry.release([nb])
    assert registry.find(b) is None and not registry.known(nb)
    assert registry.intern(Namespace("m", None, "e")) == nb  # released ids are reused


def test_steady_store_path_after_clear_and_eviction() -> None:
    # children of a known parent take the inline path; it must keep every size right after a
    # clear or an eviction emptied the stream's per-namespace counts (a salted child under an
    # unsalted parent is hostile SGLang input: held as below a partial page, never matched,
    # and gone with its namespace's eviction)
    from tests.indexer.test_index_invariants import check_invariants

    index = make()
    salted = Namespace("m", None, "s")
    for reset in ("clear", "evict", None):
        index.apply("a", batch(stored([1, 2], TOKENS[:8])))
        index.apply("a", batch(stored([3], TOKENS[8:12], parent=2)))
        index.apply("a", batch(stored([5], TOKENS[12:], parent=2, cache_salt="s")))
        index.apply("a", batch(stored([4], TOKENS[12:], parent=3)))
        check_invariants(index)
        assert index.query(NS, TOKENS)["a"].blocks == 4
        sizes = {s.namespace: (s.blocks, s.holders) for s in index.namespaces()}
        assert sizes == {NS: (4, {"a": 4})} and index.entries("a") == 5
        if reset == "clear":
            index.apply("a", batch(Cleared()))
        elif reset == "evict":
            assert index.evict_namespace(NS) + index.evict_namespace(salted) == 5
        check_invariants(index)
        assert (index.namespaces() == []) == (reset is not None)


def test_offload_moves_a_block_to_the_tier_it_is_left_in() -> None:
    # vLLM and SGLang HiCache report offload as: store on GPU, store again on the host, remove
    # from the GPU (the host copy stays), and finally remove from the host
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], medium="GPU")))
    assert index.query(NS, TOKENS)["a"].by_medium == {"GPU": 2}
    index.apply("a", batch(stored([1, 2], TOKENS[:8], medium="CPU")))
    assert index.query(NS, TOKENS)["a"].by_medium == {"GPU": 2}  # the best tier held
    index.apply("a", batch(Removed(block_hashes=[1, 2], medium="GPU")))
    got = index.query(NS, TOKENS)["a"]
    assert (got.blocks, got.by_medium) == (2, {"CPU": 2})
    index.apply("a", batch(Removed(block_hashes=[2], medium="CPU")))
    got = index.query(NS, TOKENS)["a"]
    assert (got.blocks, got.by_medium) == (1, {"CPU": 1})
    assert index.entries("a") == 1


def test_a_removal_without_a_medium_leaves_every_tier() -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], medium="GPU")))
    index.apply("a", batch(stored([1, 2], TOKENS[:8], medium="CPU_PINNED")))  # SGLang's spelling
    index.apply("a", batch(Removed(block_hashes=[1, 2])))
    assert index.query(NS, TOKENS)["a"].blocks == 0 and index.entries("a") == 0
    assert index._tiers == {}


def test_a_removal_from_a_tier_not_held_changes_nothing_and_is_counted() -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], medium="GPU")))
    index.apply("a", batch(Removed(block_hashes=[1, 2], medium="CPU")))
    assert index.query(NS, TOKENS)["a"].by_medium == {"GPU": 2}
    assert index.counters("a").unknown_removes == 2
    index.apply("a", batch(stored([1], TOKENS[:4], medium="DISK")))
    index.apply("a", batch(Removed(block_hashes=[1], medium="CPU")))
    assert index.counters("a").unknown_removes == 3
    index.apply("a", batch(Removed(block_hashes=[1], medium="GPU")))
    assert index.query(NS, TOKENS)["a"].by_medium == {"DISK": 1, "GPU": 1}


def test_copies_per_tier_survive_a_snapshot() -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], medium="GPU")))
    index.apply("a", batch(stored([1, 2], TOKENS[:8], medium="CPU")))
    loaded = load_index(dump_index(index))
    loaded.apply("a", batch(Removed(block_hashes=[1, 2], medium="GPU")))
    assert loaded.query(NS, TOKENS)["a"].by_medium == {"CPU": 2}


def test_a_vllm_full_report_of_reused_blocks_does_not_outlive_their_removal() -> None:
    # vllm/v1/core/block_pool.py emit_cached_block_events (0.33): with kv_cache_report_mode
    # "full" every hit stores its reused blocks again (parent None); eviction removes each once
    index = make(engine="vllm")
    index.apply("a", batch(stored([b"h1", b"h2"], TOKENS[:8])))
    for _ in range(3):  # three hits on the prefix
        index.apply("a", batch(stored([b"h1", b"h2"], TOKENS[:8])))
    index.apply("a", batch(Removed(block_hashes=[b"h1"]), Removed(block_hashes=[b"h2"])))
    assert index.query(NS, TOKENS)["a"].blocks == 0 and index.entries("a") == 0


@pytest.mark.parametrize("inline", [True, False], ids=["inline-path", "general-path"])
def test_a_chain_that_changes_namespace_hides_no_other_streams_blocks(inline: bool) -> None:
    """A salted block with an unsalted child (SGLang never publishes one: a radix path has one
    salt) put the child's key, the salted chain's next one, in the table under the unsalted
    namespace: another stream's same tokens under the salt were kept out of the table on that
    key (1 block of 3 matched), and stayed out after the odd blocks were removed. The child
    is now held as below a partial page: never matched, and never in the table."""
    from tests.indexer.test_index_invariants import check_invariants

    index = make()
    salted = Namespace("m", None, "A")
    if inline:  # the stream's (lora, salt) caches are warm: the child takes the inline path
        index.apply(
            "b", batch(stored([40], TOKENS[12:]), stored([41], TOKENS[12:], cache_salt="A"))
        )
    index.apply("b", batch(stored([51], TOKENS[:4], cache_salt="A")))
    out = index.apply("b", batch(stored([52], TOKENS[4:8], parent=51)))
    assert out.stored == 1 and index.query(NS, TOKENS)["b"].blocks == 0
    index.apply("a", batch(stored([81, 82, 83], TOKENS[:12], cache_salt="A")))
    got = index.query(salted, TOKENS)
    assert (got["a"].blocks, got["b"].blocks) == (3, 1)
    index.apply("b", batch(Removed(block_hashes=[51, 52])))
    assert index.query(salted, TOKENS)["a"].blocks == 3
    assert index.counters("b").unknown_removes == 0
    check_invariants(index)
    # the other order: the odd child after the salted blocks
    index.apply("b", batch(stored([51], TOKENS[:4], cache_salt="A")))
    index.apply(
        "b", batch(stored([52], TOKENS[4:8], parent=51), stored([53], TOKENS[8:12], parent=52))
    )
    assert index.query(salted, TOKENS)["a"].blocks == 3
    index.apply("a", batch(Removed(block_hashes=[81, 82, 83])))
    assert index.query(salted, TOKENS)["b"].blocks == 1 and index.query(NS, TOKENS)["b"].blocks == 0
    check_invariants(index)
