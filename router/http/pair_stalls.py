"""Whom a pair's request deadline is charged to when neither leg answered (`PairStalls`).

SGLang's prefill answers only once its decode took the KV, and its decode only once the KV
came: when the request deadline passes with both legs still waiting, a wedged prefill and a
wedged decode look the same. Charging the prefill alone (as before) let one wedged decode take
every healthy prefill out in turn, each paired with it for `breaker.failure_threshold` of its
requests; charging the decode alone does the same to decodes behind a wedged prefill.

What tells them apart is the partner: a wedged worker stalls with every worker it is paired
with, a healthy one only with the wedged one. So each such stall is remembered for a while,
and a side seen stalled before with another partner (while the other side was not) is the
one charged; otherwise the prefill is, as before (its KV is what the decode waits for).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Literal

__all__ = ["PairStalls"]

Side = Literal["prefill", "decode"]

# stalls remembered: a wedged worker's requests stall one request deadline apart at most (its
# queue fills at once), so an hour and the last 64 cover it without growing with the fleet
_MEMORY_S = 3600.0
_KEPT = 64


class PairStalls:
    """The recent pairs whose request deadline passed with neither leg answered."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: deque[tuple[str, str, float]] = deque(maxlen=_KEPT)

    def charge(self, prefill: str, decode: str) -> Side:
        """The side to charge for this stall of `prefill` with `decode` (remembered)."""
        now = self._clock()
        while self._seen and now - self._seen[0][2] > _MEMORY_S:
            self._seen.popleft()
        decode_before = any(d == decode and p != prefill for p, d, _ in self._seen)
        prefill_before = any(p == prefill and d != decode for p, d, _ in self._seen)
        self._seen.append((prefill, decode, now))
        return "decode" if decode_before and not prefill_before else "prefill"
