"""The replay buffer of one KV-event stream: the last batches, bounded in count and in bytes.

SGLang keeps its last `buffer_steps` payloads as separate bytes objects, bounded in count only:
with long prompts a batch is 10-15 KB, so 10,000 of them hold 100-150 MB, and the constant
turnover of variously sized long-lived blocks fragments the heap (`kvroute bench soak`: a
reference worker's RSS crept 0.3 MB a minute with the buffer long full, 0.15 with a buffer of
1,000). Here the payloads live in one anonymous memory map used as a ring: the byte bound is
exact, no payload is a heap object of its own, and the map's pages are touched once, on the
first lap.

Batches are written one after the other; one that does not fit before the end of the map is
written at offset 0 and the tail it skipped stays unused for that lap. The oldest batches are
dropped as their bytes are overwritten (or when the count bound is reached), so what remains is
always the newest contiguous run of seqs. A batch larger than the whole map cannot be kept: the
ring then holds nothing, and a replay from before it finds the gap, as after any drop.
"""

from __future__ import annotations

import collections
import mmap

__all__ = ["ReplayRing"]


class ReplayRing:
    """The newest batches of a stream, at most `max_batches` and `max_bytes` of payload."""

    __slots__ = ("_entries", "_head", "_map", "_max_batches", "_nbytes")

    def __init__(self, *, max_batches: int, max_bytes: int) -> None:
        if max_batches < 1 or max_bytes < 1:
            raise ValueError("a replay ring needs room for at least one batch and one byte")
        self._max_batches = max_batches
        self._map = mmap.mmap(-1, max_bytes)  # anonymous: zero pages until first written
        self._entries: collections.deque[tuple[int, int, int]] = collections.deque()
        self._head = 0  # where the next payload goes
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Payload bytes held."""
        return self._nbytes

    @property
    def capacity(self) -> int:
        """The byte bound."""
        return len(self._map)

    def append(self, seq: int, payload: bytes) -> None:
        """Keep `payload` as batch `seq` (seqs increase), dropping the oldest as needed."""
        size = len(payload)
        if size > len(self._map):
            self.clear()  # it cannot be kept, so nothing older may be replayed past it
            return
        if self._head + size > len(self._map):
            # the skipped tail: batches left there from the last lap are the oldest, drop them
            while self._entries and self._entries[0][1] >= self._head:
                self._drop_oldest()
            self._head = 0
        end = self._head + size
        while self._entries and (
            len(self._entries) >= self._max_batches or self._overlaps(self._entries[0], end)
        ):
            self._drop_oldest()
        self._map[self._head : end] = payload
        self._entries.append((seq, self._head, size))
        self._nbytes += size
        self._head = end

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """(seq, payload) of every batch held with seq >= `start`, oldest first (copies)."""
        return [
            (seq, self._map[offset : offset + size])
            for seq, offset, size in self._entries
            if seq >= start
        ]

    def clear(self) -> None:
        """Hold nothing."""
        self._entries.clear()
        self._nbytes = 0
        self._head = 0

    def close(self) -> None:
        """Give the map back to the OS."""
        self.clear()
        self._map.close()

    def _overlaps(self, entry: tuple[int, int, int], end: int) -> bool:
        _, offset, size = entry
        # an empty payload occupies its offset: it is overwritten (so dropped) with that byte
        return offset < end and self._head < offset + max(size, 1)

    def _drop_oldest(self) -> None:
        _, _, size = self._entries.popleft()
        self._nbytes -= size
