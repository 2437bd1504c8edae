"""The keys a stream's recent removals took, for as long as a pending mark can arrive late.

Another replica's decision reaches a replica after the fact (NATS, a stalled loop): its worker
may have stored the request's pages and removed them meanwhile, and the mark, taken as it
comes, would then predict pages that are gone. A removal of a page after the mark was made
refuses the mark of that block (`PrefixIndex.add_pending`): exact per block, at any lateness,
and a removal of other pages of the stream refuses nothing. Kept only in a replica of a
cluster (`PrefixIndex.log_removals`).

Only a removal whose pages the index knew is kept here (it is the only kind that names block
keys); a removal of unknown pages, or an event that did not decode, dates the stream's
`unknown_removed_at` instead, which refuses whole a mark held up past `LATE_MARK_S`.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

__all__ = ["RemovalLog"]

# the most removed keys one question reads: a mark made before more than this many is refused
# whole (what they took is not read). Marks on time read none or a few; after a NATS stall the
# held decisions come all at once, each older than the last, and reading each one's whole
# window (QA: 24 ms a mark at 50,000 removed keys a second) held the replica's loop for seconds
MOST_KEYS_READ = 4096


class RemovalLog:
    """The keys of each removal batch and its time (the index's clock), over a sliding window.

    Kept as the batches came, not per key: a removal costs one append (the index applies them
    at its full event rate), and a question (another replica's mark, a few a request in a
    cluster) reads only the batches since the mark was made, most often none or a few. The
    keys are packed and the times apart from them: nothing kept is an object the garbage
    collector walks (tuples or lists of ints held for the window made its collections sweep
    them over and over, and cost the index a third of its apply rate)."""

    __slots__ = ("_keys", "_times")

    def __init__(self) -> None:
        self._times: deque[float] = deque()
        self._keys: deque[array[int]] = deque()  # one for each of `_times`

    def __len__(self) -> int:
        return len(self._times)

    def add(self, keys: Sequence[int], now: float) -> None:
        """`keys` left the stream at `now` (times never go back)."""
        if keys:
            self._times.append(now)
            self._keys.append(array("q", keys))  # the index's keys are signed 64-bit

    def forget_before(self, cutoff: float) -> None:
        """Drop the removals made before `cutoff` (no mark that old is taken)."""
        times, keys = self._times, self._keys
        while times and times[0] < cutoff:
            times.popleft()
            keys.popleft()

    def clear(self) -> None:
        """Forget every removal (the stream was cleared: every mark before then is refused)."""
        self._times.clear()
        self._keys.clear()

    def gone_since(self, keys: Sequence[int], since: float) -> list[bool] | None:
        """For each of `keys`, whether it left the stream after `since`; None: none did. All
        of them, when more than `MOST_KEYS_READ` keys were removed since (not read: fail
        closed)."""
        times, batches = self._times, self._keys
        gone: set[int] = set()
        read = 0
        at = len(times) - 1
        while at >= 0 and times[at] > since:
            removed = batches[at]
            read += len(removed)
            if read > MOST_KEYS_READ:
                return [True] * len(keys)
            gone.update(removed)
            at -= 1
        if not gone or gone.isdisjoint(keys):
            return None
        return [key in gone for key in keys]
