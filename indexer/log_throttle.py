"""A log line said at most once per interval per key, counting the ones held back meanwhile.

A problem that repeats with every message or request (a malformed frame, a refused client, a
worker refusing its rank) would otherwise fill the log with one line each and hide the rest.
The caller asks `LogThrottle.allow` before saying a line: held back, or said with how many of
its key were held back since the last one said, so an operator can still tell one from a
thousand. The throttle only decides and counts; the caller logs, at its own level and words.

It lives in the indexer, the lowest package, so the router's listener and notices use it too.
The reference workers may import only the indexer's wire protocol and engine specs
(DESIGN.md section 1), so `workers.listener` keeps its own one-key copy.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["LogThrottle"]


class LogThrottle:
    """Allows one line per key per `interval_s` and counts the lines it held back, per key.

    At most `max_keys` keys are remembered (keys are workers or clients that come and go):
    a new one beyond that forgets the key said longest ago, whose interval is the likeliest to
    have run out; forgotten, its next line is said at once and its held-back count is lost.
    """

    __slots__ = ("_clock", "_interval_s", "_max_keys", "_said")

    def __init__(
        self,
        interval_s: float,
        *,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, not {max_keys}")
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        # per key: when its last line was said, and how many were held back since; in the
        # order they were last said (oldest first), so the first is the one to forget
        self._said: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def allow(self, key: str) -> int | None:
        """None: hold this line back (one of `key`'s was said less than an interval ago);
        else say it, and this many of `key`'s lines were held back since the last one said."""
        now = self._clock()
        last, held_back = self._said.get(key, (None, 0))
        if last is not None and now - last < self._interval_s:
            self._said[key] = (last, held_back + 1)  # keeps its place: said no later
            return None
        if last is not None:
            self._said.move_to_end(key)
        elif len(self._said) >= self._max_keys:
            self._said.popitem(last=False)
        self._said[key] = (now, 0)
        return held_back

    def __len__(self) -> int:
        """How many keys are remembered (at most `max_keys`)."""
        return len(self._said)
