"""Reading a registered worker's settings and models again, and registering it anew when they
changed.

A process restarted between two health probes, or replaced behind a stable URL, never looks
down to the health check, yet may run other dp ranks, ports, page size, role or models. When a
worker is due (`router.fleet.reread_schedule` says when: its health came back, a stream saw its
publisher restart or went STALE, the slow cadence; the false-hit response and the proxy ask
too), its server info is read again: its capacity, concurrency, version and role are taken,
and other sockets or another page size register it anew (`router.fleet.registration`); then its
models, and other models register it anew too. One re-read per worker at a time, a task of its
own (`Rereads.rereading`) that a health round waits for bounded, so a hung server holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from indexer.config import StreamConfig
from indexer.engines import EngineSpec, PdRole, engine_spec
from indexer.service import IndexerService
from router.config import HealthConfig
from router.errors import RequestError
from router.fleet.advertised import sockets
from router.fleet.discovery import (
    caches_prompts_late,
    capacity_from_server_info,
    host_capacity_from_server_info,
    max_running_from_server_info,
    needs_discovery,
    settings_note,
    streams_for,
    version_from_server_info,
)
from router.fleet.registration import Registrar, role_of
from router.fleet.registration_notes import RegistrationNotes
from router.fleet.reread_schedule import REREAD_TRIES, RereadSchedule
from router.routing.policy import Policy
from router.routing.pool import WorkerEntry, WorkerPool

__all__ = ["Rereads", "registered_anew"]

log = logging.getLogger(__name__)


def registered_anew(reread: asyncio.Task[bool]) -> bool:
    """Whether a re-read of a worker's settings (`Rereads.rereading`) that ended registered
    it anew: a cancelled or failed one did not."""
    return not reread.cancelled() and reread.exception() is None and reread.result()


def _pairing(role: PdRole, bootstrap_port: int | None) -> str:
    """A worker's side of the pairs, as a log line says it."""
    if bootstrap_port is None:
        return role
    return f"{role} (bootstrap port {bootstrap_port})"


class Rereads:
    """Per worker entry, the re-read of its settings under way; it reads them and registers the
    worker anew when they changed."""

    def __init__(
        self,
        pool: WorkerPool,
        indexer: IndexerService,
        health: HealthConfig,
        policy: Policy,
        registrar: Registrar,
        notes: RegistrationNotes,
        schedule: RereadSchedule,
        unfollowed: Callable[[str], list[StreamConfig]],
    ) -> None:
        self._pool = pool
        self._indexer = indexer
        self._health = health
        self._policy = policy
        self._registrar = registrar
        self._notes = notes
        self._schedule = schedule
        # the streams a worker left unfollowed had (`FalseHitResponse.unfollowed`; none: it is
        # followed): compared with what its settings say now, as the indexer has none of them
        self._unfollowed = unfollowed
        # per worker entry, the re-read of its settings under way (`rereading`)
        self._rereading: dict[int, asyncio.Task[bool]] = {}

    def reconfigure(self, health: HealthConfig) -> None:
        """Waits by `health` from now on (a reload)."""
        self._health = health

    def under_way(self) -> list[asyncio.Task[bool]]:
        """The re-reads under way (the supervisor cancels them when the router stops)."""
        return list(self._rereading.values())

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
        return bool(done) and registered_anew(task)

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
            info = await self._registrar.server_info(entry.url, spec)
        except RequestError as exc:
            self._schedule.unreadable(entry, exc)
            return None  # not readable: what was known stays (`_reread` tries again)
        if self._pool.find(entry.id) is not entry:
            return False
        self._schedule.readable(entry.id)
        self._registrar.check_tokenizer(entry, info)
        self._notes.check_settings(entry.id, settings_note(info))
        entry.capacity_tokens = capacity_from_server_info(info)
        entry.host_capacity_tokens = host_capacity_from_server_info(info)
        entry.max_running_requests = max_running_from_server_info(info)
        entry.caches_prompts_late = caches_prompts_late(entry.config.engine, info)
        entry.version = version_from_server_info(info)  # another process may be another
        self._recheck_role(entry, spec, info)
        if not needs_discovery(entry.config):
            return False  # its streams are its config's
        try:
            streams = streams_for(entry.config, info, model=entry.cache_model)
        except RequestError:
            return False
        # a worker left unfollowed (`FalseHitResponse`) is compared with the streams it had
        left = self._unfollowed(entry.id)
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
            await self._registrar.register(entry, restarted=True)
        except RequestError as exc:
            self._notes.refused(entry, exc)
        return True

    def _recheck_role(self, entry: WorkerEntry, spec: EngineSpec, info: dict[str, Any]) -> None:
        """Take the role and bootstrap port a returning worker advertises now (`role_of`: its
        config's first). A prefill whose bootstrap port is left to the system binds another
        one each start, and a process may come back as the other side of the pairs. Before,
        the first process's stayed, as nothing else in its settings changed: every pair
        through it named a bootstrap port nobody listened on (the decode's 502
        `kv_transfer_failed`, for good), or a decode worker was sent prefill legs."""
        role, port = role_of(entry, spec, info)
        advertised_role, advertised_port = spec.advertised_role(info)
        self._notes.check_role(entry, advertised_role)
        self._notes.check_bootstrap_port(entry, role, advertised_port)
        was_role, was_port = entry.role, entry.bootstrap_port
        # the advertised port is kept even when the config's wins: a pair failing through it
        # says both (`router.http.bootstrap_unreachable`)
        self._pool.set_role(entry, role, port, advertised_port=advertised_port)
        if (role, port) == (was_role, was_port):
            return
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
            models = await self._registrar.served_models(entry, spec, None)
        except RequestError as exc:
            log.warning("worker %s: %s", entry.id, exc)
            return False
        if models != entry.models and self._pool.find(entry.id) is entry:
            log.warning("worker %s now serves %s", entry.id, ", ".join(models) or "no model")
            try:
                # its cache is another model's: new streams
                await self._registrar.register(entry, restarted=True)
            except RequestError as exc:
                log.warning("worker %s: %s", entry.id, exc)
            return True
        return False
