"""Reload without a restart: SIGHUP and `POST /admin/reload` re-read the router's config file.

The file is read (once, off the event loop: `ConfigSource`) and validated first, as a start
validates it (`router.http.start_checks`: the tokenizer loads, the admin API has a token off
loopback...), restart-only keys included; an invalid one changes nothing (`ReloadError` names
the key). Before, only the parse was checked: a file a start refuses was answered 200 with the
key under `needs_restart`, and the next restart failed. Then `router.config_diff` says what
differs, and `Reloader.apply` is the one path that changes a running router:

1. settings, all at once and without awaiting, so no request sees half of a reload: the
   running config (`LiveConfig`, what the proxy, the admin API and the KV query API read per
   request), the policy's weights (planner and decode side), the proxy's limits and timeouts,
   health checks, breakers, and the listener's limits for the connections accepted from now on;
2. then the workers, the way the admin API changes them (`Supervisor.add` / `remove`), and with
   a `[cluster]` written to the shared fleet the same way, so every replica agrees. The new
   ones are added first, and taken traffic only once registered and health-checked; then the
   old ones are removed (a fleet swapped whole keeps serving, as long as the new ones register
   within the add's wait; else its model answers 503 until one does). A removed worker takes no new
   request; those it is serving finish. A worker whose settings changed is removed and added
   again, and a worker renamed (its server under a new id: one server is one worker in the
   pool) is removed before its new id is added (a drain follows the server to it). While
   these changes are under way (`Reloader.fleet_change`), a request that finds no worker for
   its model, or only ones still being checked, waits for their end and is then routed
   (`Proxy`), bounded by its deadline: before, the requests of a rename got a 404
   `UnknownModelError` (the model served by nobody for an instant), then 503s until the new
   ids were checked. Workers added or removed through
   the admin API since are left as they are: the diff is the old file against the new one. A
   new worker is waited for as an admin add waits (`ADD_WAIT_TIMEOUTS` health timeouts, all at
   once): one whose HTTP hangs goes on being discovered in the background, `checking`
   meanwhile, and the answer says so.

Keys that need a restart are kept at their running value and listed in the answer.

Under `kvroute serve --processes N`, a SIGHUP to the parent reaches every process, but
`POST /admin/reload` reaches the one the kernel handed the connection: `reload_everywhere`
then tells the host's other processes, through the parent (`router.http.reload_link`), to
read the file too, and its answer says how many were told. A refused file is refused by every
process alike (they read the same file), so the others are told only of a reload that applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, TypeVar

import msgspec

from router.config import LiveConfig, RouterConfig, WorkerConfig
from router.config_diff import ConfigDiff, diff_configs, worker_settings
from router.errors import ConfigError, NotFoundError, ReloadError
from router.fleet.change import FleetChange
from router.fleet.supervisor import Supervisor
from router.http.listener import GuardedServer
from router.http.pd import PairDispatcher
from router.http.proxy import Proxy
from router.http.start_checks import StartChecks
from router.routing.pd import PairPlanner
from router.routing.planner import Planner

if TYPE_CHECKING:  # nats is imported only by a router that has a [cluster]
    from router.cluster.service import ClusterService
    from router.http.reload_link import ProcessesTold

__all__ = ["ConfigSource", "Reloader"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class ConfigSource:
    """Where the running config came from: a file, read again by `load` with the same
    command-line overrides applied (`kvroute serve --port` stays what it was).

    `kvroute serve`'s loader reads the file once and parses those bytes, refusing what is no
    regular file, one over `router.config.MAX_CONFIG_BYTES`, and an empty one (a file caught
    mid-save: applied, it would drop every worker): `read_config_file(path, reloading=True)`.
    `Reloader` runs it on a thread: a file on a stalled network mount holds the reload, not
    the router.

    `modified_at`: the file's modification time as last read (None: unknown), taken just
    before: with a `[cluster]`, a worker's entry edited in a newer file than the one the
    cluster's record came from is written over the record at start
    (`router.cluster.fleet_state`)."""

    def __init__(self, path: str, load: Callable[[], RouterConfig]) -> None:
        self.path = path
        self._load = load
        self.modified_at = _modified_at(path)  # made just after the start read it

    def load(self) -> RouterConfig:
        """The file's config now (ConfigError naming the key when it is invalid)."""
        modified_at = _modified_at(self.path)  # before: an edit meanwhile reads as newer
        config = self._load()
        self.modified_at = modified_at
        return config


