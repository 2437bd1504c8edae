"""Keeping the pool in step with the fleet: discovery, registration, health checks, removal.

A worker's KV-event streams come from its config or its `/server_info`, and the models it
serves from its config, its `/server_info` or its `/v1/models`; once known they are registered
with the indexer and the pool. Workers from the config whose server is not up yet are retried
on every health round, so the router may start before its fleet. A worker whose health comes
back (maybe a new process, maybe serving another model) has its models read again, and is
registered anew if they changed; so is a worker whose KV-event stream shows its publisher
restarted (`IndexerService.restart_listeners`), or whose engine refused a rank the router told
it (`reread`): a process restarted between two probes, or replaced behind a stable URL, never
looks down to the health check, yet may run other dp ranks. One on other event ports shows
no restart on the old ones either: a healthy worker whose stream went STALE is read again too
(`RereadSchedule.quiet_due`). One whose old process keeps running and answering on the old
sockets (a rolling update's grace period) shows nothing of the kind: the answers tell, reusing
far less than predicted again and again (`router.fleet.false_hits`), and its settings are read
at once (`mispredicted`); and every `health.settings_interval_s` anyway
(`RereadSchedule.settings_due`), so a replaced pod is caught without traffic too. When each of
these is due, and how often unreadable settings are said, is `router.fleet.reread_schedule`'s
to tell; the reading and the registration anew are here. A worker registered anew as another
process keeps its streams' counters, the restart counted (`IndexerService.add_worker`). What a
registration finds (a refusal, a doubt, models named otherwise, a configured role the worker
does not advertise) is said once per worker (`router.fleet.registration_notes`). Health rounds
run every `health.interval_s` and probe all workers concurrently, each with its own timeout;
after each, a model served by one side of the pairs only is said (`router.fleet.pd_sides`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import aiohttp

from indexer.config import StreamConfig
from indexer.engines import SGLANG, EngineSpec, PdRole, engine_spec
from indexer.service import IndexerService
from router.config import HealthConfig, TokenizerConfig, WorkerConfig
from router.errors import RequestError
from router.fleet.advertised import (
    block_size_note,
    check_ranks,
    check_topic,
    replay_proof,
    sockets,
)
from router.fleet.discovery import (
    capacity_from_server_info,
    flushes_by_salt,
    host_capacity_from_server_info,
    max_running_from_server_info,
    needs_discovery,
    settings_note,
    streams_for,
    version_from_server_info,
)
from router.fleet.false_hits import (
    STREAK,
    WINDOW,
    FalseHitWatch,
    WatchAction,
    resubscribed_why,
    unfollowed_why,
)
from router.fleet.pd_sides import PdSides
from router.fleet.registration_notes import RegistrationNotes
from router.fleet.reread_schedule import REREAD_TRIES, RereadSchedule
from router.fleet.tokenizer_match import tokenizer_mismatch
from router.fleet.worker_settings import read_served_models, read_server_info
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

# health timeouts a false-hit streak waits for the worker's settings read again before its
# streams are subscribed anew (`_check_predictions`); a re-read still running then registers
# the worker anew itself if its sockets changed
_REREAD_WAIT_ROUNDS = 2
# a streak of false hits within this many `indexer.stale_after_s` of the last one escalates
# (`_check_predictions`): the streams subscribed anew followed the wrong process again
_DISTRUST_QUIET = 8
# the longest a worker whose streams keep following the wrong process is left unfollowed, in
# `indexer.stale_after_s` (its first time: twice that, then doubling)
_QUARANTINE_MAX = 8
# how often a fed worker's quarantine looks for another relay process (a restarted relay)
_RELAY_POLL_S = 0.1


def _registered_anew(reread: asyncio.Task[bool]) -> bool:
    """Whether a re-read of a worker's settings (`Supervisor.rereading`) that ended registered
    it anew: a cancelled or failed one did not."""
    return not reread.cancelled() and reread.exception() is None and reread.result()


class WorkerGauges(Protocol):
    """The per-worker metrics the supervisor keeps (`router.http.metrics.RouterMetrics`).

    A protocol rather than the class: the fleet sits below the HTTP layer that owns metrics.
    """

    def added(self, worker: str) -> None: ...

    def forget(self, worker: str) -> None: ...

    def false_hit_action(self, worker: str, action: WatchAction) -> None: ...


def _pairing(role: PdRole, bootstrap_port: int | None) -> str:
    """A worker's side of the pairs, as a log line says it."""
    if bootstrap_port is None:
        return role
    return f"{role} (bootstrap port {bootstrap_port})"


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
        # the router's tokenizer, which each worker's advertised one is held against
        # (`router.fleet.tokenizer_match`; None: not compared)
        self._tokenizer = tokenizer
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
        # per worker entry, the re-read of its settings under way (`rereading`)
        self._rereading: dict[int, asyncio.Task[bool]] = {}
        # the checks of workers whose answers were mispredicted under way (`mispredicted`)
        # per worker, the check of its predictions under way (`mispredicted`)
        self._checks: dict[str, asyncio.Task[None]] = {}
        # per worker: how many streaks of false hits came close together, the last one when
        self._distrust: dict[str, tuple[int, float]] = {}
        # workers not followed for a while (`_check_predictions`): the streams they had
        self._quarantined: dict[str, list[StreamConfig]] = {}
        # told every answer's usage by the observer (`router.http.observe`)
        self.watch = FalseHitWatch(indexer.block_size, self.mispredicted)
        indexer.restart_listeners.append(self._stream_restarted)

    def reconfigure(self, health: HealthConfig) -> None:
        """Health checks by `health` from the next round on (a reload)."""
        self._health = health
        self._schedule.reconfigure(health)

    async def server_info(self, url: str, spec: EngineSpec = SGLANG) -> dict[str, Any]:
        """A worker's settings from the first of its engine's server-info paths that answers."""
        return await read_server_info(
            self._session, url, spec, timeout_s=self._health.timeout_s * 5
        )

    async def served_models(
        self,
        entry: WorkerEntry,
        spec: EngineSpec,
        info: dict[str, Any] | None,
        adapters: dict[str, str] | None = None,
        *,
        info_read: bool = False,
        advertised: list[str] | None = None,
    ) -> tuple[str, ...]:
        """The models `entry` serves (`read_served_models`; `adapters`, `info_read` and
        `advertised` as it says)."""
        return await read_served_models(
            self._session,
            entry.config,
            spec,
            info,
            timeout_s=self._health.timeout_s * 5,
            adapters=adapters,
            info_read=info_read,
            advertised=advertised,
        )

    @staticmethod
    def _role(
        entry: WorkerEntry, spec: EngineSpec, info: dict[str, Any] | None
    ) -> tuple[PdRole, int | None]:
        """The worker's prefill/decode role and bootstrap port: its config's, else what its
        server info (`info`, None: not read) advertises; a server without settings does whole
        requests.

        Not read again here when `info` is None: `register` read it already, and a second try
        on a server that did not answer doubled a hung worker's registration (two more paths
        of five health timeouts each)."""
        config = entry.config
        role: PdRole | None = config.role
        port = config.bootstrap_port
        if role is None or (role == "prefill" and port is None):
            advertised, advertised_port = spec.advertised_role(info) if info else (None, None)
            role = role or advertised or "both"
            port = port or advertised_port
        if role == "prefill" and port is None:
            port = spec.default_bootstrap_port
        return role, port

    async def register(self, entry: WorkerEntry, *, restarted: bool = False) -> None:
        """Discover (if needed) the worker's models, role and KV-event streams, and subscribe.
        `restarted`: it is registered anew as another process (its streams count the restart:
        `IndexerService.add_worker`)."""
        spec = engine_spec(entry.config.engine)
        discovering = needs_discovery(entry.config)
        info: dict[str, Any] | None
        if discovering:
            info = await self.server_info(entry.url, spec)
        else:
            info = await self._settings(entry, spec)
        role, bootstrap_port = self._role(entry, spec, info)
        if info is not None:
            self._notes.check_role(entry, spec.advertised_role(info)[0])
        # vLLM names a LoRA adapter by itself (SGLang: base:adapter): the ones it lists
        adapters: dict[str, str] | None = {} if spec.name == "vllm" else None
        # the server info was read above, once (None: it did not answer, or there is none)
        advertised: list[str] = []
        models = await self.served_models(
            entry, spec, info, adapters, info_read=True, advertised=advertised
        )
        # a config that spells its streams out is taken as it is: the settings read anyway
        # only complete what no config says (capacity, concurrency, role)
        try:
            streams = self._trusted_streams(entry, info if discovering else None, info, models)
        except RequestError:
            if self._pool.find(entry.id) is entry:
                # routed by load alone until its streams can be trusted, but as the model and
                # the role it serves: a prefill worker taken for a whole-request one would be
                # sent whole requests, and a worker of no known model takes none in a fleet of
                # several
                self._pool.set_role(entry, role, bootstrap_port)
                self._pool.set_models(entry, models, adapters)
                self._notes.say_ambiguous(entry)
                # a URL pointing at another worker is a likely cause of the refusal too (its
                # streams: another worker's already)
                self._notes.check_named(entry, advertised)
            raise
        if self._pool.find(entry.id) is not entry:
            return  # removed while discovering (maybe replaced by another of its id)
        # read before the streams are added: what a worker advertises is anything (bounded
        # and checked there, `router.fleet.discovery`)
        capacity = capacity_from_server_info(info)
        host_capacity = host_capacity_from_server_info(info)
        max_running = max_running_from_server_info(info)
        if streams:  # a worker without events is routed by load alone
            await self._indexer.add_worker(entry.id, streams, restarted=restarted)
        try:
            self._pool.set_role(entry, role, bootstrap_port)
            self._pool.set_models(entry, models, adapters)
            self._notes.say_ambiguous(entry)
            self._notes.check_named(entry, advertised)
            self._check_tokenizer(entry, info)
            self._notes.check_settings(entry.id, settings_note(info))
            entry.streams = [s.endpoint for s in streams]
            entry.capacity_tokens = capacity
            entry.host_capacity_tokens = host_capacity
            entry.flushes_by_salt = flushes_by_salt(info)
            entry.max_running_requests = max_running
            entry.version = version_from_server_info(info)
            entry.discovered = True
            if info is not None:
                self._schedule.read(entry.id)
            self.watch.forget(entry.id)  # a streak was the old registration's
        except Exception:
            # no subscription outlives a registration that failed: before, a worker whose
            # settings raised here (an advertised hicache_ratio of 1e308) kept its streams
            # subscribed for good, unlisted, and its server under another id was `duplicate`
            # (its stream taken) until the router restarted
            if streams:
                await self._indexer.remove_worker(entry.id)
            raise
        log.info(
            "worker %s: serves %s as %s, %d KV-event stream(s) registered",
            entry.id,
            ", ".join(models) or "no named model",
            role,
            len(streams),
        )

    def _trusted_streams(
        self,
        entry: WorkerEntry,
        discovered: dict[str, Any] | None,
        info: dict[str, Any] | None,
        models: tuple[str, ...],
    ) -> list[StreamConfig]:
        """The worker's streams (its config's, completed from `discovered`), checked against
        what it says (`info`) and against the streams of the other workers; RequestError
        when one cannot be trusted."""
        streams = streams_for(entry.config, discovered, model=models[0] if models else "")
        if info is not None:
            check_topic(entry.config, info)
            check_ranks(entry.config, info, streams)
        # discovering or not: configured replay sockets beside advertised ones are checked
        streams, note = replay_proof(entry.config, info, streams)
        # what is suspect but registered all the same: the reload's answer warns of it
        notes = [n for n in (note, block_size_note(entry.config, info)) if n is not None]
        self._notes.doubted(entry.id, "; ".join(notes) or None)
        for stream in streams:
            other = self._indexer.sharing(entry.id, stream.endpoint, stream.topic)
            if other is not None:
                entry.same_stream_as = other  # not routed: one engine, one candidate
                # one publisher is one engine's cache: two workers on it would each be
                # predicted the other's pages (false hits)
                raise RequestError(
                    f"worker {entry.id}: events {stream.endpoint} (topic {stream.topic!r}) "
                    f"are worker {other}'s stream already; fix `events` in its config (not "
                    "subscribed until then)"
                )
        entry.same_stream_as = None
        return streams

    async def _settings(self, entry: WorkerEntry, spec: EngineSpec) -> dict[str, Any] | None:
        """The worker's server info when its streams need none: its KV capacity
        (`max_total_num_tokens`) and concurrency are in no config, and without them the
        admission forecast and `hold_until_room` are off for it. None when it cannot be read
        (said once, at INFO: an engine without the path is routed all the same)."""
        if not spec.server_info_paths:
            return None
        try:
            return await self.server_info(entry.url, spec)
        except RequestError as exc:
            log.info(
                "worker %s: %s: its KV capacity is unknown (no admission forecast, no holding), "
                "and its role, unless configured, taken as both",
                entry.id,
                exc,
            )
            return None

    async def _recheck_settings(self, entry: WorkerEntry) -> bool | None:
        """Read a returning worker's server info again: it may be a new process with other
        settings on the same ports. Its KV capacity, concurrency, role and bootstrap port are
        taken (`_recheck_role`); another set of streams (dp ranks, ports) or page size registers
        it anew. Returns whether it did (None:
        its settings could not be read). Before, the first process's settings stayed:
        requests named ranks it no longer had (400s), and the forecast counted a pool it no
        longer had (false hits)."""
        spec = engine_spec(entry.config.engine)
        if not spec.server_info_paths:
            return False
        try:
            info = await self.server_info(entry.url, spec)
        except RequestError as exc:
            self._schedule.unreadable(entry, exc)
            return None  # not readable: what was known stays (`_reread` tries again)
        if self._pool.find(entry.id) is not entry:
            return False
        self._schedule.readable(entry.id)
        self._check_tokenizer(entry, info)
        self._notes.check_settings(entry.id, settings_note(info))
        entry.capacity_tokens = capacity_from_server_info(info)
        entry.host_capacity_tokens = host_capacity_from_server_info(info)
        entry.max_running_requests = max_running_from_server_info(info)
        entry.version = version_from_server_info(info)  # another process may be another
        self._recheck_role(entry, spec, info)
        if not needs_discovery(entry.config):
            return False  # its streams are its config's
        try:
            streams = streams_for(entry.config, info, model=entry.cache_model)
        except RequestError:
            return False
        # a worker left unfollowed (`_check_predictions`) is compared with the streams it had
        left = self._quarantined.get(entry.id, [])
        sizes = {s.block_size for s in streams}
        known = {self._indexer.block_size(entry.id)} | {c.block_size for c in left}
        had = self._indexer.stream_configs(entry.id) or left
        same = sockets(streams) == sockets(had)
        if same and sizes <= known | {None}:
            return False
        log.warning(
            "worker %s runs other settings than it was registered with (%d KV-event "
            "stream(s)): registered anew",
            entry.id,
            len(streams),
        )
        try:
            await self.register(entry, restarted=True)
        except RequestError as exc:
            self._notes.refused(entry, exc)
        return True

    def _check_tokenizer(self, entry: WorkerEntry, info: dict[str, Any] | None) -> None:
        """Say when the tokenizer `entry`'s server info (just read; None: not read, what was
        said stays) says cannot be the router's (once per worker and finding)."""
        if info is not None and self._tokenizer is not None:
            self._notes.check_tokenizer(entry.id, tokenizer_mismatch(self._tokenizer, info))

    def tokenizer_mismatch(self, worker: str) -> str | None:
        """Why `worker`'s tokenizer cannot be the router's, as logged (None: nothing)."""
        return self._notes.tokenizer_mismatch(worker)

    def _recheck_role(self, entry: WorkerEntry, spec: EngineSpec, info: dict[str, Any]) -> None:
        """Take the role and bootstrap port a returning worker advertises now (`_role`: its
        config's first). A prefill whose bootstrap port is left to the system binds another
        one each start, and a process may come back as the other side of the pairs. Before,
        the first process's stayed, as nothing else in its settings changed: every pair
        through it named a bootstrap port nobody listened on (the decode's 502
        `kv_transfer_failed`, for good), or a decode worker was sent prefill legs."""
        role, port = self._role(entry, spec, info)
        self._notes.check_role(entry, spec.advertised_role(info)[0])
        was_role, was_port = entry.role, entry.bootstrap_port
        if (role, port) == (was_role, was_port):
            return
        self._pool.set_role(entry, role, port)
        if role != was_role:
            # its turns (and approx_tree's prefixes) were taken as the other side's
            self._policy.forget(entry.id)
        log.warning(
            "worker %s came back as %s, was %s",
            entry.id,
            _pairing(role, port),
            _pairing(was_role, was_port),
        )

    async def _recheck_models(self, entry: WorkerEntry) -> bool:
        """Read a returning worker's models again; register it anew when they changed
        (returns whether it did)."""
        if entry.config.served_models:
            return False  # configured: nothing to rediscover
        spec = engine_spec(entry.config.engine)
        try:
            models = await self.served_models(entry, spec, None)
        except RequestError as exc:
            log.warning("worker %s: %s", entry.id, exc)
            return False
        if models != entry.models and self._pool.find(entry.id) is entry:
            log.warning("worker %s now serves %s", entry.id, ", ".join(models) or "no model")
            try:
                # its cache is another model's: new streams
                await self.register(entry, restarted=True)
            except RequestError as exc:
                log.warning("worker %s: %s", entry.id, exc)
            return True
        return False

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
        self.rereading(entry)

    def rereading(self, entry: WorkerEntry) -> asyncio.Task[bool]:
        """The re-read of `entry`'s settings (`_reread`) under way, or a new one; its result:
        whether it was registered anew. Awaiting it bounded (`asyncio.wait`) leaves it running."""
        key = id(entry)
        task = self._rereading.get(key)
        if task is None:
            task = asyncio.create_task(self._reread(entry), name=f"kvroute-reread-{entry.id}")
            self._rereading[key] = task

            def done(task: asyncio.Task[bool]) -> None:
                self._rereading.pop(key, None)
                if not task.cancelled() and (exc := task.exception()) is not None:
                    log.error(
                        "worker %s: reading its settings again failed", entry.id, exc_info=exc
                    )

            task.add_done_callback(done)
        return task

    async def reread(self, worker: str, wait_s: float) -> bool:
        """Read `worker`'s settings again now, waiting at most `wait_s`: whether it was
        registered anew (its ranks changed). The proxy asks when the engine refused a rank the
        router told it (`routed_dp_rank ... out of range`): the router's ranks are stale."""
        entry = self._pool.find(worker)
        if entry is None or not entry.discovered:
            return False
        task = self.rereading(entry)
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        return bool(done) and _registered_anew(task)

    async def _reread(self, entry: WorkerEntry) -> bool:
        """`entry`'s settings, then its models, read again (`_recheck_settings`); a server that
        does not answer yet is asked again `health.timeout_s` apart, then on each health round
        (`RereadSchedule.restarted`). Returns whether it was registered anew."""
        for attempt in range(REREAD_TRIES):
            if attempt:
                await asyncio.sleep(self._health.timeout_s)
            if self._pool.find(entry.id) is not entry:
                return False
            changed = await self._recheck_settings(entry)
            if changed is not None:
                self._schedule.read_settled(entry.id)
                anew = changed or await self._recheck_models(entry)
                if not anew and self._pool.find(entry.id) is entry:
                    # the restarts its streams counted were of processes like the registered
                    # one: a re-registration from here on counts its own
                    self._indexer.settled(entry.id)
                return anew
        return False

    async def try_register(self, entry: WorkerEntry) -> RequestError | None:
        """Register a worker now if it answers; else the health rounds retry. Returns its
        refusal (None: registered), logged unless an add answers with it (`_answering`)."""
        try:
            await self.register(entry)
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
        tasks = [*self._registering.values(), *self._rereading.values(), *self._checks.values()]
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
        self._distrust.pop(worker_id, None)
        if self._indexer.has_worker(worker_id):
            await self._indexer.remove_worker(worker_id)
        self._policy.forget(worker_id)
        self._load.forget(worker_id)
        self._metrics.forget(worker_id)
        return entry

    async def check(self, entry: WorkerEntry) -> bool:
        """Probe one worker's health endpoint; registers its streams once it is up."""
        timeout = aiohttp.ClientTimeout(total=self._health.timeout_s)
        try:
            async with self._session.get(entry.url + self._health.path, timeout=timeout) as resp:
                healthy = resp.status == 200
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            healthy = False
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
            await asyncio.wait({self.rereading(entry)}, timeout=self._health.timeout_s)
        return healthy

    def mispredicted(self, worker: str, predicted: int, cached: int) -> None:
        """`worker`'s answers reused far less than predicted, `STREAK` in a row (the last:
        `cached` of `predicted` tokens; `router.fleet.false_hits`): the index may follow
        another process than the one behind its URL (`_check_predictions`), never checked
        twice at a time. Before, nothing acted on it: a pod replaced while the old one ran on
        was predicted from the old pod's cache for good (every request a false hit)."""
        entry = self._pool.find(worker)
        if entry is None or not entry.discovered or id(entry) in self._adding:
            return  # its registration, under way or to come, reads them
        if worker in self._checks:
            return
        # not the request's context: the check outlives it, and its lines are not its own
        task = asyncio.create_task(
            self._check_predictions(entry, predicted, cached),
            name=f"kvroute-doubt-{worker}",
            context=contextvars.Context(),
        )
        self._checks[worker] = task
        task.add_done_callback(lambda _: self._checks.pop(worker, None))

    async def _check_predictions(self, entry: WorkerEntry, predicted: int, cached: int) -> None:
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
            self._metrics.false_hit_action(entry.id, "resubscribed")
            log.warning("%s: %s", what, resubscribed_why(relay))
            if not configs:
                self.rereading(entry)
                return
            # not followed until the re-read ended: subscribed anew at once, the streams caught
            # up over the old sockets and were trusted before a re-read that finds other
            # sockets registered them (QA: one more false hit, 50 ms after the streak). The
            # re-read compares the sockets it reads with these (`_recheck_settings`): before,
            # it read the indexer's after the removal, none, and every first streak said the
            # worker "runs other settings" and registered it anew, its sockets unchanged
            self._quarantined[entry.id] = configs
            try:
                await self._indexer.remove_worker(entry.id)
                reread = self.rereading(entry)
                await asyncio.wait({reread}, timeout=_REREAD_WAIT_ROUNDS * self._health.timeout_s)
                if (
                    not (reread.done() and _registered_anew(reread))
                    and self._pool.find(entry.id) is entry
                    and not self._indexer.has_worker(entry.id)
                ):
                    await self._indexer.add_worker(entry.id, configs)
            finally:
                self._quarantined.pop(entry.id, None)
            return
        quarantine_s = stale_after_s * min(2 ** (level - 1), _QUARANTINE_MAX)
        self._quarantined[entry.id] = configs
        # before the await: a request routed from here on is predicted no hit there, and its
        # answer is no measure of the index (`router.http.decisions` counts it apart); shown
        # by /admin/workers, /metrics and the dashboard
        entry.unfollowed_until = now + quarantine_s
        self._metrics.false_hit_action(entry.id, "unfollowed")
        try:
            await self._indexer.remove_worker(entry.id)
            log.warning("%s, %s", what, unfollowed_why(relay, quarantine_s))
            reread = self.rereading(entry)
            # a fed worker's quarantine also ends once another relay process is heard
            poll = quarantine_s if relay is None else _RELAY_POLL_S
            while (left := now + quarantine_s - self._clock()) > 0:
                if reread.done():
                    await asyncio.sleep(min(left, poll))
                else:
                    await asyncio.wait({reread}, timeout=min(left, poll))
                    if reread.done() and _registered_anew(reread):
                        return  # registered anew on the sockets it advertises now
                if fed is not None and relay is not None and fed.other_relay_live(relay[0]):
                    log.info("worker %s: another relay process writes its streams", entry.id)
                    level = 0  # judged afresh: the relay that mispredicted is gone
                    break
        finally:
            self._quarantined.pop(entry.id, None)
            entry.unfollowed_until = None
        if self._pool.find(entry.id) is entry and not self._indexer.has_worker(entry.id):
            await self._indexer.add_worker(entry.id, configs)
            # the quiet window counts from here: a streak soon after escalates (before, it
            # counted from the streak, so a long quarantine always started over at level 1)
            self._distrust[entry.id] = (level, self._clock())
            log.info("worker %s: its KV-event streams followed again", entry.id)

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
