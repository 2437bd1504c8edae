"""The physical limit of a fleet's hit rate: one pooled cache with the whole fleet's capacity.

A router can only choose which worker's cache a request meets; whatever it chooses, the fleet
holds at most its total capacity, split into partitions a prefix cannot span. One cache of that
total capacity (same page size, the reference worker's own LRU radix cache), fed the same trace
in arrival order, each request finding its prefix and then caching its prompt and output as a
finished request does, needs no routing at all. Partitioning it mostly loses: a prefix
copied into two workers takes twice the room, and a prefix on the wrong worker is a miss. It is
offline and sequential (every request has finished before the next arrives), so it also ignores
the siblings that miss because the first one is still in prefill: a reference, not a target.
It is not a strict bound either: LRU is not optimal eviction, and the live fleet touches its
caches in another order, so routers have reached a few percent above it
(docs/benchmarks/routing.md); the oracle's column says how far greedy longest-match routing
gets.

The same replay gives a floor for the time to first token: each request's uncached tokens,
prefilled alone with no queue ahead (`ttft_floor_p90_ms`).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.routing_results import percentile
from bench.workloads import BenchRequest
from workers.cache import Namespace, PagedRadixCache
from workers.scheduler import deterministic_output

__all__ = ["pooled_replay", "replay_hit_rate", "ttft_floor_p90_ms"]


def pooled_replay(
    requests: Sequence[BenchRequest], *, page_size: int, capacity_tokens: int
) -> list[tuple[int, int]]:
    """(cached, prompt) tokens of each request, in arrival order, on one LRU cache of
    `capacity_tokens`."""
    cache = PagedRadixCache(page_size=page_size, capacity_tokens=capacity_tokens)
    out: list[tuple[int, int]] = []
    for request in sorted(requests, key=lambda r: r.arrival_s):
        namespace = Namespace(cache_salt=request.cache_salt)
        ids = request.input_ids
        # the last prompt token is always computed, as on the workers
        out.append((cache.match(namespace, ids[:-1]).length, len(ids)))
        output = deterministic_output(ids, request.max_new_tokens)
        cache.insert(namespace, [*ids, *output[:-1]])
        cache.take_events()
    return out


def replay_hit_rate(replay: Sequence[tuple[int, int]]) -> float:
    """Cached / prompt tokens of a `pooled_replay`."""
    prompt = sum(p for _, p in replay)
    return sum(c for c, _ in replay) / prompt if prompt else 0.0


def ttft_floor_p90_ms(replay: Sequence[tuple[int, int]], prefill_ms_per_token: float) -> float:
    """The 90th percentile of each request's time to first token with the pooled cache's hit
    and no queue: its own uncached tokens prefilled alone (no router, no wait, no batch-mates).

    A router's TTFT p90 cannot go much below it (LRU is not optimal, so a partition can hit a
    little more on some traces, as with the hit rate); a baseline within 2x of it leaves no
    room for a router at half the baseline's p90.
    """
    floor = percentile([(p - c) * prefill_ms_per_token for c, p in replay], 90)
    return 0.0 if floor is None else floor
