"""Events a stream of unknown page size holds back until a page proves the size.

SGLang says its page size only in each `BlockStored`'s `block_size`, and 0.5.23 sends one
event per page (`KVCacheEventRecorder.record_store`: a node's key cut into pages of the page
size from the node's start, each page chained on the one before it, one event each, in a row),
a node's trailing partial page among them with `block_size` = its own length. A stream that
took its size from its first one-page store learned a short prompt's partial page as the page
size: every later full page was a mismatch, nothing more was indexed, and the partial page
matched as a whole block. So a lone page proves nothing. The stream's events wait here, in
order, until one proves a page whole, and are then applied as if the size had been configured
(`BatchWriter`). The proofs:
- a store of several pages: the engine cuts pages at its page size, a partial one only last;
- a run: a one-page store directly followed, in the same batch, by a one-page store chained on
  it, no larger: `record_store` emits a node's pages in a row, so a page that the next event
  of its batch continues is not its node's last, and only a node's last page can be partial.
  A child in a later batch proves nothing: it is another node, and a node that ends on a
  partial page can have one (the `_insert_helper` of a tree whose nodes need not end on a
  page boundary hangs a new node on whatever node the key stops in). 0.5.23's `RadixCache`
  page-aligns every key it inserts (`RadixKey.page_aligned` in `insert`, `_insert_cache`) and
  splits only at page-rounded matches, so there no node ends mid-page at all; the rule does
  not lean on that, only on how `record_store` lays out one node. (Two nodes chained, the
  first ending mid-page, published in a row in one batch would still pass: that takes a tree
  that ends nodes mid-page and two such inserts back to back.) Before: any one-page store
  chained on a held one proved it, so a 2-token partial page with a 2-token child in a later
  batch set the size to 2: every later 4-token page was a mismatch and the 2-token pages
  matched as whole blocks.

Bounded: past `HELD_LIMIT` events the oldest go (counted as skipped events), and a store
chained on one of them is later an unknown parent: a missed hit, never a false one.
"""

from __future__ import annotations

from collections import deque

from indexer.protocol.events import BlockHash, Removed, Stored, Unreadable

__all__ = ["HELD_LIMIT", "HeldEvents", "proven_page_size"]

# a stream whose first node of two pages or more proves the size holds one page; this only
# bounds a worker that long serves nothing longer than a page
HELD_LIMIT = 4096


class HeldEvents:
    """One stream's events since it was seen, held while its page size is unknown."""

    __slots__ = ("events", "pages", "tail")

    def __init__(self) -> None:
        self.events: deque[Stored | Removed | Unreadable] = deque()
        # engine hash -> size of a held one-page store: a store chained on it proves the size
        self.pages: dict[BlockHash, int] = {}
        # the hash of the last event held, when it was a one-page store of this batch: the
        # next one of the batch chained on it continues its run (None: anything else)
        self.tail: BlockHash | None = None

    def new_batch(self) -> None:
        """A batch begins: a page held before it is no run a store of this batch continues."""
        self.tail = None

    def hold(self, ev: Stored | Removed | Unreadable) -> int:
        """Keep `ev` for later; returns how many of the oldest events went to make room."""
        self.events.append(ev)
        self.tail = None
        if type(ev) is Stored and len(ev.block_hashes) == 1 and len(ev.token_ids) == ev.block_size:
            self.pages[ev.block_hashes[0]] = ev.block_size
            self.tail = ev.block_hashes[0]
        if len(self.events) <= HELD_LIMIT:
            return 0
        gone = self.events.popleft()
        if type(gone) is Stored:
            # a newer store of the same hash may still be held: losing its proof only waits
            for h in gone.block_hashes:
                self.pages.pop(h, None)
        return 1

    def dropped(self) -> int:
        """How many events are held (what a clear or a snapshot without them drops)."""
        return len(self.events)


def proven_page_size(ev: Stored, held: HeldEvents | None) -> int | None:
    """The page size `ev` proves (see the module docstring), None if it proves none."""
    if len(ev.block_hashes) > 1:
        return ev.block_size
    if held is None or ev.parent is None or held.tail != ev.parent:
        return None  # not the next page of a run the batch is publishing
    parent_page = held.pages.get(ev.parent)
    if parent_page is None or ev.block_size > parent_page:
        return None  # a run's page is a whole one or its node's partial last: never larger
    return parent_page
