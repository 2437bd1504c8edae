"""Registering a worker: reading what it serves and where its KV events come from, trusting them
or not, and subscribing.

A worker's KV-event streams come from its config or its `/server_info`, and the models it
serves from its config, its `/server_info` or its `/v1/models` (`router.fleet.worker_settings`
reads them, `router.fleet.discovery` interprets them); its role in the prefill/decode pairs
from its config, else what its server info advertises. Its streams are checked against what it
says (`router.fleet.advertised`) and against the other workers' before they are subscribed: one
publisher is one engine's cache, and two workers on it would each be predicted the other's
pages. What a registration finds is said once per worker (`router.fleet.registration_notes`).

The supervisor decides when a worker is registered (its first health check that passes, an
add) and `router.fleet.rereads` when it is registered anew; `Registrar` is the one doing it, so
both register a worker the same way.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from indexer.config import StreamConfig
from indexer.engines import SGLANG, EngineSpec, PdRole, engine_spec
from indexer.service import IndexerService
from router.config import HealthConfig, TokenizerConfig
from router.errors import RequestError
from router.fleet.advertised import block_size_note, check_ranks, check_topic, replay_proof
from router.fleet.discovery import (
    caches_prompts_late,
    capacity_from_server_info,
    flushes_by_salt,
    host_capacity_from_server_info,
    max_running_from_server_info,
    needs_discovery,
    settings_note,
    streams_for,
    version_from_server_info,
)
from router.fleet.false_hits import FalseHitWatch
from router.fleet.registration_notes import RegistrationNotes
from router.fleet.reread_schedule import RereadSchedule
from router.fleet.tokenizer_match import tokenizer_mismatch
from router.fleet.worker_settings import read_served_models, read_server_info
from router.routing.pool import WorkerEntry, WorkerPool

__all__ = ["Registrar", "role_of"]

log = logging.getLogger(__name__)


def role_of(
    entry: WorkerEntry, spec: EngineSpec, info: dict[str, Any] | None
) -> tuple[PdRole, int | None]:
    """The worker's prefill/decode role and bootstrap port: its config's, else what its
    server info (`info`, None: not read) advertises; a server without settings does whole
    requests.

    Not read again here when `info` is None: `Registrar.register` read it already, and a second
    try on a server that did not answer doubled a hung worker's registration (two more paths
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


class Registrar:
    """Reads a worker's settings and models and registers it with the indexer and the pool."""

    def __init__(
        self,
        pool: WorkerPool,
        indexer: IndexerService,
        session: aiohttp.ClientSession,
        health: HealthConfig,
        notes: RegistrationNotes,
        schedule: RereadSchedule,
        watch: FalseHitWatch,
        tokenizer: TokenizerConfig | None,
    ) -> None:
        self._pool = pool
        self._indexer = indexer
        self._session = session
        self._health = health
        # what was said of each worker's registration, shared with the supervisor (which says
        # the refusals) and the re-reads
        self._notes = notes
        # told when a worker's settings were read (the slow cadence counts from there)
        self._schedule = schedule
        # a streak of false hits was the old registration's: forgotten by a new one
        self._watch = watch
        # the router's tokenizer, which each worker's advertised one is held against
        # (`router.fleet.tokenizer_match`; None: not compared)
        self._tokenizer = tokenizer

    def reconfigure(self, health: HealthConfig) -> None:
        """Timeouts by `health` from now on (a reload)."""
        self._health = health

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
        role, bootstrap_port = role_of(entry, spec, info)
        advertised_port = None
        if info is not None:
            advertised_role, advertised_port = spec.advertised_role(info)
            self._notes.check_role(entry, advertised_role)
            self._notes.check_bootstrap_port(entry, role, advertised_port)
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
                self._pool.set_role(entry, role, bootstrap_port, advertised_port=advertised_port)
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
            await self._indexer.add_worker(entry.id, streams, restarted=restarted, url=entry.server)
        try:
            self._pool.set_role(entry, role, bootstrap_port, advertised_port=advertised_port)
            self._pool.set_models(entry, models, adapters)
            self._notes.say_ambiguous(entry)
            self._notes.check_named(entry, advertised)
            self.check_tokenizer(entry, info)
            self._notes.check_settings(entry.id, settings_note(info))
            entry.streams = [s.endpoint for s in streams]
            entry.capacity_tokens = capacity
            entry.host_capacity_tokens = host_capacity
            entry.flushes_by_salt = flushes_by_salt(info)
            entry.max_running_requests = max_running
            entry.caches_prompts_late = caches_prompts_late(entry.config.engine, info)
            entry.version = version_from_server_info(info)
            entry.discovered = True
            if info is not None:
                self._schedule.read(entry.id)
            self._watch.forget(entry.id)  # a streak was the old registration's
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

    def check_tokenizer(self, entry: WorkerEntry, info: dict[str, Any] | None) -> None:
        """Say when the tokenizer `entry`'s server info (just read; None: not read, what was
        said stays) says cannot be the router's (once per worker and finding)."""
        if info is not None and self._tokenizer is not None:
            self._notes.check_tokenizer(entry.id, tokenizer_mismatch(self._tokenizer, info))
