"""Other replicas' `extra_key` shadows for a server no worker is followed at here yet.

A replica that adds a worker (an admin rename, an id deleted and added again, a reload) routes
`extra_key` requests to it as soon as it is registered there, and publishes a shadow for each
(`router.cluster`). Another replica may still be registering it (reading its `/server_info`,
subscribing: some milliseconds on loopback, seconds for a slow worker), or not have it in its
pool yet: no stream here to shadow them on. Dropped, those shadows left the pages their
requests stored to be predicted to plain requests once the worker was followed here (QA: 288
tokens predicted, 0 cached). They wait here, by the server's URL (`WorkerEntry.server`, spelled
as every replica spells it), for the worker added there next (`IndexerService.add_worker`),
each for `RESTART_DOUBT_S` after it came (the caller says when that began).

Bounded: past `most` shadows (of every URL together), the oldest go, and the URL it was for
is marked as having forgotten one, until when the forgotten ones would have been kept (a
worker added there within the doubt of that is hidden whole until then: fail closed); past
`most` URLs so marked, every URL is.

Pure bookkeeping: the service feeds it and asks it; no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from indexer.namespace import Namespace

__all__ = ["Waiting", "WaitingShadows"]


class Waiting(NamedTuple):
    """One shadow waiting for its server's worker: its namespace (with the `extra_key`), the
    prompt's head, the dp rank it was sent to (None: the engine chose) and until when it is
    kept."""

    namespace: Namespace
    head: Sequence[Hashable]
    dp_rank: int | None
    until: float


class WaitingShadows:
    """Shadows by the URL of the server they were sent to, oldest first."""

    __slots__ = ("_forgot", "_forgot_all", "_items", "_most")

    def __init__(self, *, most: int) -> None:
        self._most = most
        self._items: deque[tuple[float, str, Waiting]] = deque()  # (when it came, URL, shadow)
        # per URL, when the newest shadow it had to forget came and until when the ones it
        # forgot were to be kept, oldest first; and the same of those it had to forget without
        # a record of their URL (past `most` URLs)
        self._forgot: dict[str, tuple[float, float]] = {}
        self._forgot_all: tuple[float, float] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def keep(self, url: str, shadow: Waiting, now: float, horizon: float) -> None:
        """`shadow` was sent to the server at `url`, which no worker here follows yet (what
        came before `horizon` is let go)."""
        self._trim(horizon)
        if len(self._items) >= self._most:
            at, gone, lost = self._items.popleft()
            before = self._forgot.pop(gone, None)
            if before is not None or len(self._forgot) < self._most:
                until = lost.until if before is None else max(before[1], lost.until)
                self._forgot[gone] = (at, until)  # (last: the record stays oldest first)
            else:
                until = lost.until if self._forgot_all is None else self._forgot_all[1]
                self._forgot_all = (at, max(until, lost.until))
        self._items.append((now, url, shadow))

    def take(self, url: str, horizon: float) -> tuple[list[Waiting], float | None]:
        """The shadows kept for `url` since `horizon`, which the worker added there takes
        (they are kept no longer), and until when it must be hidden whole as well (some of
        them were forgotten, which would have been kept until then; None: none was)."""
        self._trim(horizon)
        taken = [shadow for _, u, shadow in self._items if u == url]
        if taken:
            self._items = deque(item for item in self._items if item[1] != url)
        forgot = [f[1] for f in (self._forgot.pop(url, None), self._forgot_all) if f is not None]
        return taken, max(forgot, default=None)

    def _trim(self, horizon: float) -> None:
        """Let go of what came before `horizon`."""
        items = self._items
        while items and items[0][0] < horizon:
            items.popleft()
        forgot = self._forgot
        while forgot:
            oldest = next(iter(forgot))
            if forgot[oldest][0] >= horizon:
                break
            del forgot[oldest]
        if self._forgot_all is not None and self._forgot_all[0] < horizon:
            self._forgot_all = None
