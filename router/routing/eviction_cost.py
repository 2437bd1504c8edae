"""What placing a request on a worker costs the fleet's cache: the hot prefixes it evicts.

Under KV pressure the uncached tokens a request brings to a worker push out that worker's
least recently used blocks. A block that was reused there (a prefix asked for again) and that
no other worker holds is a future hit the fleet loses: the request that asks for it next pays
its prefill again. A fleet should hold the union of its hot prefixes, not several copies of
one, so the `kv` score charges each candidate for those blocks:

    victims = the blocks evicted by this request's own allocation, after the ones the
              requests ahead of it evict (`router.routing.admission`), oldest first, never
              the prefix it reuses there (the worker locks that before it allocates)
    cost    = block_size * (victims used by two or more decisions here, held nowhere else)

and `score -= eviction_weight * cost` (`[policy] eviction_weight`; 0 turns it off). Hotness
is what the router can see: how many of its own decisions used the block on that stream
(`RecencyBook.reused`); sole holding is what the index says (every stream's events).

Pure and synchronous: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import msgspec

from router.routing.admission import AdmissionForecast, RecencyBook

__all__ = ["EvictionCost", "eviction_cost"]


class EvictionCost(msgspec.Struct, gc=False):
    """The charge of one candidate, with what it counts (shown by /admin/route)."""

    evicted_tokens: int  # what this request's own allocation evicts there
    hot_tokens: int  # of those, blocks reused there
    sole_hot_tokens: int  # of those, blocks no other worker holds: the charge
    why: str = ""


def eviction_cost(
    *,
    admission: AdmissionForecast,
    new_tokens: int,
    block_size: int | None,
    book: RecencyBook | None,
    holder_counts: Callable[[Sequence[int]], list[int]],
    reused: Callable[[], Collection[int]] = frozenset,
) -> EvictionCost:
    """The hot blocks a request bringing `new_tokens` uncached tokens evicts on a stream;
    `reused` gives the book's keys of the prefix it is predicted to reuse there (called only
    when it evicts): those are locked at its admission, so the next oldest go instead."""
    capacity = admission.capacity_tokens
    if capacity is None or not block_size:
        return EvictionCost(0, 0, 0, "capacity unknown: no eviction charge")
    before = admission.held_tokens + admission.queued_tokens - capacity
    after = before + new_tokens
    if after <= 0:
        return EvictionCost(0, 0, 0, f"its {new_tokens} new tokens fit without evicting")
    skip = max(0, before) // block_size  # evicted anyway, by the requests ahead
    mine = -(-after // block_size) - skip
    evicted = mine * block_size
    if book is None:
        return EvictionCost(evicted, 0, 0, "evicts blocks no decision used: nothing hot")
    # blocks the book does not know are older than all it knows: evicted first, and cold
    untracked = max(0, admission.held_tokens // block_size - len(book))
    start = max(0, skip - untracked)
    count = max(0, mine - max(0, untracked - skip))
    own = reused()
    # a multi-turn conversation's earlier turn is often the oldest thing on its holder: taking
    # it for a victim would charge the holder for the very prefix the request comes to reuse
    oldest = book.oldest(start + count + len(own))
    victims = [key for key in oldest if key not in own][start : start + count]
    hot = [key for key in victims if book.reused(key)]
    sole = sum(1 for n in holder_counts(hot) if n <= 1) if hot else 0
    return EvictionCost(
        evicted,
        len(hot) * block_size,
        sole * block_size,
        f"its {new_tokens} new tokens evict {evicted}: {len(hot) * block_size} reused here, "
        f"{sole * block_size} of them held by no other worker",
    )
