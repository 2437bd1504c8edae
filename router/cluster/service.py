"""`ClusterService`: this replica's connection to the others, owned by the router app.

    async with ClusterService(config.cluster, planner, supervisor, config.workers) as cluster:
        ...  # the planner now publishes its decisions and sees the other replicas'

Entering connects to NATS and, within `startup_timeout_s`, seeds and reads the shared fleet,
loads the latest index snapshot (the workers' replay then brings each stream to now, and the
streams are proven before the replica says it is ready), and starts publishing. If NATS does
not answer in time the replica serves on local state, `status` says DEGRADED (as `/health` and
`/metrics` do) with one log line, and the connection keeps trying: when NATS answers (at start
or after an outage) the replica resyncs (admin writes it kept, the whole fleet read again,
a heartbeat listing its requests in flight) and says so in one line.

Dashboard logouts are shared like admin changes (`session_ended`, the `<prefix>_sessions`
bucket: `router.cluster.fleet_state`): a logout on one replica ends the session on all, kept for
the resync while NATS is away. Until its first read of that bucket a replica accepts only the
sessions it started itself (another's logout may be there: `SessionBook.expect_revocations`).

Background tasks (connection, publisher, heartbeats, KV watchers) live in one TaskGroup owned
here, each handling its own recoverable errors and stopping on cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import os
import re
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from indexer.errors import SnapshotError
from indexer.namespace import Namespace
from indexer.stats import StreamState
from router.cluster.errors import ClusterError
from router.cluster.fleet_state import (
    EVICTION_TTL_S,
    LOGOUT_TTL_S,
    FleetState,
    SessionBook,
    worker_key,
)
from router.cluster.nats_client import (
    Replacements,
    TlsGuardedClient,
    TlsNotOffered,
    attempt_error,
    close_client,
    stop_retrying,
)
from router.cluster.outbox import Outbox
from router.cluster.peers import Peers
from router.cluster.relay_follower import RelayFollower
from router.cluster.snapshots import fetch_snapshot, publish_snapshot
from router.cluster.tasks import StoppableTaskGroup
from router.cluster.wire import Batch, Begin, Decision, Goodbye, batch_decoder, encoder
from router.config import ClusterConfig, WorkerConfig
from router.fleet.change import FleetChange
from router.fleet.supervisor import Supervisor
from router.routing.planner import Planner

__all__ = ["ClusterService", "ClusterStatus", "Sharing", "replica_name"]

log = logging.getLogger(__name__)

# what a NATS call may fail with: the client's errors, a deadline, a socket
_NATS_ERRORS = (nats.errors.Error, TimeoutError, OSError, ClusterError)
# how long a stop waits for the background tasks to end, cancelling again those that lost a
# cancellation (`router.cluster.tasks`), before it leaves them behind, said
STOP_TIMEOUT_S = 5.0
# how long an admin write waits for NATS before it is kept for the resync
WRITE_TIMEOUT_S = 2.0
# streams whose entries cannot hit yet (a gap being repaired too: it ends within a replay)
_UNPROVEN = (StreamState.SYNCING, StreamState.DEGRADED, StreamState.UNVERIFIED)


# how nats-server words a refused login in its -ERR (nats-py raises a bare `Error` with it
# while connecting, `AuthorizationError` after): a bad user, password, token or credentials
_AUTH_REFUSED = re.compile(r"authori[sz]ation|authentication", re.IGNORECASE)


class ClusterStatus(enum.StrEnum):
    """Where this replica stands with the others."""

    WARMING = "warming"  # starting: fleet, snapshot and streams not read yet
    OK = "ok"  # connected, in step with the others
    DEGRADED = "degraded"  # NATS away: serving on local state


class Sharing(enum.StrEnum):
    """Where an admin change made here stands with the other replicas (its answer's `cluster`)."""

    SHARED = "shared"  # written to NATS: every replica makes it, a restart reads it back
    # applied here only, kept in this process until NATS answers: the others do not know it
    # yet, and it is lost if this replica stops before then (said in one WARNING line)
    PENDING = "pending"


def replica_name() -> str:
    """host-pid-random: unique per process start, so a restart is a new replica."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:32] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class ClusterService:
    """Publishes this replica's decisions, applies the others', shares fleet and snapshots."""

    def __init__(
        self,
        config: ClusterConfig,
        planner: Planner,
        supervisor: Supervisor,
        seed_workers: Sequence[WorkerConfig] = (),
        fleet_change: FleetChange | None = None,
        sessions: SessionBook | None = None,
    ) -> None:
        """`sessions`: the dashboard's (behind an admin token), which the logouts of every
        replica end."""
        self.config = config
        self.replica = config.replica_id or replica_name()
        # the refusals (TLS not offered, credentials refused) logged since NATS last answered
        self._refusals_said: set[str] = set()
        # the pause before replacing a NATS client closed for good, and the reasons said since
        # the last resync (`_connect`)
        self._replacements = Replacements()
        self._sync_error = ""  # the last sync failure logged: each new one is logged once
        self.status = ClusterStatus.WARMING
        self._planner = planner
        self._indexer = planner.indexer
        self._seed_workers = tuple(seed_workers)
        # decisions name the server of each worker id besides the id: a replica that took an
        # id swap in before or after the sender applies them where they were meant
        self.outbox = Outbox(server_of=planner.pool.server_of)
        self.peers = Peers(
            self.replica,
            planner.indexer,
            planner.load,
            config.heartbeat_timeout_s,
            book=planner,
            servers=planner.pool,
        )
        self.peers.joined = lambda _replica: self.outbox.resend_shadows()
        # the shadows other replicas sent are sent again too: the replica that made them may
        # be the one coming back, with nothing of its own left
        self.peers.shadow_seen = self.outbox.remember
        self._instance = secrets.token_hex(8)
        # the fleet records' changes are waited out by requests as a reload's are: the
        # reloader's `fleet_change`, which the proxy waits on
        self.fleet = FleetState(
            self.replica, supervisor, planner.pool, planner.indexer, fleet_change
        )
        self.fleet.sessions = sessions
        prefix = config.subject_prefix
        self.subject = f"{prefix}.replica.{self.replica}"
        self._fleet_bucket = f"{prefix}_fleet"
        self._evictions_bucket = f"{prefix}_evictions"
        self._sessions_bucket = f"{prefix}_sessions"
        self._index_bucket = f"{prefix}_index"
        self._nc: NATS | None = None
        self._connecting: NATS | None = None  # the newest client, connected or not yet
        self._js: JetStreamContext | None = None
        self._kv: dict[str, KeyValue] = {}
        self._group = StoppableTaskGroup()
        self._tasks: list[asyncio.Task[None]] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._sync_task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._serving = False  # startup is over: the replica takes requests
        # when this process's index began (cold: the workers' replay fills it): an eviction
        # record older than that never applies here, as of the snapshot a warm start loads
        self._started_at = time.time()
        self._synced = False  # a sync read the eviction records once since the start
        self._closing = False
        self._last_snapshot = time.monotonic()
        # routing decisions published: one per worker a request was sent to (its `Begin`: a
        # retry's attempts and a pair's sides apart), not the pending marks, shadows, first
        # bytes, ends and heartbeats that go with them
        self.published = 0
        self.bad_messages = 0
        self.nats_errors = 0
        self._last_error = ""  # the client's last failed attempt, for the startup line
        # the warm start: the snapshot's wall time, how long fetching and loading it took
        self.snapshot_at: float | None = None
        self.fetch_s: float | None = None  # of which reading it from JetStream
        # the relay's records applied here (`[cluster] events = "relay"`), once synced
        self.follower: RelayFollower | None = None
        self.warm_start_s: float | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> ClusterService:
        await self._group.__aenter__()
        self._planner.decisions = self.outbox
        if self.fleet.sessions is not None:
            # before the first request: the logouts made elsewhere are not read yet
            self.fleet.sessions.expect_revocations()
        for loop in (self._connect, self._publisher, self._heartbeats):
            self._spawn(loop())
        try:
            async with asyncio.timeout(self.config.startup_timeout_s):
                await self._ready.wait()
        except TimeoutError:
            # why, when NATS never answered (a refused connection and a server that does not
            # speak NATS read the same before), as `kvroute relay` says it
            last = self._last_error if not self.connected else ""
            self._degrade(
                f"NATS at {', '.join(self.config.shown_servers)} (or the shared fleet, or the warm "
                f"start) did not answer within {self.config.startup_timeout_s:g} s"
                + (f" (last attempt: {last})" if last else "")
            )
        self._serving = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        self._planner.decisions = None
        self.outbox.sending = False
        if self.fleet.unsent:
            # kept in memory only (a file would be replayed over what the others changed since):
            # the operator is told what to make again
            log.warning(
                "cluster: stopping with admin change(s) NATS never took, lost: %s; make them "
                "again once NATS answers",
                ", ".join(self.fleet.describe_unsent()),
            )
        for client in (self._connecting, self._nc):
            if client is not None:
                stop_retrying(client)  # its connect loop ends even if a cancellation is lost
        for task in [*self._tasks, *self._watchers, self._sync_task]:
            if task is not None:
                task.cancel()
        try:
            if self.follower is not None:
                await self.follower.stop()
            # bounded: a task that lost its cancellation made it wait forever (NATS down)
            left = await self._group.stop(STOP_TIMEOUT_S)
            if left:
                log.warning(
                    "cluster: %d background task(s) still running %g s after being told to "
                    "stop, left behind (%s); stopping anyway",
                    len(left),
                    STOP_TIMEOUT_S,
                    ", ".join(getattr(t.get_coro(), "__qualname__", t.get_name()) for t in left),
                )
        finally:
            nc, self._nc = self._nc, None
            if nc is not None:
                await self._say_goodbye(nc)
                await close_client(nc, 2.0)
            if self._connecting is not None and self._connecting is not nc:
                # one stopped mid-attempt (its connect task cancelled) holds that attempt's
                # socket: closed too (it was left to the garbage collector)
                await close_client(self._connecting, 2.0)
            self.peers.clear()

    async def _say_goodbye(self, nc: NATS) -> None:
        """Tell the others this replica stops (`Goodbye`), after everything it published (its
        publisher has stopped): the close writes it out. Not connected, nothing is sent (the
        others find it silent, as after a crash)."""
        if not nc.is_connected:
            return
        # what the publisher had not sent yet goes first (the last requests' ends: before, they
        # were dropped, and the others said it stopped with requests in flight it had ended)
        said = [*self.outbox.take(), Goodbye()]
        data = encoder.encode(Batch(self.replica, time.time(), said, self._instance))
        with contextlib.suppress(*_NATS_ERRORS):
            # publish buffers, and waits only on a full buffer: bounded all the same (a stop
            # never waits on NATS for long)
            async with asyncio.timeout(0.5):
                await nc.publish(self.subject, data)

    def _spawn(self, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = self._group.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._tasks_done)
        return task

    def _tasks_done(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    # ------------------------------------------------------------------ status

    @property
    def connected(self) -> bool:
        """Whether the NATS connection is up now."""
        return self._nc is not None and self._nc.is_connected

    def _degrade(self, reason: str) -> None:
        if self.status is ClusterStatus.DEGRADED or self._closing:
            return
        self.status = ClusterStatus.DEGRADED
        log.warning("cluster degraded: %s; serving on local state until NATS answers", reason)

    def _become_ok(self) -> None:
        self._refusals_said.clear()
        self._replacements.worked()
        if self.status is ClusterStatus.DEGRADED:
            log.warning(
                "cluster resynced: NATS answers again, %d other replica(s) heard so far",
                len(self.peers.live()),
            )
        self.status = ClusterStatus.OK
        self._ready.set()

    def describe(self) -> dict[str, object]:
        """What `/health` says of the cluster."""
        return {
            "status": str(self.status),
            "replica": self.replica,
            "replicas": 1 + len(self.peers.live()),
        }

    def gauges(self) -> dict[str, float]:
        """What `/metrics` exports as `kvroute_cluster_<name>`."""
        return {
            "degraded": float(self.status is not ClusterStatus.OK),
            "replicas": float(1 + len(self.peers.live())),
            "decisions_published": float(self.published),
            "decisions_applied": float(self.peers.applied),
            "decisions_unmatched_pages": float(self.peers.unmatched_pages),
            "decisions_misaddressed": float(self.peers.misaddressed),
            "decisions_late": float(self._indexer.index.late_marks),
            "decisions_dropped": float(self.outbox.dropped),
            "unsent_admin_writes": float(len(self.fleet.unsent)),
            "evictions_applied": float(self.fleet.evictions_applied),
            **({} if self.follower is None else self.follower.gauges()),
        }

    # ------------------------------------------------------------------ connection

    async def _connect(self) -> None:
        """Connect (retrying until NATS answers), then sync; reconnects are the client's, and
        a client closed for good is replaced.

        nats-py closes its client for good, and tries no reconnect, on a server's `-ERR` other
        than a stale connection or a permissions violation (a line past the server's control
        line limit, credentials revoked while connected). Before, the replica then stayed
        degraded until it was restarted. Now a new client connects after a pause (`Replacements`:
        doubling while each one closes before the replica resynced) and syncs as after an
        outage; the closing is said once per reason.

        A connect the client gives up on at once (an option it refuses) leaves this replica
        degraded for good, said in one line: raised, it would take the task group and the
        router's startup down with it, as a bare cancellation."""
        while True:
            closed = asyncio.Event()
            try:
                nc = await self._open(closed)
            except nats.errors.Error as exc:
                self._degrade(f"the NATS client refused to connect ({type(exc).__name__}: {exc})")
                return
            try:
                await nc.subscribe(f"{self.config.subject_prefix}.replica.*", cb=self._on_message)
            except _NATS_ERRORS:
                pass  # closed meanwhile: `closed` is set, and a new client follows
            else:
                # a task, as a reconnect's sync is: a client closed meanwhile cancels it
                # (`_on_disconnected`), where it could wait for a watcher that ended with it
                self._sync_task = self._group.create_task(self._sync(first=True))
            await closed.wait()
            self.nats_errors += 1
            self._replacements.say_closed(nc, log, "cluster")
            await self._replacements.pause()

    async def _open(self, closed: asyncio.Event) -> NATS:
        """A new client, connected (retrying until NATS answers); `closed` is set when it is
        closed for good."""
        nc = TlsGuardedClient()
        self._connecting = nc  # a stop makes it try no more (`__aexit__`)
        interval = self.config.heartbeat_interval_s

        async def on_closed() -> None:
            closed.set()

        await nc.connect(
            servers=self.config.servers,
            name=self.replica,
            no_echo=True,  # our own decisions are applied already
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=min(1.0, interval),  # type: ignore[arg-type]
            connect_timeout=2,
            ping_interval=max(1, round(self.config.heartbeat_timeout_s)),
            max_outstanding_pings=2,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            closed_cb=on_closed,
        )
        self._nc = nc
        self._js = nc.jetstream(timeout=5.0)
        return nc

    async def _on_error(self, exc: Exception) -> None:
        # every failed attempt lands here: the state changes are what gets logged, once
        self.nats_errors += 1
        self._last_error = attempt_error(exc, self.config.servers)
        log.debug("nats: %s", self._last_error)
        refusal = self._refusal(exc)
        if refusal is None or refusal[0] in self._refusals_said:
            return
        kind, reason = refusal
        self._refusals_said.add(kind)
        if self.status is ClusterStatus.DEGRADED:
            log.warning("cluster: %s; still trying", reason)  # an outage said it already
        else:
            self._degrade(reason)

    def _refusal(self, exc: Exception) -> tuple[str, str] | None:
        """(kind, what to tell the operator) of a failed attempt that no waiting will mend;
        None for the others (a server down or restarting: the startup timeout says that).
        Before, a refused login read as "did not answer within 5 s" (only DEBUG lines named
        the Authorization Violation)."""
        if isinstance(exc, TlsNotOffered):
            return "tls", (
                "a tls:// URL asked for TLS, but the NATS server did not offer it: not talking "
                "to it in plain text, credentials unsent (use nats:// to allow plain text)"
            )
        auth = isinstance(exc, nats.errors.AuthorizationError) or (
            isinstance(exc, nats.errors.Error) and _AUTH_REFUSED.search(str(exc)) is not None
        )
        if auth:
            # the server's words are its own (no credentials in them); the URLs are redacted
            said = str(exc).removeprefix("nats: ").strip("'")
            return "auth", (
                f"NATS at {', '.join(self.config.shown_servers)} refused this replica's "
                f"credentials ({said}): check the user and password or token in [cluster] url"
            )
        return None

    async def _on_disconnected(self) -> None:
        self.outbox.sending = False
        self.outbox.clear()
        if self._sync_task is not None:
            self._sync_task.cancel()
        if self.follower is not None:
            # the relay's records cannot reach it now: its streams predict nothing at once
            self.follower.disconnected()
        self._degrade("lost the connection to NATS")

    async def _on_reconnected(self) -> None:
        if self._closing:
            return
        if self._sync_task is not None:
            self._sync_task.cancel()
        self._sync_task = self._group.create_task(self._sync(first=False))

    async def _sync(self, *, first: bool) -> None:
        """Bring this replica in step (retried with capped backoff while connected)."""
        delay = 0.1
        while True:
            try:
                # a warm start only before serving: a snapshot would replace a live index
                await self._sync_once(warm=first and not self._serving)
                return
            except _NATS_ERRORS as exc:
                if not self.connected:
                    return  # the reconnect starts another sync
                said = f"{type(exc).__name__}: {exc}"
                if said != self._sync_error:  # once per kind of failure, not every retry
                    self._sync_error = said
                    hint = ""
                    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
                        hint = "; is JetStream enabled on the server (nats-server -js)?"
                    log.warning("cluster sync failed (%s)%s; retrying", said, hint)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _sync_once(self, *, warm: bool) -> None:
        js, nc = self._js, self._nc
        assert js is not None and nc is not None
        first = not self._synced
        self._kv[self._fleet_bucket] = await js.create_key_value(
            bucket=self._fleet_bucket, history=1
        )
        self._kv[self._evictions_bucket] = await js.create_key_value(
            bucket=self._evictions_bucket, history=1, ttl=EVICTION_TTL_S
        )
        self._kv[self._sessions_bucket] = await js.create_key_value(
            bucket=self._sessions_bucket, history=1, ttl=LOGOUT_TTL_S
        )
        await self.fleet.flush(self._kv)  # what an operator changed here while NATS was away
        # after the first sync, from the pool as it runs: a bucket that lost its records gets
        # the fleet the replicas ran, not the config files' workers (drains and removals undone)
        await self.fleet.seed(self._kv[self._fleet_bucket], self._seed_workers, running=not first)
        if not first:
            await self.fleet.seed_logouts(self._kv[self._sessions_bucket])
        # the records already there: on this process's first read, those older than its index
        # (its start, or the snapshot it loaded) are not applied; later, every one not seen.
        # Before, the first read after a start while NATS was away applied every record of
        # the day, dropping pages stored since from this replica's index alone, for good
        for task in self._watchers:
            task.cancel()
        self._watchers = []
        # the fleet before the snapshot: a worker id the cluster re-pointed (another server
        # than this replica's config file names) is followed at the cluster's server when the
        # snapshot's stream of it is proven. Before, the warm start proved that stream against
        # the file's server and cleared it (`the publisher's newest seq is 0, below ours`)
        await self._watch_fleet()
        newer_than: float | None = None
        if first:
            loaded = await self._warm_start(js) if warm else None
            newer_than = self._started_at if loaded is None else loaded
        await self._watch_records(newer_than=newer_than)
        self.fleet.fleet_read = True
        if self.fleet.sessions is not None:
            self.fleet.sessions.revocations_known()
        if self.config.events == "relay":
            if self.follower is None:
                await self._follow(nc, since=newer_than if warm and self.snapshot_at else None)
            elif not first:
                # NATS came back (perhaps without its store): the consumer is made again
                await self.follower.resubscribe(nc)
        self._synced = True
        if warm and self.snapshot_at is not None:
            await self._streams_proven()
        self.outbox.sending = True
        self.outbox.heartbeat()
        self._sync_error = ""
        self._become_ok()

    async def _warm_start(self, js: JetStreamContext) -> float | None:
        """Load the latest snapshot, if any; returns its wall time."""
        started = time.perf_counter()
        got = await fetch_snapshot(js, self._index_bucket)
        if got is None:
            return None
        data, at = got
        self.fetch_s = time.perf_counter() - started
        try:
            self._indexer.load(data)
        except SnapshotError as exc:
            log.warning(
                "cluster: the index snapshot in JetStream is unusable (%s): cold start", exc
            )
            return None
        self.snapshot_at = at
        self.warm_start_s = time.perf_counter() - started
        log.info(
            "cluster: index loaded from a %.0f s old snapshot (%d bytes) in %.2f s",
            time.time() - at,
            len(data),
            self.warm_start_s,
        )
        return at

    async def _follow(self, nc: NATS, *, since: float | None) -> None:
        """Start applying the relay's records (`router.cluster.relay_follower`); a cold start
        waits (bounded) until what the relay's stream held is applied."""
        follower = RelayFollower(self.config, self._indexer, clock=time.monotonic)
        await follower.start(nc, since=since)
        self.follower = follower
        if since is None:
            try:
                async with asyncio.timeout(self.config.startup_timeout_s / 2):
                    await follower.caught_up.wait()
            except TimeoutError:
                log.warning("cluster: the relay's stream not read to its end yet; serving anyway")

    async def _streams_proven(self) -> None:
        """Wait (bounded by the caller's startup deadline) until the replay proved the streams
        the snapshot continued, so the first request routed here can hit."""
        try:
            async with asyncio.timeout(self.config.startup_timeout_s / 2):
                # polled: the indexer has no event for "every stream proven" (and needs none)
                # a follower of the relay waits for its fresh word too (what it read back from
                # the stream says nothing of now: STALE until then)
                unproven = _UNPROVEN if self.follower is None else (*_UNPROVEN, StreamState.STALE)
                while any(s.state in unproven for s in self._indexer.streams()):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
        except TimeoutError:
            # the one WARNING of a warm start: loading says itself at INFO per stream (each
            # one's proof, or its clear, follows), since every warm start loads every stream
            unproven_now = sorted(s.stream for s in self._indexer.streams() if s.state in unproven)
            log.warning(
                "cluster: %d stream(s) still unproven after the warm start (%s): they predict "
                "nothing until a replay proves them; serving anyway",
                len(unproven_now),
                ", ".join(unproven_now[:8]) + (", ..." if len(unproven_now) > 8 else ""),
            )

    # ------------------------------------------------------------------ fleet and evictions

    async def _watch_fleet(self) -> None:
        """Start the fleet bucket's watcher; returns once it has applied what the bucket holds
        (the watchers before it are cancelled: `_sync_once`)."""
        fleet_read = asyncio.Event()

        async def on_worker(key: str, value: bytes, initial: bool, revision: int) -> None:
            newer = await self.fleet.apply_worker(value, key, revision)
            if newer is not None:
                # an earlier change stored over the one that stands: that one, written again
                # (a task: the watcher reads on while NATS answers)
                self._group.create_task(self._write_again(key, newer, revision))

        self._watchers.append(
            self._group.create_task(self._watch_bucket(self._fleet_bucket, on_worker, fleet_read))
        )
        await fleet_read.wait()

    async def _watch_records(self, *, newer_than: float | None) -> None:
        """Start the evictions' and logouts' watchers; returns once they have applied what the
        buckets hold (of the eviction records there, only those after `newer_than`; None: all
        not seen)."""
        evictions_read = asyncio.Event()
        logouts_read = asyncio.Event()

        async def on_eviction(key: str, value: bytes, initial: bool, revision: int) -> None:
            self.fleet.apply_eviction(key, value, newer_than=newer_than if initial else None)

        async def on_logout(key: str, value: bytes, initial: bool, revision: int) -> None:
            self.fleet.apply_logout(key, value)

        self._watchers += [
            self._group.create_task(
                self._watch_bucket(self._evictions_bucket, on_eviction, evictions_read)
            ),
            self._group.create_task(
                self._watch_bucket(self._sessions_bucket, on_logout, logouts_read)
            ),
        ]
        for read in (evictions_read, logouts_read):
            await read.wait()

    async def _watch_bucket(
        self,
        bucket: str,
        apply: Callable[[str, bytes, bool, int], Awaitable[None]],
        read: asyncio.Event,
    ) -> None:
        watcher = await self._kv[bucket].watchall()
        try:
            async for entry in watcher:
                if entry is None:  # the end of what the bucket held when the watch began
                    read.set()
                    continue
                if entry.value is None or entry.operation is not None:
                    continue  # a delete or purge marker: records are never deleted by us
                try:
                    await apply(entry.key, entry.value, not read.is_set(), entry.revision or 0)
                except Exception:
                    said = self.fleet.describe(entry.key, entry.value)  # never a session id
                    log.exception("cluster: applying %s (%s) failed", said, bucket)
        finally:
            with contextlib.suppress(*_NATS_ERRORS):
                await watcher.stop()  # type: ignore[no-untyped-call]

    async def _write(self, bucket: str, key: str, value: bytes) -> Sharing:
        """Write one record now, or keep it for when NATS answers again."""
        kv = self._kv.get(bucket)
        if kv is None or not self.connected or self.status is not ClusterStatus.OK:
            self.fleet.keep_unsent(bucket, key, value)
            return Sharing.PENDING
        worker = bucket == self._fleet_bucket
        if worker:
            self.fleet.sending(key, value)
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                revision = await kv.put(key, value)
        except _NATS_ERRORS as exc:
            said = self.fleet.describe(key, value)  # never a session id
            # a deadline's TimeoutError says nothing of itself (before: "not written yet ()")
            why = str(exc) or (
                f"NATS did not answer within {WRITE_TIMEOUT_S:g} s"
                if isinstance(exc, TimeoutError)
                else type(exc).__name__
            )
            log.warning("cluster: %s not written yet (%s): kept for the resync", said, why)
            self.fleet.keep_unsent(bucket, key, value, sent=True)
            return Sharing.PENDING
        # a change kept for the same record is older than this one, written: it goes
        self.fleet.written(bucket, key)
        if worker:
            self.fleet.wrote(key, value, revision)
        return Sharing.SHARED

    async def _write_again(self, key: str, value: bytes, revision: int) -> None:
        """Write `value`, the change of the worker record `key` that stands (this replica's,
        or another's it writes back: `FleetState.weigh`), again over the change NATS holds at
        `revision` (made before it, without seeing it), over that revision only: a change
        made since is read by the watcher, and weighed again there (another replica writing
        the same back first makes this one's refused, quietly)."""
        kv = self._kv.get(self._fleet_bucket)
        if kv is None:
            return
        said = self.fleet.describe(key, value)
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                written = await kv.update(key, value, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return  # another write came first: the watcher weighs it
        except _NATS_ERRORS as exc:
            log.warning("cluster: %s not written again (%s): kept for the resync", said, exc)
            self.fleet.keep_unsent(self._fleet_bucket, key, value, sent=True)
            return
        self.fleet.written(self._fleet_bucket, key)
        self.fleet.wrote(key, value, written)
        log.info(
            "cluster: %s written again: an earlier change of that worker, made without seeing "
            "it, reached NATS after it (NATS or a replica's link had hung)",
            said,
        )

    async def worker_changed(
        self, worker_id: str, config: WorkerConfig | None, *, removed: bool = False,
        draining: bool = False,
    ) -> Sharing:  # fmt: skip
        """An operator added, drained or removed a worker here: tell every replica."""
        value = self.fleet.record_worker(
            worker_id, config, at=self.fleet.clock(), removed=removed, draining=draining
        )
        return await self._write(self._fleet_bucket, worker_key(worker_id), value)

    async def namespaces_evicted(self, namespaces: Sequence[Namespace]) -> Sharing:
        """An operator evicted namespaces here: every replica evicts them too."""
        sharing = Sharing.SHARED
        for ns in namespaces:
            key, value = self.fleet.record_eviction(ns)
            self.fleet.mark_evictions_seen([key])
            if await self._write(self._evictions_bucket, key, value) is Sharing.PENDING:
                sharing = Sharing.PENDING
        return sharing

    async def salt_evicted(self, cache_salt: str) -> Sharing:
        """An operator evicted a salt's namespaces here ("": the unsalted ones): every replica
        evicts the ones its own index holds, whatever this one's held."""
        key, value = self.fleet.record_eviction(cache_salt=cache_salt)
        self.fleet.mark_evictions_seen([key])
        return await self._write(self._evictions_bucket, key, value)

    async def session_ended(self, sid: str, expiry: int) -> Sharing:
        """A dashboard session was logged out here (and ended here already): every replica,
        one started later too, refuses its cookie until `expiry`."""
        key, value = self.fleet.record_logout(sid, expiry)
        return await self._write(self._sessions_bucket, key, value)

    # ------------------------------------------------------------------ decisions

    async def _on_message(self, msg: Msg) -> None:
        try:
            batch = batch_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.bad_messages += 1
            return
        self.peers.apply(batch)

    async def _publisher(self) -> None:
        """Send the outbox as batches: at once after a quiet spell, else no sooner than
        `publish_interval_s` after the last one, with everything decided meanwhile; a first
        byte or an end alone waits up to `outbox.LAZY_S` for a routing decision to go with."""
        loop = asyncio.get_running_loop()
        last = -math.inf
        while True:
            await self.outbox.wakeup.wait()
            wait = last + self.config.publish_interval_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            last = loop.time()
            decisions = self.outbox.take()
            nc = self._nc
            if not decisions or nc is None or not nc.is_connected:
                continue
            try:
                await self._publish(nc, decisions)
                # before, every message counted: 12 requests read 66 published (their pending
                # marks, first bytes and ends, and the heartbeats), and an idle replica's rose
                self.published += sum(type(d) is Begin for d in decisions)
            except _NATS_ERRORS:
                self.outbox.dropped += len(decisions)

    async def _publish(self, nc: NATS, decisions: list[Decision]) -> None:
        data = encoder.encode(Batch(self.replica, time.time(), decisions, self._instance))
        if len(data) > nc.max_payload and len(decisions) > 1:
            half = len(decisions) // 2  # in order: the first half is sent first
            await self._publish(nc, decisions[:half])
            await self._publish(nc, decisions[half:])
            return
        await nc.publish(self.subject, data)

    async def _heartbeats(self) -> None:
        """Heartbeats, the sweep of silent peers, and the leader's snapshots."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            self.outbox.heartbeat()
            self.peers.sweep()
            if self.follower is not None:
                self.follower.check_silent()
            if self._snapshot_due():
                try:
                    await self.publish_snapshot()
                except _NATS_ERRORS as exc:
                    log.warning("cluster: snapshot not published (%s)", exc)

    def _snapshot_due(self) -> bool:
        interval = self.config.snapshot_interval_s
        if not interval or self.status is not ClusterStatus.OK:
            return False
        if time.monotonic() - self._last_snapshot < interval:
            return False
        # one writer: the replica first by name among the live ones (no election protocol)
        return self.replica == min([self.replica, *self.peers.live()])

    async def publish_snapshot(self) -> int:
        """Publish this replica's index as the latest snapshot now; returns its size."""
        if self._js is None or not self.connected:
            raise ClusterError("NATS is not connected")
        self._last_snapshot = time.monotonic()
        at = time.time()
        data = self._indexer.dump()
        async with asyncio.timeout(30.0):
            await publish_snapshot(self._js, self._index_bucket, data, at)
        return len(data)
