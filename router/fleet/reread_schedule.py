"""When a registered worker's settings are read again, and how often failing to read them is said.

A process restarted between two health probes, or replaced behind a stable URL, never looks
down to the health check, yet may run other dp ranks, ports or page size. `router.fleet.rereads`
reads a healthy worker's settings again when one of these says so:
- a KV-event stream of it saw its publisher restart (`restarted`), until they are read;
- a stream of it went STALE (`quiet_due`): a new process on other event ports shows no restart
  on the old ones, whose sockets never answer;
- its answers reused far less than predicted again and again (the supervisor's
  `mispredicted`): an old process still answering on the old sockets (a rolling update's grace
  period) shows nothing else;
- every `health.settings_interval_s` anyway (`settings_due`): a replaced pod is caught without
  traffic too.
Settings that cannot be read are said at a back-off (`unreadable`), not on every try.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from indexer.service import IndexerService
from router.config import HealthConfig
from router.errors import RequestError
from router.fleet.discovery import needs_discovery
from router.routing.pool import WorkerEntry

__all__ = ["REREAD_TRIES", "RereadSchedule"]

log = logging.getLogger(__name__)

# a restarted worker's settings are read again this many times, `health.timeout_s` apart, while
# its server does not answer yet (its events may be up before its HTTP server); then on each
# health round until read
REREAD_TRIES = 10

# a healthy worker whose KV-event stream went STALE has its settings read again at once, then
# (while they are unchanged and the stream stays STALE) `indexer.stale_after_s` later, doubling
# up to this many times it: an idle worker without probes is STALE for good, and asking its
# server info every round would be noise; the cap bounds how late a change is seen then
_QUIET_REREAD_MAX = 8


class RereadSchedule:
    """Per worker, when its settings are due to be read again (`router.fleet.rereads` reads
    them)."""

    def __init__(
        self, indexer: IndexerService, health: HealthConfig, clock: Callable[[], float]
    ) -> None:
        self._indexer = indexer
        self._health = health
        self._clock = clock
        # workers that restarted and whose settings could not be read since (`restarted`)
        self._stale: set[str] = set()
        # per worker with a STALE stream while healthy: when its settings may be read again
        # for it, and the wait before the one after (`quiet_due`)
        self._quiet: dict[str, tuple[float, float]] = {}
        # per worker whose settings come from its server info: when they were last read
        # (`settings_due`)
        self._read_at: dict[str, float] = {}
        # per worker whose settings could not be read: until when that is not said again
        # (`unreadable`)
        self._unread_until: dict[str, float] = {}

    def reconfigure(self, health: HealthConfig) -> None:
        """Cadences and back-offs by `health` from now on (a reload)."""
        self._health = health

    def forget(self, worker: str) -> None:
        """`worker` was removed: one added again under its id starts afresh."""
        self._stale.discard(worker)
        self._quiet.pop(worker, None)
        self._read_at.pop(worker, None)
        self._unread_until.pop(worker, None)

    def restarted(self, worker: str) -> None:
        """A stream of `worker` saw its publisher restart: due on every health round until its
        settings are read (`read_settled`)."""
        self._stale.add(worker)

    def read_settled(self, worker: str) -> None:
        """`worker`'s settings were read after its restart (or it turned out unreadable for
        good): no longer due for that."""
        self._stale.discard(worker)

    def read(self, worker: str) -> None:
        """`worker`'s settings were read just now (the slow cadence counts from here)."""
        self._read_at[worker] = self._clock()

    def readable(self, worker: str) -> None:
        """`worker`'s settings were read again just now: a later failure is said at once."""
        self.read(worker)
        self._unread_until.pop(worker, None)

    def unread(self, worker: str) -> bool:
        """Whether the last try to read `worker`'s settings again failed (and was said)."""
        return worker in self._unread_until

    def due(self, entry: WorkerEntry, now: float) -> bool:
        """Whether a healthy, registered worker's settings are to be read again on this
        health round: restarted and not read since, STALE, or on the slow cadence."""
        return (
            entry.id in self._stale or self.quiet_due(entry, now) or self.settings_due(entry, now)
        )

    def quiet_due(self, entry: WorkerEntry, now: float) -> bool:
        """Whether a healthy worker's settings are to be read again because a KV-event stream
        of it is STALE: nothing heard from it (no batch, no replay answer) for
        `indexer.stale_after_s` while its health checks pass. A new process on the same HTTP
        port with other event ports (a pod replaced behind a Service, restarted between two
        probes) looks like that: the old sockets never answer, so no stream ever sees a restart
        (`restarted`), and no probe saw it down. STALE is the bound because it is when the
        indexer gives the stream up as unheard anyway, and a busy machine's replay timeouts
        alone do not make it. Read at once, then at a back-off while nothing changed
        (`_QUIET_REREAD_MAX`). Before, such a worker was routed without KV affinity for good.
        """
        if not needs_discovery(entry.config) or not self._indexer.stale_streams(entry.id):
            self._quiet.pop(entry.id, None)  # its streams are its config's, or are heard
            return False
        due, wait_s = self._quiet.get(entry.id, (now, 0.0))
        if now < due:
            return False
        stale_after_s = self._indexer.config.stale_after_s
        wait_s = min(2 * wait_s, _QUIET_REREAD_MAX * stale_after_s) if wait_s else stale_after_s
        self._quiet[entry.id] = (now + wait_s, wait_s)
        log.debug(
            "worker %s: a KV-event stream is STALE while it is healthy: settings read", entry.id
        )
        return True

    def settings_due(self, entry: WorkerEntry, now: float) -> bool:
        """Whether a healthy worker whose streams come from its server info has it read again
        on the slow cadence (`health.settings_interval_s`, 0: never), its streams looking fine
        or not: the safety net under `quiet_due` and the false-hit watch, for a pod replaced
        behind its URL while the old one runs on (its sockets answer: never STALE) and no
        request tells (no traffic). One `/server_info` a minute per worker by default."""
        every_s = self._health.settings_interval_s
        if not every_s or not needs_discovery(entry.config):
            return False
        read_at = self._read_at.setdefault(entry.id, now)
        if now - read_at < every_s:
            return False
        self._read_at[entry.id] = now  # once per cadence, read or not (`unreadable` says)
        log.debug("worker %s: settings read again (every %g s)", entry.id, every_s)
        return True

    def unreadable(self, entry: WorkerEntry, exc: RequestError) -> None:
        """Say that `entry`'s settings could not be read again, and why: at most once per
        back-off interval (its STALE re-read's, else `indexer.stale_after_s`), and once per
        burst of tries (`REREAD_TRIES`). Before, nothing was said: a worker whose
        `/server_info` broke (garbage, timeouts) was asked in bursts for good without a line in
        the log."""
        now = self._clock()
        if now < self._unread_until.get(entry.id, now):
            log.debug("worker %s: %s (still)", entry.id, exc)
            return
        wait_s = max(
            self._quiet.get(entry.id, (now, 0.0))[1] or self._indexer.config.stale_after_s,
            REREAD_TRIES * self._health.timeout_s,
        )
        if len(self._unread_until) >= 4096:
            self._unread_until.clear()  # bounded: workers come and go; a line said again is cheap
        self._unread_until[entry.id] = now + wait_s
        log.warning(
            "worker %s: its settings could not be read again (%s): what was known of it stays; "
            "asked again later (said at most every %g s)",
            entry.id,
            exc,
            wait_s,
        )
