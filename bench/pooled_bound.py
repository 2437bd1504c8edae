"""The physical limit of a fleet's hit rate: one pooled cache with the whole fleet's capacity.

A router can only choose which worker's cache a request meets; whatever it chooses, the fleet
holds at most its total capacity, split into partitions a prefix cannot span. One cache of that
total capacity (same page size, the reference worker's own LRU radix cache), fed the same trace
in arrival order, each request finding its prefix and then caching its prompt and output as a
finished request does, needs no routing at all. Partitioning it can only lose: a prefix
copied into two workers takes twice the room, and a prefix on the wrong worker is a miss. It is
offline and sequential (every request has finished before the next arrives), so it also ignores
the siblings that miss because the first one is still in prefill: a ceiling, not a target.
(LRU is not optimal, so a partition can in principle beat it on a pathological trace; the
oracle's column says how far routing gets in practice.)
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.workloads import BenchRequest
from workers.cache import Namespace, PagedRadixCache
from workers.scheduler import deterministic_output

__all__ = ["pooled_hit_rate"]


def pooled_hit_rate(
    requests: Sequence[BenchRequest], *, page_size: int, capacity_tokens: int
) -> float:
    """Hit rate (cached / prompt tokens) of one LRU cache of `capacity_tokens` on `requests`."""
    cache = PagedRadixCache(page_size=page_size, capacity_tokens=capacity_tokens)
    cached = prompt = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        namespace = Namespace(cache_salt=request.cache_salt)
        ids = request.input_ids
        # the last prompt token is always computed, as on the workers
        cached += cache.match(namespace, ids[:-1]).length
        prompt += len(ids)
        output = deterministic_output(ids, request.max_new_tokens)
        cache.insert(namespace, [*ids, *output[:-1]])
        cache.take_events()
    return cached / prompt if prompt else 0.0
