"""Events a stream of unknown page size holds back until a page proves the size.

SGLang says its page size only in each `BlockStored`'s `block_size`, and 0.5.23 sends one
event per page (`KVCacheEventRecorder.record_store`), a node's trailing partial page among
them with `block_size` = its own length. A stream that took its size from its first one-page
store learned a short prompt's partial page as the page size: every later full page was a
mismatch, nothing more was indexed, and the partial page matched as a whole block. So a lone
page proves nothing. The stream's events wait here, in order, until one proves a page whole,
and are then applied as if the size had been configured (`BatchWriter`). The proofs:
- a store of several pages: the engine cuts pages at its page size, a partial one only last
  and in an event of its own;
- a store chained on a held one-page store: a partial page ends its node, nothing hangs off
  it, so a page with a child is whole.

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

    __slots__ = ("events", "pages")

    def __init__(self) -> None:
        self.events: deque[Stored | Removed | Unreadable] = deque()
        # engine hash -> size of a held one-page store: a store chained on it proves the size
        self.pages: dict[BlockHash, int] = {}

    def hold(self, ev: Stored | Removed | Unreadable) -> int:
        """Keep `ev` for later; returns how many of the oldest events went to make room."""
        self.events.append(ev)
        if type(ev) is Stored and len(ev.block_hashes) == 1 and len(ev.token_ids) == ev.block_size:
            self.pages[ev.block_hashes[0]] = ev.block_size
        if len(self.events) <= HELD_LIMIT:
            return 0
        gone = self.events.popleft()
        if type(gone) is Stored:
            # a newer store of the same hash may still be held: losing its proof only waits
            for h in gone.block_hashes:
                self.pages.pop(h, None)
        return 1


def proven_page_size(ev: Stored, held: HeldEvents | None) -> int | None:
    """The page size `ev` proves (see the module docstring), None if it proves none."""
    if len(ev.block_hashes) > 1:
        return ev.block_size
    if held is None or ev.parent is None:
        return None
    parent_page = held.pages.get(ev.parent)
    if parent_page is None or ev.block_size > parent_page:
        return None  # a child's page is a whole one or its node's partial last: never larger
    return parent_page
