"""Keeping the pool in step with the fleet: membership, discovery in the background, health rounds.

The supervisor is the coordinator of the fleet's parts. It adds and removes workers (the admin
API, a reload, another replica) and runs the health rounds, every `health.interval_s`, probing
all workers concurrently, each with its own timeout; after each, a model served by one side of
the pairs only is said (`router.fleet.pd_sides`). A worker is registered once its health check
passes (`router.fleet.registration`: its models, role and KV-event streams, from its config,
its `/server_info` or its `/v1/models`); workers from the config whose server is not up yet are
retried on every health round, so the router may start before its fleet. A discovery that takes
longer than a health round, the startup or an add waits goes on in the background, one per
worker (`registering`), and is named by the admin API meanwhile (`not_registered`).

A registered worker's settings and models are read again, and it is registered anew if they
changed (`router.fleet.rereads`), when `router.fleet.reread_schedule` says so: its health came
back (maybe a new process, maybe serving another model), its KV-event stream showed its
publisher restarted (`IndexerService.restart_listeners`) or went STALE, or the slow cadence;
and when its engine refused a rank the router told it (`reread`). A worker whose old process
keeps answering on the old sockets (a rolling update's grace period) shows none of these: its
answers tell, reusing far less than predicted again and again (`router.fleet.false_hits`), and
`mispredicted` hands it to `router.fleet.false_hit_response`, which subscribes its streams anew
or leaves it unfollowed a while. What a registration finds (a refusal, a doubt, models named
otherwise, a configured role the worker does not advertise) is said once per worker
(`router.fleet.registration_notes`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import aiohttp

from indexer.service import IndexerService
from router.config import HealthConfig, TokenizerConfig, WorkerConfig
from router.errors import RequestError
from router.fleet.false_hit_response import FalseHitResponse
from router.fleet.false_hits import FalseHitWatch, WatchAction
from router.fleet.health_probe import probe_health
from router.fleet.pd_sides import PdSides
from router.fleet.registration import Registrar
from router.fleet.registration_notes import RegistrationNotes
from router.fleet.reread_schedule import RereadSchedule
from router.fleet.rereads import Rereads
from router.routing.load import LoadTracker
from router.routing.policy import Policy
from router.routing.pool import WorkerEntry, WorkerPool

__all__ = ["ADD_WAIT_TIMEOUTS", "Supervisor", "WorkerGauges"]

log = logging.getLogger(__name__)

# how many `health.timeout_s` an add (admin API, reload, another replica) waits for the worker's
# registration and first health check before it answers, as the startup waits (`register_all`):
# a worker that hangs would otherwise hold the answer for its discovery's whole timeout (five
# health timeouts per path, one path after another: 40 s at the defaults)
ADD_WAIT_TIMEOUTS = 2


class WorkerGauges(Protocol):
    """The per-worker metrics the supervisor keeps (`router.http.metrics.RouterMetrics`).

    A protocol rather than the class: the fleet sits below the HTTP layer that owns metrics.
    """

    def added(self, worker: str) -> None: ...

    def forget(self, worker: str) -> None: ...

    def false_hit_action(self, worker: str, action: WatchAction) -> None: ...


class Supervisor:
    """Owns the pool's membership and health: the health loop, and the discoveries of workers
    that take longer than a health round waits (`registering`), are its background tasks."""

    def __init__(
        self,
        pool: WorkerPool,
        indexer: IndexerService,
        session: aiohttp.ClientSession,
        health: HealthConfig,
        policy: Policy,
        load: LoadTracker,
        metrics: WorkerGauges,
        clock: Callable[[], float],
        *,
        tokenizer: TokenizerConfig | None = None,
    ) -> None:
        self._pool = pool
        self._indexer = indexer
        self._session = session
        self._health = health
        self._policy = policy
        self._load = load
        self._metrics = metrics
        self._clock = clock
        # what was said of each worker's registration (`router.fleet.registration_notes`)
        self._notes = RegistrationNotes(pool)
        # the models served by one side of the pairs only, as said (`router.fleet.pd_sides`)
        self._sides = PdSides()
        # when each worker's settings are read again (`router.fleet.reread_schedule`)
        self._schedule = RereadSchedule(indexer, health, clock)
        # per worker entry, its discovery under way (an added one's: with its first health
        # check, `_join`): one at a time, and never awaited longer than a health round, the
        # startup or an add waits (a hung worker's discovery takes its whole timeout, 10 s a
        # step with the fallback path: they would wait for it); its result is its refusal
        self._registering: dict[int, asyncio.Task[RequestError | None]] = {}
        # the entries an `add` is registering (by id()): not checked by the rounds meanwhile
        self._adding: set[int] = set()
        # of those, the ones whose add still waits to answer with a refusal (`must_register`):
        # their refusal is the add's to undo, not the rounds' to retry
        self._answering: set[int] = set()
        # per worker, the check of its predictions under way (`mispredicted`)
        self._checks: dict[str, asyncio.Task[None]] = {}
        # told every answer's usage by the observer (`router.http.observe`)
        self.watch = FalseHitWatch(indexer.block_size, self.mispredicted)
        # registers workers (`router.fleet.registration`), the first time and anew
        self._registrar = Registrar(
            pool, indexer, session, health, self._notes, self._schedule, self.watch, tokenizer
        )
        # the re-reads of registered workers' settings (`router.fleet.rereads`) and what a
        # streak of false hits does (`router.fleet.false_hit_response`): each asks the other,
        # the re-reads for the streams a worker left unfollowed had, hence the lambda
        self._rereads = Rereads(
            pool,
            indexer,
            health,
            policy,
            self._registrar,
            self._notes,
            self._schedule,
            lambda worker: self._false_hits.unfollowed(worker),
        )
        self._false_hits = FalseHitResponse(
            pool, indexer, health, clock, metrics.false_hit_action, self._rereads.rereading
        )
        indexer.restart_listeners.append(self._stream_restarted)

    def reconfigure(self, health: HealthConfig) -> None:
        """Health checks by `health` from the next round on (a reload)."""
        self._health = health
        self._schedule.reconfigure(health)
        self._registrar.reconfigure(health)
        self._rereads.reconfigure(health)
        self._false_hits.reconfigure(health)

    async def try_register(self, entry: WorkerEntry) -> RequestError | None:
        """Register a worker now if it answers; else the health rounds retry. Returns its
        refusal (None: registered), logged unless an add answers with it (`_answering`)."""
        try:
            await self._registrar.register(entry)
        except RequestError as exc:
            if id(entry) not in self._answering:
                self._notes.refused(entry, exc)
            return exc
        self._notes.registered(entry.id)
        return None

    def registering(self, entry: WorkerEntry) -> asyncio.Task[RequestError | None]:
        """`entry`'s discovery (`try_register`; an added worker's `_join`) as a task of its
        own: the one under way, or a new one. Awaiting it bounded (`asyncio.wait`) leaves it
        running."""
        task = self._registering.get(id(entry))
        if task is None:
            task = self._own(entry, self.try_register(entry))
        return task

    def discovering(self, worker: str) -> bool:
        """Whether `worker`'s discovery (an added one's: or its first health check) is under
        way in the background."""
        entry = self._pool.find(worker)
        task = None if entry is None else self._registering.get(id(entry))
        return task is not None and not task.done()

    def not_registered(self, worker: str) -> str | None:
        """Why `worker`, in the pool, is not registered yet (None: it is, or it is not in the
        pool): its discovery is under way, or was refused (why), or it does not answer."""
        entry = self._pool.find(worker)
        if entry is None:
            return None
        if self.discovering(worker) and not entry.checked:
            wait_s = ADD_WAIT_TIMEOUTS * self._health.timeout_s
            return (
                f"still being discovered: its server info, models and first health check did "
                f"not all answer within {wait_s:g} s; it takes no request until they have "
                "(status `checking`), and its discovery goes on in the background"
            )
        if entry.discovered:
            return None
        return self.refusal(worker) or "not answering yet; retried on every health round"

    def _own(
        self, entry: WorkerEntry, work: Coroutine[Any, Any, RequestError | None]
    ) -> asyncio.Task[RequestError | None]:
        """`work` on `entry` as its discovery task (`_registering`): cancelled at `close`."""
        key = id(entry)
        task = asyncio.create_task(work, name=f"kvroute-discover-{entry.id}")
        self._registering[key] = task

        def done(task: asyncio.Task[RequestError | None]) -> None:
            if self._registering.get(key) is task:
                del self._registering[key]
            if not task.cancelled() and (exc := task.exception()) is not None:
                # a defect, not a refusal (those are returned, and logged by try_register)
                log.error("worker %s: discovery failed", entry.id, exc_info=exc)

        task.add_done_callback(done)
        return task

    async def register_all(self, wait_s: float) -> None:
        """Discover every worker of the pool, waiting at most `wait_s`: the ones not done by
        then go on in the background (routed to once registered), and are named in the log."""
        entries = [e for e in self._pool if not e.discovered]
        if not entries:
            return
        tasks = {self.registering(e) for e in entries}
        _, pending = await asyncio.wait(tasks, timeout=wait_s)
        if pending:
            late = sorted(e.id for e in entries if not e.discovered)
            log.warning(
                "still discovering %d worker(s) after %.1f s (%s): serving without them "
                "until they answer",
                len(late),
                wait_s,
                ", ".join(late[:8]) + (", ..." if len(late) > 8 else ""),
            )

    async def close(self) -> None:
        """Cancel the discoveries under way (the router is stopping)."""
        tasks = [*self._registering.values(), *self._rereads.under_way(), *self._checks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def doubt(self, worker: str) -> str | None:
        """What `worker`'s registration found suspect in its config, as logged (None: nothing):
        registered all the same (`router.fleet.advertised.replay_proof`, `block_size_note`)."""
        return self._notes.doubt(worker)

    def refusal(self, worker: str) -> str | None:
        """Why `worker` could not be registered, as last logged (None: nothing logged)."""
        return self._notes.refusal(worker)

    def tokenizer_mismatch(self, worker: str) -> str | None:
        """Why `worker`'s tokenizer cannot be the router's, as logged (None: nothing)."""
        return self._notes.tokenizer_mismatch(worker)

    async def add(
        self, config: WorkerConfig, *, must_register: bool, draining: bool = False
    ) -> WorkerEntry:
        """Add a worker, routed to once it is registered and its health check passed (one that
        could not be registered: once a health round finds it up); with `must_register`,
        a discovery refused before the add answers undoes the add and raises. `draining`:
        added drained (a drained worker whose settings a reload changed).

        Waits at most `ADD_WAIT_TIMEOUTS` health timeouts: a worker whose registration and
        first check take longer stays `checking` (`discovering`, `not_registered`) while they
        go on in the background (`_join`), as the startup's do, and a refusal after that is
        retried by the health rounds. Before, the add waited for its discovery's end: a worker
        whose HTTP hangs held the admin API's answer and a reload (and the reloads after it)
        for 40 s.

        Before that, a worker took requests from the moment it was in the pool: one that
        never answers held them until their timeout while it was being discovered (and then
        refused by the admin API), one whose port was closed failed them until the next health
        round.
        """
        entry = self._pool.add(config)
        # before any await: no request may see it routable
        entry.checked = entry.healthy = False
        entry.draining = draining
        self._metrics.added(entry.id)
        key = id(entry)
        self._adding.add(key)  # the health rounds leave it to this add
        if must_register:
            self._answering.add(key)
        task = self._own(entry, self._join(entry))
        settled = False
        try:
            done, _ = await asyncio.wait({task}, timeout=ADD_WAIT_TIMEOUTS * self._health.timeout_s)
            settled = True
        finally:
            # before any await: a refusal from here on is the join's to log, the rounds' to retry
            self._answering.discard(key)
            if not settled and key in self._adding:
                # cancelled while it is being registered (the admin client left): leave no
                # half-added worker (one registered already goes on to its health check)
                self._adding.discard(key)
                task.cancel()
                self._undo(entry)
        try:
            refused = task.result() if done and not task.cancelled() else None
        except Exception:
            self._undo(entry)  # a defect, not a refusal: no worker half added
            raise
        if refused is not None and must_register:
            self._adding.discard(key)
            self._undo(entry)
            raise refused
        return entry

    async def _join(self, entry: WorkerEntry) -> RequestError | None:
        """An added worker's registration, then its first health check (routable from there if
        it answers): the part of `add` that goes on in the background once the add answered.
        Returns its refusal (None: registered)."""
        key = id(entry)
        refused: RequestError | None = None
        try:
            refused = await self.try_register(entry)
        finally:
            # a refusal its add answers with stays the add's (it undoes it); else the rounds
            # check it from now on (refused: they decide, `check`)
            if refused is None or key not in self._answering:
                self._adding.discard(key)
        if refused is None:
            await self.check(entry)
        return refused

    def _undo(self, entry: WorkerEntry) -> None:
        """Take an add back (refused, or its client left), unless someone already removed or
        replaced the worker."""
        if self._pool.find(entry.id) is entry:
            self._pool.remove(entry.id)
            self._metrics.forget(entry.id)

    async def remove(self, worker_id: str) -> WorkerEntry:
        """Remove a worker from the pool, the index, the policy and the metrics."""
        entry = self._pool.remove(worker_id)
        # a worker added again under its id (a reload that changed it) starts afresh
        self._notes.forget(worker_id)
        self._schedule.forget(worker_id)
        self.watch.forget(worker_id)
        self._false_hits.forget(worker_id)
        if self._indexer.may_shadow(worker_id):  # (subscribed, or put aside to be again)
            await self._indexer.remove_worker(worker_id)
        self._policy.forget(worker_id)
        self._load.forget(worker_id)
        self._metrics.forget(worker_id)
        return entry

    async def check(self, entry: WorkerEntry) -> bool:
        """Probe one worker's health endpoint; registers its streams once it is up."""
        # a check the router's own stall expired is made again (`router.fleet.health_probe`)
        healthy = await probe_health(
            self._session, entry.url + self._health.path, self._health.timeout_s, worker=entry.id
        )
        if self._pool.find(entry.id) is not entry:
            return healthy  # removed while probed: recording it would revive its metric series
        if id(entry) in self._adding:
            return healthy  # being added: its add checks it once registered (`add`)
        now = self._clock()
        if not healthy:
            entry.seen_down_at = now
        came_back = False
        if not entry.checked:
            # its first check (added at run time): nothing came back, it only arrived
            entry.checked = True
            if not healthy:
                log.warning("worker %s is unhealthy", entry.id)
        elif healthy != entry.healthy:
            log.warning("worker %s is now %s", entry.id, "healthy" if healthy else "unhealthy")
            if healthy and entry.discovered:
                # down -> up may be a new process whose first batches we missed: its index
                # entries predict nothing until the replay proves them (indexer.fence)
                # (a relay's follower trusts streams the relay made anew since it was down)
                down_at = entry.seen_down_at
                self._indexer.suspect_restart(
                    entry.id,
                    "its health check came back",
                    down_age_s=None if down_at is None else now - down_at,
                )
                came_back = True
        entry.healthy = healthy
        if healthy and not entry.discovered:
            # bounded: a worker that answers its health check but hangs in discovery must not
            # hold the round (every other worker's health) for its discovery's timeout
            await asyncio.wait({self.registering(entry)}, timeout=self._health.timeout_s)
        elif healthy and (came_back or self._schedule.due(entry, now)):
            # bounded as a discovery is: a re-read left unfinished goes on in the background
            await asyncio.wait({self._rereads.rereading(entry)}, timeout=self._health.timeout_s)
        return healthy

    def mispredicted(self, worker: str, predicted: int, cached: int) -> None:
        """`worker`'s answers reused far less than predicted, `STREAK` in a row (the last:
        `cached` of `predicted` tokens; `router.fleet.false_hits`): the index may follow
        another process than the one behind its URL (`FalseHitResponse.respond`), never checked
        twice at a time. Before, nothing acted on it: a pod replaced while the old one ran on
        was predicted from the old pod's cache for good (every request a false hit)."""
        entry = self._pool.find(worker)
        if entry is None or not entry.discovered or id(entry) in self._adding:
            return  # its registration, under way or to come, reads them
        if worker in self._checks:
            return
        # not the request's context: the check outlives it, and its lines are not its own
        task = asyncio.create_task(
            self._false_hits.respond(entry, predicted, cached),
            name=f"kvroute-doubt-{worker}",
            context=contextvars.Context(),
        )
        self._checks[worker] = task
        task.add_done_callback(lambda _: self._checks.pop(worker, None))

    def _stream_restarted(self, worker: str) -> None:
        """A stream of `worker` saw its publisher restart (`IndexerService.restart_listeners`):
        its settings are read again. Before, only a health probe that saw it down and up did
        that: a worker restarted between two probes with other dp ranks kept its old ranks for
        good (requests named a rank it no longer had: 400s; or its new ranks were predicted
        from rank 0's events: false hits)."""
        entry = self._pool.find(worker)
        if entry is None or not entry.discovered or id(entry) in self._adding:
            return  # its registration, under way or to come, reads them
        self._schedule.restarted(worker)
        self._rereads.rereading(entry)

    async def reread(self, worker: str, wait_s: float) -> bool:
        """Read `worker`'s settings again now, waiting at most `wait_s`: whether it was
        registered anew (its ranks changed). The proxy asks when the engine refused a rank the
        router told it (`routed_dp_rank ... out of range`): the router's ranks are stale
        (`Rereads.reread`)."""
        return await self._rereads.reread(worker, wait_s)

    async def check_all(self) -> None:
        """One health round over every worker."""
        entries = list(self._pool)
        if entries:
            await asyncio.gather(*(self.check(e) for e in entries))
        self._sides.check(self._pool)

    async def run(self) -> None:
        """Health rounds until cancelled."""
        while True:
            try:
                await self.check_all()
            except Exception:
                log.exception("health round failed")
            await asyncio.sleep(self._health.interval_s)
