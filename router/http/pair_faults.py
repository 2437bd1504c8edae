"""Whose failure a pair's failed KV handoff was, told by its partners (`PairFaults`).

Some failures of a prefill/decode pair do not say which side broke:
- the request deadline passes with both legs still waiting: SGLang's prefill answers only once
  its decode took the KV, and its decode only once the KV came, so a wedged prefill and a
  wedged decode look the same;
- a prefill answers that its KV handoff failed without saying on which side (SGLang's "Prefill
  transfer failed ... KVTransferError");
- a prefill answers that no decode came for its KV (SGLang's "timed out ... in
  KVPoll.Bootstrapping"), which is the decode's failure, unless the prefill is the one whose
  bootstrap is broken.

What tells them apart is the partner: a broken worker fails so with every worker it is paired
with, a healthy one only with the broken one. Each such failure is remembered for a while, and
a side that failed so before with another partner (while the other side had not) is the one
blamed; otherwise the failure's own default (the decode for "no decode came", nobody for the
others). Before, a deadline was always the prefill's (one wedged decode took every healthy
prefill out in turn), and a handoff failure of either side left both workers out of the retry
and charged neither (the only decode left out: the request failed with a healthy pair
untried; a prefill whose transfer engine was broken never left rotation).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Literal

__all__ = ["PairFaults", "Side"]

Side = Literal["prefill", "decode"]

# failures remembered: a broken worker fails each request paired with it (its queue fills at
# once), so an hour and the last 64 cover it without growing with the fleet
_MEMORY_S = 3600.0
_KEPT = 64


class PairFaults:
    """The recent failures of pairs whose side was not told by the failure itself."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: deque[tuple[str, str, float]] = deque(maxlen=_KEPT)

    def blame(self, prefill: str, decode: str, default: Side | None) -> Side | None:
        """The side to blame for this failure of `prefill` with `decode` (remembered): the
        one that failed so before with another partner, else `default` (None: neither)."""
        now = self._clock()
        while self._seen and now - self._seen[0][2] > _MEMORY_S:
            self._seen.popleft()
        decode_before = any(d == decode and p != prefill for p, d, _ in self._seen)
        prefill_before = any(p == prefill and d != decode for p, d, _ in self._seen)
        self._seen.append((prefill, decode, now))
        if decode_before != prefill_before:
            return "decode" if decode_before else "prefill"
        return default
