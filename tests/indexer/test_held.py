"""A stream of unknown page size learns it only from a page proven whole (`indexer.index.held`).

SGLang 0.5.23 publishes one `BlockStored` per page, a node's trailing partial page among them
with its own length as `block_size`. A worker whose first store was a short prompt's partial
page (2 tokens of a 4-token page) had the stream learn size 2: every later full page was a
mismatch (a 12-token prefix predicted nothing, for good), and the partial page matched as a
whole block (a false hit).
"""

from __future__ import annotations

import logging

import pytest
import zmq.asyncio

from indexer.index import PrefixIndex, held
from indexer.namespace import Namespace
from indexer.protocol.events import BlockHash, Cleared, Event, EventBatch, Removed, Stored, TokenId
from indexer.service import IndexerService
from indexer.snapshot import dump_index, load_index
from tests.indexer.scripted import ScriptedPublisher
from tests.indexer.test_subscriber_zmq import CONFIG, STREAM, WORKER, connect, wait_until

NS = Namespace("m")
TOKENS: list[TokenId] = list(range(100, 116))  # 4 pages of 4
SHORT: list[TokenId] = [7, 8]  # a 2-token prompt: a partial page of a 4-token page


def page(h: int, tokens: list[TokenId], parent: int | None = None, size: int = 4) -> Stored:
    """One store of `tokens` in pages of `size` (hashes h, h + 1, ...)."""
    n = max(1, len(tokens) // size)
    hashes: list[BlockHash] = list(range(h, h + n))
    return Stored(block_hashes=hashes, parent=parent, token_ids=tokens, block_size=size)


def apply(index: PrefixIndex, *events: Event) -> None:
    index.apply("s", EventBatch(0.0, list(events)))


def unsized() -> PrefixIndex:
    index = PrefixIndex()
    index.add_stream("s", model="m")  # no block_size: configured nowhere, advertised nowhere
    return index


def test_a_partial_page_first_does_not_set_the_page_size() -> None:
    """SGLang's one event per page: the size comes from the first run of pages in a batch."""
    index = unsized()
    apply(index, page(9, SHORT, size=2))
    assert index.block_size("s") is None and index.entries("s") == 0
    assert index.query(NS, [*SHORT, 1, 2, 3])["s"].blocks == 0  # not a false hit meanwhile
    apply(index, page(1, TOKENS[:4]))  # a lone full page shows nothing either
    assert index.block_size("s") is None
    apply(index, page(2, TOKENS[4:8], parent=1), page(3, TOKENS[8:12], parent=2))
    assert index.block_size("s") == 4
    assert index.query(NS, TOKENS)["s"].blocks == 3
    # the partial page is held as one (`entries`), never as a block a request matches
    assert index.entries("s") == 4 and index.query(NS, [*SHORT, 1, 2])["s"].blocks == 0
    assert index.counters("s").block_size_mismatches == 0
    assert index.counters("s").blocks_stored == 4


def test_a_store_of_several_pages_shows_the_size() -> None:
    index = unsized()
    apply(index, page(9, SHORT, size=2))
    apply(index, page(1, TOKENS[:12]))  # three pages in one event (coalescing versions)
    assert index.block_size("s") == 4 and index.query(NS, TOKENS)["s"].blocks == 3
    assert index.entries("s") == 4 and index.counters("s").block_size_mismatches == 0


def test_a_partial_child_proves_its_parent_whole() -> None:
    index = unsized()
    apply(index, page(1, TOKENS[:4]), page(2, TOKENS[4:6], parent=1, size=2))
    assert index.block_size("s") == 4 and index.query(NS, TOKENS)["s"].blocks == 1
    assert index.entries("s") == 2


def test_a_child_in_a_later_batch_does_not_prove_a_partial_parent_whole() -> None:
    """A 2-token partial page, then a 2-token store chained on it in a later batch: the chain
    proved the page whole, the stream learned size 2, every later 4-token page was a mismatch
    and [7, 8, ...] was predicted 2 tokens. A child in a later batch is another node, which
    may hang off a partial page: only a run within one batch (one node's pages) proves."""
    index = unsized()
    apply(index, page(1, SHORT, size=2))
    apply(index, page(2, [9, 10], parent=1, size=2))
    assert index.block_size("s") is None and index.entries("s") == 0
    assert index.query(NS, [7, 8, 9, 10, 11])["s"].blocks == 0
    apply(index, page(11, TOKENS[:4]), page(12, TOKENS[4:8], parent=11))
    assert index.block_size("s") == 4 and index.query(NS, [*TOKENS, 999])["s"].blocks == 2
    assert index.counters("s").block_size_mismatches == 0


def test_a_page_the_next_event_does_not_continue_proves_nothing() -> None:
    """Within one batch too, a chained store proves its parent whole only as the event right
    after it (the next page of the run `record_store` publishes for one node)."""
    index = unsized()
    apply(index, page(1, SHORT, size=2), page(5, [50, 51], size=2), page(2, [9, 10], 1, 2))
    assert index.block_size("s") is None


def test_a_child_larger_than_its_parent_proves_nothing() -> None:
    """A page is whole or its node's partial last one, so never larger than a whole page."""
    index = unsized()
    apply(index, page(1, SHORT, size=2), page(2, TOKENS[:4], parent=1))
    assert index.block_size("s") is None and index.entries("s") == 0


def test_held_events_apply_in_order_once_the_size_is_known() -> None:
    """Removals and clears wait with the stores: the outcome is the configured stream's."""
    index = unsized()
    apply(index, page(1, TOKENS[:4]), Removed(block_hashes=[1]))
    apply(index, Removed(block_hashes=[77]))  # a page never stored
    apply(index, page(5, TOKENS[:4]), page(6, TOKENS[4:8], parent=5))  # a run proves the size
    assert index.block_size("s") == 4 and index.query(NS, TOKENS)["s"].blocks == 2
    c = index.counters("s")
    assert (c.blocks_stored, c.blocks_removed, c.unknown_removes) == (3, 1, 1)
    configured = PrefixIndex()
    configured.add_stream("s", model="m", block_size=4)
    apply(configured, page(1, TOKENS[:4]), Removed(block_hashes=[1]))
    apply(configured, Removed(block_hashes=[77]), page(5, TOKENS[:4]))
    apply(configured, page(6, TOKENS[4:8], parent=5))
    assert configured.counters("s") == c and configured.entries("s") == index.entries("s")

    cleared = unsized()
    apply(cleared, page(1, TOKENS[:4]), Cleared(), page(2, TOKENS[4:8], parent=1))
    assert cleared.block_size("s") is None  # its parent went with the clear
    apply(cleared, page(3, TOKENS[8:12], parent=2), page(4, TOKENS[12:16], parent=3))
    assert cleared.block_size("s") == 4 and cleared.entries("s") == 0
    assert cleared.counters("s").unknown_parents == 3


def test_a_size_told_later_applies_what_was_held() -> None:
    index = unsized()
    apply(index, page(1, TOKENS[:4]))
    index.add_stream("s", model="m", block_size=4)  # e.g. the config, reloaded
    assert index.entries("s") == 1 and index.counters("s").blocks_stored == 1
    assert index.query(NS, TOKENS)["s"].blocks == 1


def test_vllm_one_page_stores_are_skipped_not_held() -> None:
    index = PrefixIndex()
    index.add_stream("s", model="m", engine="vllm")
    apply(index, page(1, TOKENS[:4]), page(2, TOKENS[4:8], parent=1))
    assert index.block_size("s") is None and index.counters("s").skipped_events == 2


def test_what_is_held_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(held, "HELD_LIMIT", 3)
    index = unsized()
    apply(index, *(page(10 + i, TOKENS[:4]) for i in range(5)))
    assert index.counters("s").skipped_events == 2
    apply(index, page(20, TOKENS[4:8], parent=10))  # its parent went for room
    assert index.block_size("s") is None and index.counters("s").skipped_events == 3
    apply(index, page(21, TOKENS[:4]), page(22, TOKENS[4:8], parent=21))
    # held were 14, 20 (whose parent is gone) and 21: a missed hit, never a false one
    assert index.block_size("s") == 4 and index.entries("s") == 3
    assert index.counters("s").unknown_parents == 1


async def test_a_worker_whose_first_store_is_a_partial_page_is_indexed(
    ctx: zmq.asyncio.Context,
) -> None:
    """The QA case end to end: a real SUB on a scripted SGLang publisher, no size anywhere."""
    query = Namespace("", None, None)
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        first = EventBatch(0.0, [page(1, SHORT, size=2)])
        assert await svc.wait_applied(WORKER, await pub.publish(first))
        assert svc.query(query, [*SHORT, 9, 10, 11])[WORKER].matched_tokens == 0
        nodes: list[Event] = [page(11, TOKENS[:4])]
        nodes += [page(12 + i, TOKENS[4 * i + 4 : 4 * i + 8], parent=11 + i) for i in range(2)]
        assert await svc.wait_applied(WORKER, await pub.publish(EventBatch(0.0, nodes)))
        assert svc.index.block_size(STREAM) == 4
        assert svc.query(query, [*TOKENS, 999])[WORKER].matched_tokens == 12
        assert svc.index.counters(STREAM).block_size_mismatches == 0


def test_a_snapshot_says_the_events_it_leaves_out(caplog: pytest.LogCaptureFixture) -> None:
    """Held events are not written: a snapshot taken while some were held dropped them
    without a word (the loaded stream waits for a proof again: a missed hit, no false one)."""
    index = unsized()
    apply(index, page(1, TOKENS[:4]), Removed(block_hashes=[77]))
    caplog.set_level(logging.WARNING, logger="indexer.snapshot")
    loaded = load_index(dump_index(index))
    assert "stream s: 2 events held while its page size is unknown are not in" in caplog.text
    assert loaded.block_size("s") is None and loaded.held_events("s") == 0


async def test_a_restart_says_the_held_events_it_drops(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart while events were held logged "cleared 0 entries", though it dropped them."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        seq = await pub.publish(EventBatch(0.0, [page(1, TOKENS[:4])]))
        assert await svc.wait_applied(WORKER, seq)
        assert svc.index.held_events(STREAM) == 1 and svc.index.entries(STREAM) == 0
        caplog.set_level(logging.WARNING, logger="indexer.stream")
        pub.restart()  # seq back to 0: a new process
        await pub.publish(EventBatch(1.0, []))  # (not the bytes of connect's seq 0)
        await wait_until(lambda: svc.streams()[0].restarts == 1)
        assert svc.index.held_events(STREAM) == 0
        assert "cleared 0 entries and 1 held events (page size still unknown)" in caplog.text
