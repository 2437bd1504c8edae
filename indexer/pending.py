"""Pending entries: a request's prefix marked "on its way to stream S" at routing time.

A burst of sibling requests should follow the first one to the worker that is about to cache
the shared prefix, before that worker's `BlockStored` arrives. The router marks the prefix as
pending on the chosen stream; entries expire after a TTL (the clock is injected so tests control
time) and a real store of the same key on the same stream replaces them.

Layout: `bits` maps a block key to `(stream-slot bitmask << shift) | fill`, the same shape as
the index's table values (the index fills in the namespace code), so the query ORs and ANDs
both in the same C-level pass. Expiry is a
FIFO of (deadline, key, slot): the TTL is constant, so deadlines are ordered and expiring is
amortized O(1) per entry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from indexer.int_map import PyIntMap

__all__ = ["PendingTable"]


class PendingTable:
    """Block key -> stream-slot bitmask with per-(key, slot) deadlines."""

    __slots__ = ("_clock", "_deadline", "_fifo", "_fill", "_shift", "bits", "max_entries", "ttl_s")

    def __init__(
        self,
        clock: Callable[[], float],
        ttl_s: float,
        max_entries: int = 1_000_000,
        *,
        shift: int = 0,
        fill: int = 0,
        int_map: type[PyIntMap] = PyIntMap,
    ) -> None:
        self._clock = clock
        self._shift = shift
        self._fill = fill
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.bits = int_map(False)  # the backend's map: queries read it like the table
        # (key, slot) -> (deadline, namespace id)
        self._deadline: dict[tuple[int, int], tuple[float, int]] = {}
        self._fifo: deque[tuple[float, int, int]] = deque()

    def __len__(self) -> int:
        return len(self._deadline)

    def add(self, keys: Iterable[int], slot: int, ns_id: int, fill: int | None = None) -> int:
        """Mark `keys` pending on stream `slot` until now + TTL; returns how many were marked.

        `fill` (default: the table's) is ORed into the low bits of each key's value; the index
        passes the namespace's code so a query can tell another namespace's pending entry.
        """
        if self.ttl_s <= 0:
            return 0
        deadline = self._clock() + self.ttl_s
        bit = (1 << (slot + self._shift)) | (self._fill if fill is None else fill)
        bits = self.bits
        marked = 0
        for key in keys:
            if len(self._deadline) >= self.max_entries:
                break
            bits[key] = bits.get(key, 0) | bit
            self._deadline[(key, slot)] = (deadline, ns_id)
            self._fifo.append((deadline, key, slot))
            marked += 1
        return marked

    def expire(self) -> None:
        """Drop every entry whose deadline has passed."""
        fifo = self._fifo
        if not fifo:
            return
        now = self._clock()
        while fifo and fifo[0][0] <= now:
            deadline, key, slot = fifo.popleft()
            # a later add() of the same (key, slot) moved its deadline: this record is stale
            entry = self._deadline.get((key, slot))
            if entry is not None and entry[0] == deadline:
                self.discard(key, slot)

    def discard(self, key: int, slot: int) -> None:
        """Forget one (key, slot) entry, e.g. because the real block arrived."""
        if self._deadline.pop((key, slot), None) is None:
            return
        rest = self.bits.get(key, 0) & ~(1 << (slot + self._shift))
        if rest >> self._shift:
            self.bits[key] = rest
        else:
            self.bits.pop(key, None)

    def discard_slot(self, slot: int) -> None:
        """Forget every entry of one stream slot (the slot is being dropped or reused)."""
        for key, entry_slot in [ks for ks in self._deadline if ks[1] == slot]:
            self.discard(key, entry_slot)

    def namespaces(self) -> set[int]:
        """Ids of the namespaces that have entries (expired ones included until `expire`)."""
        return {ns_id for _, ns_id in self._deadline.values()}

    def discard_namespace(self, ns_id: int) -> None:
        """Forget every entry of one namespace (it is being evicted)."""
        for key, slot in [ks for ks, entry in self._deadline.items() if entry[1] == ns_id]:
            self.discard(key, slot)

    def clear(self) -> None:
        """Forget everything."""
        self.bits.clear()
        self._deadline.clear()
        self._fifo.clear()
