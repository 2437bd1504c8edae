"""Whose failure a pair's failed KV handoff was, told by what its two workers did since
(`PairFaults`).

Some failures of a prefill/decode pair do not say which side broke:
- the request deadline passes with both legs still waiting: SGLang's prefill answers only once
  its decode took the KV, and its decode only once the KV came, so a wedged prefill and a
  wedged decode look the same;
- a prefill answers that its KV handoff failed without saying on which side (SGLang's "Prefill
  transfer failed ... KVTransferError");
- a prefill answers that no decode came for its KV (SGLang's "timed out ... in
  KVPoll.Bootstrapping"): the decode's failure by its word, unless its own bootstrap is broken.

A broken worker keeps failing, a healthy one answers the requests it gets with other partners.
So each worker keeps the partners it failed with so (since its last answered request; an
hour at most), and at such a failure the side that has failed so before while the other has
not (it answered since, or never failed) is the one to blame; otherwise the failure's own word
(the decode for "no decode came", nobody for the others). A worker blamed so explains its
partners' failures with it: they are dropped from their records. Records of workers that left
the pool are dropped. A pair that failed so is avoided by the next requests for a while
(`avoided`) where another pair is left, so a wedged worker meets other partners instead of
failing the same pair again with nothing learnt.

Before (QA): a deadline was always the prefill's, and one wedged decode took every healthy
prefill out in turn; then, judged by other partners alone, a record that outlived its verdict
charged a healthy prefill, and a planner that kept picking the same pair never charged the
wedged decode.
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
        whether what the workers did told it: the one that failed so before while the other
        has not, else `default` (None: neither). `present`: whether a worker is still in the
        pool (records of the others are dropped)."""
        now = self._clock()
        self._prune(now, present)
        prefill_before = bool(self._failed_with.get(prefill))
        decode_before = bool(self._failed_with.get(decode))
        self._avoid[(prefill, decode)] = now
        if len(self._avoid) > _PAIRS_KEPT:
            del self._avoid[min(self._avoid, key=self._avoid.__getitem__)]
        if prefill_before != decode_before:
            blamed, other = (prefill, decode) if prefill_before else (decode, prefill)
            for record in self._failed_with.values():
                record.pop(blamed, None)  # its partners' failures with it are explained
            self._failed_with.setdefault(blamed, {})[other] = now
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
