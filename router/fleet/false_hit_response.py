"""What the router does about a worker whose answers keep reusing far less than predicted.

`router.fleet.false_hits` tells when (a streak of false hits on one worker); this module acts,
failing closed at once, escalating when a streak comes back soon. The first streak subscribes
the worker's KV-event streams anew, their entries dropped: behind a Service the new connections
reach the pod serving its URL now. A streak again soon after means the sockets themselves reach
a process that does not serve the URL, and the worker is left unfollowed (routed by load, no
hit predicted) for a while, doubling up to a cap, then followed again and judged again by its
answers. Either way its settings are read again (`router.fleet.rereads`), and a re-read that
finds other sockets registers it anew, which ends the response. A replica fed by the relay
follows the relay's records, and a relay not heard alive is no fault of what it follows.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from indexer.config import StreamConfig
from indexer.service import IndexerService
from router.config import HealthConfig
from router.fleet.false_hits import STREAK, WINDOW, WatchAction, resubscribed_why, unfollowed_why
from router.fleet.rereads import registered_anew
from router.routing.pool import WorkerEntry, WorkerPool

__all__ = ["FalseHitResponse"]

log = logging.getLogger(__name__)

# health timeouts a false-hit streak waits for the worker's settings read again before its
# streams are subscribed anew (`FalseHitResponse.respond`); a re-read still running then
# registers the worker anew itself if its sockets changed
_REREAD_WAIT_ROUNDS = 2
# a streak of false hits within this many `indexer.stale_after_s` of the last one escalates
# (`FalseHitResponse.respond`): the streams subscribed anew followed the wrong process again
_DISTRUST_QUIET = 8
# the longest a worker whose streams keep following the wrong process is left unfollowed, in
# `indexer.stale_after_s` (its first time: twice that, then doubling)
_QUARANTINE_MAX = 8
# how often a fed worker's quarantine looks for another relay process (a restarted relay)
_RELAY_POLL_S = 0.1


class FalseHitResponse:
    """Per worker, how far its streaks of false hits escalated, and the streams of the ones
    left unfollowed meanwhile."""

    def __init__(
        self,
        pool: WorkerPool,
        indexer: IndexerService,
        health: HealthConfig,
        clock: Callable[[], float],
        count: Callable[[str, WatchAction], None],
        rereading: Callable[[WorkerEntry], asyncio.Task[bool]],
    ) -> None:
        self._pool = pool
        self._indexer = indexer
        self._health = health
        self._clock = clock
        # counts what a streak did, per worker (`WorkerGauges.false_hit_action`)
        self._count = count
        # the re-read of a worker's settings under way, or a new one (`Rereads.rereading`)
        self._rereading = rereading
        # per worker: how many streaks of false hits came close together, the last one when
        self._distrust: dict[str, tuple[int, float]] = {}
        # workers not followed for a while (`respond`): the streams they had
        self._quarantined: dict[str, list[StreamConfig]] = {}

    def reconfigure(self, health: HealthConfig) -> None:
        """Waits by `health` from now on (a reload)."""
        self._health = health

    def forget(self, worker: str) -> None:
        """`worker` was removed: one added again under its id starts trusted."""
        self._distrust.pop(worker, None)

    def unfollowed(self, worker: str) -> list[StreamConfig]:
        """The streams `worker` had when it was left unfollowed (none: it is followed, or had
        none); a re-read of its settings compares what they say with these."""
        return self._quarantined.get(worker, [])

    async def respond(self, entry: WorkerEntry, predicted: int, cached: int) -> None:
        """Act on a streak of false hits, fail closed at once, and read `entry`'s settings
        again (other sockets, ranks or page size register it anew).

        The first streak subscribes its streams anew, their entries dropped: behind a Service
        the new connections reach the pod serving its URL now (a replay over the old ones only
        proved the old pod again: QA, 24 of 24 false hits until the old pod exited). A streak
        again within `_DISTRUST_QUIET` of stale_after_s means the sockets themselves reach a
        process that does not serve the URL (an old pod's own address, as its `/server_info`
        gave it): the worker is not followed at all (routed by load, no hit) for
        `stale_after_s` times 2, 4, ... (up to `_QUARANTINE_MAX`), then subscribed again and
        judged again by its answers, unless its settings read meanwhile registered it anew.

        A replica fed by the relay has no sockets of its own: its streams are the relay's
        records, read anew from the relay's stream. A relay not heard alive (stopped, or NATS
        away) is named as the cause, and such a streak escalates nothing (the relay's records
        predict nothing until it is heard again: `indexer.fed_stream`); a relay heard alive
        whose records mispredict again follows another process than the one serving the URL,
        and the worker is left unfollowed until another relay process writes it (a restarted
        relay subscribes anew) or the quarantine ends. Before, either was said as this
        replica's sockets reaching another process, and a relay killed and restarted left the
        worker unfollowed for a minute (QA: ~51 s after the relay was back)."""
        stale_after_s = self._indexer.config.stale_after_s
        now = self._clock()
        fed = self._indexer.fed
        relay = None if fed is None else fed.relay_of(entry.id)
        level, last = self._distrust.get(entry.id, (0, -math.inf))
        level = 1 if now - last > _DISTRUST_QUIET * stale_after_s else level + 1
        if relay is not None and not relay[1]:
            level = 1  # the relay's silence, no fault of what it follows: nothing escalates
        else:
            self._distrust[entry.id] = (level, now)
        configs = list(self._indexer.stream_configs(entry.id))
        what = (
            f"worker {entry.id}: {STREAK} of its last {WINDOW} answers reused far fewer tokens "
            f"than predicted (the last: {cached} of {predicted})"
        )
        if level == 1 or not configs:
            self._count(entry.id, "resubscribed")
            log.warning("%s: %s", what, resubscribed_why(relay))
            if not configs:
                self._rereading(entry)
                return
            # not followed until the re-read ended: subscribed anew at once, the streams caught
            # up over the old sockets and were trusted before a re-read that finds other
            # sockets registered them (QA: one more false hit, 50 ms after the streak). The
            # re-read compares the sockets it reads with these (`unfollowed`): before, it read
            # the indexer's after the removal, none, and every first streak said the worker
            # "runs other settings" and registered it anew, its sockets unchanged
            self._quarantined[entry.id] = configs
            try:
                await self._indexer.remove_worker(entry.id, returning=True)
                reread = self._rereading(entry)
                await asyncio.wait({reread}, timeout=_REREAD_WAIT_ROUNDS * self._health.timeout_s)
                if (
                    not (reread.done() and registered_anew(reread))
                    and self._pool.find(entry.id) is entry
                    and not self._indexer.has_worker(entry.id)
                ):
                    await self._indexer.add_worker(entry.id, configs, url=entry.server)
            finally:
                self._quarantined.pop(entry.id, None)
            return
        quarantine_s = stale_after_s * min(2 ** (level - 1), _QUARANTINE_MAX)
        self._quarantined[entry.id] = configs
        # before the await: a request routed from here on is predicted no hit there, and its
        # answer is no measure of the index (`router.http.decisions` counts it apart); shown
        # by /admin/workers, /metrics and the dashboard
        entry.unfollowed_until = now + quarantine_s
        self._count(entry.id, "unfollowed")
        try:
            await self._indexer.remove_worker(entry.id, returning=True)
            log.warning("%s, %s", what, unfollowed_why(relay, quarantine_s))
            reread = self._rereading(entry)
            # a fed worker's quarantine also ends once another relay process is heard
            poll = quarantine_s if relay is None else _RELAY_POLL_S
            while (left := now + quarantine_s - self._clock()) > 0:
                if reread.done():
                    await asyncio.sleep(min(left, poll))
                else:
                    await asyncio.wait({reread}, timeout=min(left, poll))
                    if reread.done() and registered_anew(reread):
                        return  # registered anew on the sockets it advertises now
                if fed is not None and relay is not None and fed.other_relay_live(relay[0]):
                    log.info("worker %s: another relay process writes its streams", entry.id)
                    level = 0  # judged afresh: the relay that mispredicted is gone
                    break
            # what it runs now, read before its streams are followed again: it may have
            # restarted with other settings since the first read (more dp ranks: followed on
            # the old ones, a rank-0 page was predicted to a request the engine put on rank 1;
            # QA, 4 of 9 prompts, until the next re-read registered it anew)
            reread = self._rereading(entry)
            await asyncio.wait({reread}, timeout=_REREAD_WAIT_ROUNDS * self._health.timeout_s)
            if reread.done() and registered_anew(reread):
                return
        finally:
            self._quarantined.pop(entry.id, None)
            entry.unfollowed_until = None
        if self._pool.find(entry.id) is entry and not self._indexer.has_worker(entry.id):
            await self._indexer.add_worker(entry.id, configs, url=entry.server)
            # the quiet window counts from here: a streak soon after escalates (before, it
            # counted from the streak, so a long quarantine always started over at level 1)
            self._distrust[entry.id] = (level, self._clock())
            log.info("worker %s: its KV-event streams followed again", entry.id)