def _modified_at(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except (OSError, ValueError):
        return None


class Reloader:
    """Applies a new config to the running router's parts."""

    def __init__(
        self,
        live: LiveConfig,
        source: ConfigSource | None,
        planner: Planner,
        supervisor: Supervisor,
        proxy: Proxy,
        pairs: PairPlanner,
        dispatcher: PairDispatcher | None,
        *,
        checks: StartChecks | None = None,
    ) -> None:
        self._live = live
        self.source = source
        # what a start refuses of a config, as this process was started (`START_CHECKS`)
        self._checks = checks or StartChecks()
        self._planner = planner
        self._supervisor = supervisor
        self._proxy = proxy
        self._pairs = pairs
        self._dispatcher = dispatcher
        # set once they exist: the listener when the server starts, the cluster link after it
        self.listener: GuardedServer | None = None
        self.cluster: ClusterService | None = None
        # under --processes: tells the host's other processes to reload (`reload_link`)
        self.siblings: Callable[[], Awaitable[ProcessesTold]] | None = None
        self._lock = asyncio.Lock()  # one reload at a time (a SIGHUP during a POST)
        self._running: set[asyncio.Task[object]] = set()
        # under way while `apply` changes the workers: the proxy waits for its end
        self.fleet_change = FleetChange()

    async def reload(self) -> ConfigDiff:
        """Read the file again and apply it; ReloadError (nothing changed) when it is invalid.

        The reload runs to its end even if the caller is cancelled (an admin client that
        hangs up): a fleet half changed would match neither file.
        """
        return await self._to_the_end(self._reload())

    async def reload_everywhere(self) -> tuple[ConfigDiff, ProcessesTold | None]:
        """`reload`, then under `--processes` the other processes told to reload too (what
        was told; None for a router of one process): `POST /admin/reload`. Told even if the
        caller is cancelled once this process has reloaded: else the processes would differ."""
        return await self._to_the_end(self._reload_everywhere())

    async def _reload_everywhere(self) -> tuple[ConfigDiff, ProcessesTold | None]:
        diff = await self._reload()  # refused: the others would refuse the same file
        siblings = self.siblings
        return diff, None if siblings is None else await siblings()

    async def _to_the_end(self, work: Coroutine[object, object, _T]) -> _T:
        task = asyncio.get_running_loop().create_task(work, name="kvroute-reload")
        self._running.add(task)
        task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task[object]) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a refusal nobody awaited any more is logged already

    async def _reload(self) -> ConfigDiff:
        source = self.source
        if source is None:
            raise ReloadError(
                "this router has no config file to read again (started without one, or by "
                "`kvroute up`, which reads its config once): restart it to change its config"
            )
        async with self._lock:
            try:
                # off the event loop: reading and parsing up to 16 MiB of TOML takes a while,
                # and loading a tokenizer file longer
                new = await asyncio.to_thread(self._checked, source, self._live.current)
            except ConfigError as exc:
                log.warning("config reload refused, the running config is kept: %s", exc)
                raise ReloadError(f"{exc} (the running config is kept)", key=exc.key) from exc
            config, diff = diff_configs(self._live.current, new)
            try:
                self._check_servers(config, diff)
            except ReloadError as exc:
                log.warning("config reload refused, the running config is kept: %s", exc)
                raise
            self._file_in_fleet(source, config, diff)
            await self.apply(config, diff)
            arrived = [*diff.workers_added, *diff.workers_changed]
            waiting = self._unregistered(arrived)
            doubts = {w: why for w in arrived if (why := self._supervisor.doubt(w)) is not None}
            kept = self._kept_by_cluster(source, config, diff)
            if waiting or doubts or kept:
                diff = msgspec.structs.replace(
                    diff, not_registered=waiting, warnings=doubts, kept_by_cluster=kept
                )
        log.info("config reloaded from %s: %s", source.path, diff.summary())
        return diff

    def _checked(self, source: ConfigSource, running: RouterConfig) -> RouterConfig:
        """The file's config, refused (ConfigError naming the key) as a start would refuse it
        (`StartChecks.reload`)."""
        new = source.load()
        self._checks.reload(new, running)
        return new

    def _file_in_fleet(self, source: ConfigSource, config: RouterConfig, diff: ConfigDiff) -> None:
        """With a `[cluster]`: the workers this reload changes are the file's edits, and the
        records written of them say what the file names now (`FleetState.filed`), so a replica
        starting later with this file takes them as the cluster's."""
        if self.cluster is None:
            return
        fleet = self.cluster.fleet
        fleet.file_path, fleet.file_at = source.path, source.modified_at
        by_id = {w.worker_id: w for w in config.workers}
        for worker_id in (*diff.workers_added, *diff.workers_changed):
            fleet.filed(worker_id, by_id[worker_id])
        for worker_id in diff.workers_removed:
            fleet.filed(worker_id, None)

    def _kept_by_cluster(
        self, source: ConfigSource, config: RouterConfig, diff: ConfigDiff
    ) -> dict[str, str]:
        """With a `[cluster]`: the workers the file names, their entries unchanged by this
        reload, that run otherwise (or not at all) as the cluster's record has them, with why,
        each said in a WARNING line. The file's entry is applied when it is edited (a reload
        diffs the file against the file as last read, so an admin change stands): before,
        nothing said that the record won over the file (QA: `workers_changed: []`)."""
        if self.cluster is None:
            return {}
        how = (
            "to use the file's entry, edit it and reload, or change the worker through the "
            "admin API (DELETE, then POST /admin/workers)"
        )
        moved = {*diff.workers_added, *diff.workers_changed}
        kept: dict[str, str] = {}
        for worker in config.workers:
            if worker.worker_id in moved:
                continue
            entry = self._planner.pool.find(worker.worker_id)
            if entry is None:
                why = f"removed from the shared fleet (through the admin API); {how}"
            elif entry.config != worker:
                theirs = ", ".join(
                    f"{name} {value}" for name, _, value in worker_settings(worker, entry.config)
                )
                why = (
                    f"runs as the cluster's record has it ({theirs}): an admin change, or "
                    f"another replica's newer config file; the entry did not change since this "
                    f"replica last read the file; {how}"
                )
            else:
                continue
            kept[worker.worker_id] = why
            log.warning(
                "config reload: worker %s of %s is not applied: %s",
                worker.worker_id,
                source.path,
                why,
            )
        return kept

    def _unregistered(self, worker_ids: list[str]) -> dict[str, str]:
        """The workers of `worker_ids` in the pool not registered yet, with why: still being
        discovered in the background, refused, or not answering."""
        waiting: dict[str, str] = {}
        for worker_id in worker_ids:
            why = self._supervisor.not_registered(worker_id)
            if why is not None:
                waiting[worker_id] = why
        return waiting

    def _check_servers(self, config: RouterConfig, diff: ConfigDiff) -> None:
        """ReloadError when a worker the file adds is a server the pool keeps under another id
        (one added through the admin API): checked before anything is applied, so a refused
        reload changes nothing."""
        coming = {*diff.workers_added, *diff.workers_changed}
        leaving = {*diff.workers_removed, *coming}
        kept = {e.config.server: e.id for e in self._planner.pool if e.id not in leaving}
        for worker in config.workers:
            other = kept.get(worker.server)
            if worker.worker_id in coming and other is not None:
                raise ReloadError(
                    f"worker {worker.worker_id!r}: {worker.url} is worker {other!r} already "
                    "(added through the admin API?): remove one of them (the running config "
                    "is kept)",
                    key="workers",
                )

    async def apply(self, config: RouterConfig, diff: ConfigDiff) -> None:
        """Run on `config` (restart-only keys already at their running values), changing the
        workers `diff` names."""
        # 1. settings: no await until all of them are in place
        self._live.current = config
        self._planner.reconfigure(config.policy)
        self._pairs.reconfigure(config.policy, config.pd)
        self._proxy.reconfigure(config)
        if self._dispatcher is not None:
            self._dispatcher.reconfigure(config)
        self._supervisor.reconfigure(config.health)
        self._planner.pool.reconfigure(config.breaker)
        if self.listener is not None:
            self.listener.reconfigure(config.limits)
        # 2. the fleet: a request its changes leave without a worker meanwhile waits for the
        # end instead of failing (`router.fleet.change`)
        if diff.workers_added or diff.workers_removed or diff.workers_changed:
            with self.fleet_change.changing():
                await self._change_workers(config, diff)

    async def _change_workers(self, config: RouterConfig, diff: ConfigDiff) -> None:
        by_id = {w.worker_id: w for w in config.workers}
        pool = self._planner.pool
        added = [*diff.workers_added, *diff.workers_changed]
        # the server each arriving id takes (one server is one worker in the pool)
        taking = {by_id[worker_id].server: worker_id for worker_id in added}
        # An operator's drain is of a server: it outlives a change of the worker's settings
        # and follows the server to whichever id the file gives it (a rename, two ids
        # swapped). Before, a drained worker renamed came back under its new id ready, and
        # took traffic again in the middle of its maintenance; with two ids swapped, the drain
        # stayed with the id, on the other server.
        drained_servers = {
            entry.config.server
            for worker_id in (*diff.workers_changed, *diff.workers_removed)
            if (entry := pool.find(worker_id)) is not None and entry.draining
        }
        drained = {taking[server] for server in drained_servers if server in taking}
        # New workers first, checked (registered, health passed) before the old ones go: a
        # fleet swapped whole in one reload keeps a routable worker of its model throughout,
        # unless the new ones are still being discovered when the add's wait ends (503s then).
        # Before, the old ones went first, and the requests of the gap got 404 (the model was
        # served by nobody) until the new ones were discovered.
        # Only a leaving worker on a server an arriving one takes goes first (one server is one
        # worker in the pool), and a changed one is removed and added again under its id.
        first = [
            worker_id
            for worker_id in diff.workers_removed
            if (entry := pool.find(worker_id)) is not None and entry.config.server in taking
        ]
        # Their removal is told the other replicas only after the new ids' records: there the
        # new id takes the server from the old one in one change (`FleetState.apply_worker`).
        # Told first, it left their pools without the server until this replica had
        # registered the new id (404s and 503s there, none here).
        for worker_id in first:
            await self._remove(worker_id, publish=False)
        for worker_id in diff.workers_changed:
            # the new record replaces the old one on every replica: no removal to publish
            await self._remove(worker_id, publish=False)
        # at once, each bounded (`Supervisor.add`): a worker whose HTTP hangs is left to its
        # background discovery, and the old workers go all the same
        await asyncio.gather(
            *(self._add(by_id[worker_id], draining=worker_id in drained) for worker_id in added)
        )
        for worker_id in first:
            await self._publish_removal(worker_id)
        for worker_id in diff.workers_removed:
            if worker_id not in first:
                await self._remove(worker_id, publish=True)

    async def _remove(self, worker_id: str, *, publish: bool) -> None:
        with contextlib.suppress(NotFoundError):  # an admin removed it already
            await self._supervisor.remove(worker_id)
        if publish:
            await self._publish_removal(worker_id)

    async def _publish_removal(self, worker_id: str) -> None:
        if self.cluster is not None:
            await self.cluster.worker_changed(worker_id, None, removed=True)

    async def _add(self, config: WorkerConfig, *, draining: bool = False) -> None:
        existing = self._planner.pool.find(config.worker_id)
        if existing is not None:
            if existing.config == config:
                return  # an admin added it already, as the file says
            await self._supervisor.remove(config.worker_id)
        # as at startup: a worker not up yet is retried on every health round
        entry = await self._supervisor.add(config, must_register=False, draining=draining)
        if self.cluster is not None:
            await self.cluster.worker_changed(entry.id, entry.config, draining=entry.draining)
