"""Whose failure a pair's failed KV handoff was, told by its workers' other partners
(`PairFaults`).

Some failures of a prefill/decode pair do not say which side broke:
- the request deadline passes with both legs still waiting: SGLang's prefill answers only once
  its decode took the KV, and its decode only once the KV came, so a wedged prefill and a
  wedged decode look the same;
- a prefill answers that its KV handoff failed without saying on which side (SGLang's "Prefill
  transfer failed ... KVTransferError");
- a prefill answers that no decode came for its KV (SGLang's "timed out ... in
  KVPoll.Bootstrapping"): the decode's failure by its word, unless its own bootstrap is broken.

A broken worker fails so with every partner, a healthy one only with the broken one. So each
worker keeps the partners it failed with so since it last answered a request (an hour at
most; dropped when it leaves the pool), and at such a failure the side that failed so before
with another partner, while the other side has not, is the one to blame; otherwise the
failure's own word (the decode for "no decode came", nobody for the others). The worker
blamed explains its partners' failures with it (dropped from their records), and its own
record is spent. A pair that failed so is avoided by the next requests for a while
(`avoided`) where another pair is left: its clients go to other pairs, and a wedged worker
meets other partners.

What it cannot tell: one prefill and one decode (neither is charged: a wedged one of either
looks the same, and each is the last of its side); one side of one worker (with a single
prefill, a wedged decode is only avoided, never charged); a transient failure of a worker
followed by another worker wedging charges the first one once (its next answered request clears
its breaker's count), unless it is the last routable worker of its side, which the partners'
word never charges (`PairHooks.timed_out`).

Before (QA): a deadline was always the prefill's, and one wedged decode took every healthy
prefill out in turn; judged by "the other side answered since", a worker that merely got no
traffic (its pairs avoided) was taken for a healthy one, and the only prefill was charged for
a decode that wedged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

__all__ = ["AVOID_S", "PairFaults", "Side"]

Side = Literal["prefill", "decode"]

# a failure is evidence for an hour at most; a pair that failed is avoided for half a minute
_MEMORY_S = 3600.0
AVOID_S = 30.0
_PAIRS_KEPT = 256  # pairs avoided at once, the oldest dropped first (bounded by the fleet)


class PairFaults:
    """What each worker of pairs did since its failures whose side was not told."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # worker -> the partners it failed with so since it last answered, and when
        self._failed_with: dict[str, dict[str, float]] = {}
        self._avoid: dict[tuple[str, str], float] = {}  # (prefill, decode) -> when it failed

    def blame(
        self,
        prefill: str,
        decode: str,
        default: Side | None,
        present: Callable[[str], bool] = lambda _: True,
    ) -> tuple[Side | None, bool]:
        """The side to blame for this failure of `prefill` with `decode` (remembered), and
        whether the partners told it: the one that failed so before with another partner
        while the other has not, else `default` (None: neither). `present`: whether a
        worker is still in the pool (records of the others are dropped)."""
        now = self._clock()
        self._prune(now, present)
        # with another partner: a worker that merely got no traffic, or one pair failing
        # again, tells nothing (QA: the only prefill charged for a decode that wedged after a
        # transient failure; a healthy decode for a prefill that stalls now and then)
        prefill_before = any(w != decode for w in self._failed_with.get(prefill, {}))
        decode_before = any(w != prefill for w in self._failed_with.get(decode, {}))
        self._avoid[(prefill, decode)] = now
        if len(self._avoid) > _PAIRS_KEPT:
            del self._avoid[min(self._avoid, key=self._avoid.__getitem__)]
        if prefill_before != decode_before:
            blamed = prefill if prefill_before else decode
            for record in self._failed_with.values():
                record.pop(blamed, None)  # its partners' failures with it are explained
            # and its own record is spent: charged now, its breaker takes it from here (a
            # worker that recovers, its pairs avoided, would be blamed on it again)
            self._failed_with.pop(blamed, None)
            return ("prefill" if prefill_before else "decode"), True
        self._failed_with.setdefault(prefill, {})[decode] = now
        self._failed_with.setdefault(decode, {})[prefill] = now
        return default, False

    def answered(self, prefill: str, decode: str) -> None:
        """The pair answered a request: neither worker is broken (its record goes), and the
        pair is no longer avoided."""
        self._failed_with.pop(prefill, None)
        self._failed_with.pop(decode, None)
        self._avoid.pop((prefill, decode), None)

    def avoided(self) -> set[tuple[str, str]]:
        """The pairs that failed so less than `AVOID_S` ago."""
        if not self._avoid:
            return set()
        since = self._clock() - AVOID_S
        return {pair for pair, at in self._avoid.items() if at > since}

    def _prune(self, now: float, present: Callable[[str], bool]) -> None:
        for worker in [w for w in self._failed_with if not present(w)]:
            del self._failed_with[worker]
        for record in self._failed_with.values():
            for partner in [
                p for p, at in record.items() if now - at > _MEMORY_S or not present(p)
            ]:
                del record[partner]
        for pair in [p for p, at in self._avoid.items() if now - at > AVOID_S]:
            del self._avoid[pair]
