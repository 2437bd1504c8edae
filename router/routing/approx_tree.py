"""A prefix tree of past routing decisions, without KV events: the `approx_tree` baseline's memory.

SGLang's router keeps an approximate radix tree of the request text it sent to each worker and
assumes the worker still caches it. This is the same idea over token ids at chunk granularity: a
prompt is cut into `chunk_tokens`-token chunks, each chunk is keyed by a hash chained over the
chunks before it (so a key stands for a whole prefix), and every key remembers which workers
were sent that prefix. It never learns about evictions, which is exactly the weakness the
event-driven `kv` policy is measured against. Pure: no I/O, bounded by an LRU cap on keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

__all__ = ["ApproxTree"]


class ApproxTree:
    """Longest routed prefix per worker, from past decisions only."""

    def __init__(self, chunk_tokens: int = 16, max_chunks: int = 1_000_000) -> None:
        self._chunk = chunk_tokens
        self._max = max_chunks
        # prefix key -> workers that were sent this prefix (dict as an ordered set)
        self._keys: OrderedDict[int, dict[str, None]] = OrderedDict()
        self._sizes: dict[str, int] = {}

    def _chunks(self, tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
        """(prefix key, tokens covered) per chunk; the last chunk may be short."""
        key = 0
        for start in range(0, len(tokens), self._chunk):
            end = min(start + self._chunk, len(tokens))
            key = hash((key, tuple(tokens[start:end])))
            yield key, end

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """Tokens of `tokens` each worker was previously sent as a prefix (absent = 0)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for key, end in self._chunks(tokens):
            holders = self._keys.get(key)
            if not holders:
                break
            alive = set(holders) if alive is None else alive.intersection(holders)
            if not alive:
                break
            for worker in alive:
                matched[worker] = end
        return matched

    def insert(self, tokens: Sequence[int], worker: str) -> None:
        """Remember that `tokens` were routed to `worker`."""
        for key, _ in self._chunks(tokens):
            holders = self._keys.get(key)
            if holders is None:
                holders = self._keys[key] = {}
            else:
                self._keys.move_to_end(key)
            if worker not in holders:
                holders[worker] = None
                self._sizes[worker] = self._sizes.get(worker, 0) + 1
        while len(self._keys) > self._max:
            _, evicted = self._keys.popitem(last=False)
            for w in evicted:
                self._sizes[w] -= 1

    def remove_worker(self, worker: str) -> None:
        """Forget everything routed to `worker` (it left the pool)."""
        for key in [k for k, holders in self._keys.items() if worker in holders]:
            holders = self._keys[key]
            del holders[worker]
            if not holders:
                del self._keys[key]
        self._sizes.pop(worker, None)

    def workers(self) -> list[str]:
        """Every name anything was ever routed to and not removed since."""
        return list(self._sizes)

    def size(self, worker: str) -> int:
        """Chunks currently attributed to `worker` (SGLang's 'smallest tree' tie-break)."""
        return self._sizes.get(worker, 0)

    def __len__(self) -> int:
        return len(self._keys)
