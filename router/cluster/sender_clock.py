"""How far another replica's wall clock runs ahead of this one's, as its messages show.

A peer's decision lives what is left of the pending TTL since it was made, and one made before
the receiving stream was last cleared (or, held up, before it last removed pages) marks nothing
(`indexer.index.PrefixIndex.add_pending`). Its age is this replica's wall clock at arrival less
the sender's at publishing (`Batch.sent_at`), so a sender whose clock runs ahead made its
decisions look younger than they were: a decision NATS held up past a worker's flush could
still be marked, its age read as less than the hold (or as 0), and predicted on pages that went
with the flush. No message arrives before it was sent, so an arrival that reads earlier than its
sending says the sender's clock is ahead by at least that much: the least of the last minute's
readings, when below zero, is added to every age. It only ever makes ages older (fail closed:
marks shorter, or none), and it cannot tell a lead that no message shows (the sender ahead by
less than the messages' delay), so the replicas' clocks should still be NTP-synced.
"""

from __future__ import annotations

from collections import deque

__all__ = ["WINDOW_S", "SenderClock"]

# how long a reading counts: a sender's clock stepped back (no longer ahead) is believed ahead
# for at most this long after (ages read older: marks shorter)
WINDOW_S = 60.0


class SenderClock:
    """The least (arrival - sent) of one peer's recent messages (a sliding-window minimum)."""

    __slots__ = ("_readings",)

    def __init__(self) -> None:
        # (when read, reading), the readings rising: each the least of those read since it
        self._readings: deque[tuple[float, float]] = deque()

    def ahead_s(self, reading: float, now: float) -> float:
        """Take in one message's arrival less its sending (`reading`, seconds, by the two
        wall clocks) at `now` (this replica's monotonic clock); returns how far the sender's
        clock runs ahead at least (0: no message of the last `WINDOW_S` showed it ahead)."""
        readings = self._readings
        while readings and readings[-1][1] >= reading:
            readings.pop()
        readings.append((now, reading))
        horizon = now - WINDOW_S
        while readings[0][0] < horizon:  # never empties: the newest was read now
            readings.popleft()
        least = readings[0][1]
        return -least if least < 0 else 0.0
