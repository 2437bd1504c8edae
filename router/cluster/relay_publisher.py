"""`kvroute relay`'s side: what its subscribers made its index do, written to JetStream.

The relay is a router process without the proxy (`kvroute relay --config FILE`): the same
discovery, health checks, subscribers and index as `kvroute serve`, whose index is tapped
(`indexer.stream_tap`). Every batch applied, clear, forgotten seq and state change of each
stream becomes a numbered `RelayRecord` on `<prefix>.events.<stream>`, kept by the JetStream
stream `<prefix>_events` (created here, or by the first replica that follows it), and every
`heartbeat_interval_s` each stream gets an unnumbered heartbeat. Each record names the
KV-event endpoint the stream is read from (`follows`), which the stream's id does not. Four
times a heartbeat interval (`presence_interval`) the relay says it is alive on
`<prefix>.relay.presence`, in the order of its records: NATS tells no subscriber that a
publisher died, so its followers take it for gone once that word stops (`PRESENCE_MISSES`
intervals, 0.75 s by default) and trust its streams again at its next record. Replicas with
`[cluster] events = "relay"` apply them (`router.cluster.relay_follower`): one subscription per
worker for the whole fleet instead of one per worker and replica.

Records are queued here without waiting (the tap is called on the index's path) and written by
one task with the client's core publish: the stream keeps what reaches the server. What does
not (NATS away longer than the client buffers, or more than `QUEUE_LIMIT` records waiting) is
dropped and counted; the followers see the numbers skipped and start those streams afresh, so a
loss costs hits, never a false one.

NATS that does not answer within `startup_timeout_s` of the start is said in one WARNING line
(`relay degraded: ...`, naming the URL and the last error), and its answering after that in one
more (`relay resynced: ...`), as a replica says them; `/health` says "degraded" meanwhile. The
client retries a refused connection by itself, forever: before, nothing was said above DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from indexer.relay_record import (
    RelayKind,
    RelayPresence,
    RelayRecord,
    presence_subject,
    relay_encoder,
    relay_subject,
)
from indexer.service import IndexerService
from indexer.stats import StreamState
from router.cluster.nats_client import (
    Replacements,
    TlsGuardedClient,
    TlsNotOffered,
    attempt_error,
    close_client,
    stop_retrying,
)
from router.cluster.tasks import stop_tasks
from router.config import ClusterConfig

__all__ = [
    "QUEUE_LIMIT",
    "RelayPublisher",
    "ensure_relay_stream",
    "presence_interval",
    "relay_stream_name",
]

log = logging.getLogger(__name__)

# records waiting for NATS before the oldest are dropped (the followers start those streams
# afresh); at ~200 bytes a record, about 40 MB
QUEUE_LIMIT = 200_000
_NATS_ERRORS = (nats.errors.Error, TimeoutError, OSError)
# how many times a heartbeat interval the relay says it is alive, and no more often than this
_PRESENCE_PER_HEARTBEAT = 4
_PRESENCE_MIN_S = 0.02


def presence_interval(config: ClusterConfig) -> float:
    """How often the relay says it is alive: a quarter of `heartbeat_interval_s` (0.25 s by
    default: its followers take it for gone after `PRESENCE_MISSES` of these, 0.75 s)."""
    return max(_PRESENCE_MIN_S, config.heartbeat_interval_s / _PRESENCE_PER_HEARTBEAT)


# how long a stop waits for the relay's tasks (`router.cluster.tasks`) before leaving them
STOP_TIMEOUT_S = 5.0


def relay_stream_name(config: ClusterConfig) -> str:
    """The JetStream stream of the relay's records."""
    return f"{config.subject_prefix}_events"


async def ensure_relay_stream(js: object, config: ClusterConfig) -> None:
    """Create the relay's stream, or bring its limits to the config's (the relay and every
    follower call this: whichever comes first makes it)."""
    from nats.js import JetStreamContext

    assert isinstance(js, JetStreamContext)
    wanted = StreamConfig(
        name=relay_stream_name(config),
        subjects=[f"{config.subject_prefix}.events.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=config.relay_max_age_s,
        max_bytes=config.relay_max_bytes,
    )
    try:
        await js.add_stream(wanted)
    except nats.js.errors.BadRequestError:
        # there already, with other limits (another config's): this config's win
        await js.update_stream(wanted)


class RelayPublisher:
    """The tap of a relay's index, and the task that writes what it is told (module docstring).

    An async context manager: entering connects to NATS in the background (the subscribers and
    the index run whether NATS answers or not), leaving stops its tasks and the connection."""

    def __init__(self, config: ClusterConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.indexer: IndexerService | None = None  # whose streams' heartbeats to send
        self.epoch = secrets.randbits(63)
        self.presence_s = presence_interval(config)  # every record says it
        self._presences = 0  # said so far: every record says how many
        self._presence_subject = presence_subject(config.subject_prefix)
        self._rseq: dict[str, int] = {}
        # the KV-event endpoint each stream is read from (`follows`): every record says it
        self._sources: dict[str, str] = {}
        self._queue: deque[tuple[str, bytes]] = deque()
        self._wake = asyncio.Event()
        self._nc: NATS | None = None
        self._connecting: NATS | None = None  # the newest client, connected or not yet
        self._tasks: list[asyncio.Task[None]] = []
        self.published = 0  # handed to the NATS client (the server may still lose them)
        self.dropped = 0  # never handed to it
        self.lost_streams = 0  # times the server's stream was found gone and made again
        self.connected_once = False
        self._late = False  # NATS not written to at the start, said: its answer is said too
        self._last_error = ""  # the client's last failed attempt, for that line
        self._said: set[str] = set()
        # the pause before replacing a NATS client closed for good, and the reasons said
        self._replacements = Replacements()
        self._closing = False
        self._reconnected = False

    # ------------------------------------------------------------ the tap

    def batch(self, stream: str, seq: int, payload: bytes, *, replayed: bool) -> None:
        """A batch applied."""
        self._numbered(RelayKind.BATCH, stream, seq=seq, payload=payload, replayed=replayed)

    def cleared(self, stream: str) -> None:
        """The stream's entries dropped."""
        self._numbered(RelayKind.CLEAR, stream)

    def seq_forgotten(self, stream: str) -> None:
        """The stream will be rebuilt from 0."""
        self._numbered(RelayKind.FORGET_SEQ, stream)

    def state(self, stream: str, state: StreamState) -> None:
        """The stream entered `state`."""
        self._numbered(RelayKind.STATE, stream, state=state)

    def follows(self, stream: str, source: str) -> None:
        """The stream is read from the endpoint `source` from now on (its worker registered):
        its records say so, and a follower whose worker of that id publishes elsewhere takes
        none of them (`indexer.fed_stream`)."""
        self._sources[stream] = source

    def new_epoch(self) -> None:
        """The index was replaced: numbering starts again under a new epoch."""
        self.epoch = secrets.randbits(63)
        self._rseq.clear()

    def _numbered(
        self,
        kind: RelayKind,
        stream: str,
        *,
        state: StreamState | None = None,
        seq: int | None = None,
        payload: bytes = b"",
        replayed: bool = False,
    ) -> None:
        rseq = self._rseq.get(stream, -1) + 1
        self._rseq[stream] = rseq
        if state is None:
            state = self._state_of(stream)
        record = RelayRecord(
            kind,
            stream,
            self.epoch,
            rseq,
            state,
            seq=seq,
            payload=payload,
            replayed=replayed,
            presence_s=self.presence_s,
            presence_n=self._presences,
            source=self._sources.get(stream, ""),
        )
        self._put(stream, record)

    def _state_of(self, stream: str) -> StreamState:
        health = None if self.indexer is None else self.indexer.health_of(stream)
        return StreamState.SYNCING if health is None else health.state

    def _put(self, stream: str, record: RelayRecord) -> None:
        if len(self._queue) >= QUEUE_LIMIT:
            self._queue.popleft()  # its stream's followers see the number skipped
            self.dropped += 1
            self._say_once(
                "overflow",
                f"relay: more than {QUEUE_LIMIT} records wait for NATS; the oldest are dropped "
                "(the replicas rebuild the streams that lost some)",
            )
        subject = relay_subject(self.config.subject_prefix, stream)
        self._queue.append((subject, relay_encoder.encode(record)))
        self._wake.set()

    def heartbeat(self) -> None:
        """One heartbeat for every stream of the index."""
        indexer = self.indexer
        if indexer is None:
            return
        for head in indexer.stream_heads():
            record = RelayRecord(
                RelayKind.HEARTBEAT,
                head.stream,
                self.epoch,
                self._rseq.get(head.stream, -1),
                head.state,
                seq=head.seq,
                digest=head.digest,
                heard_age_s=head.heard_age_s,
                checks=head.checks,
                restarts=head.restarts,
                presence_s=self.presence_s,
                presence_n=self._presences,
                source=self._sources.get(head.stream, ""),
            )
            self._put(head.stream, record)

    def presence(self) -> None:
        """Say the relay is alive, behind the records queued before: a follower trusts a
        stream again only at a record written after a presence it heard (`presence_n`), which
        comes after every record of the stream written before. Not while NATS is away: a
        queue of them would say nothing of now once written."""
        if not self.connected:
            return
        said = RelayPresence(self.epoch, self.presence_s, self._presences)
        self._presences += 1
        self._queue.append((self._presence_subject, relay_encoder.encode(said)))
        self._wake.set()

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> RelayPublisher:
        self._tasks = [
            asyncio.create_task(self._connect(), name="kvroute-relay-connect"),
            asyncio.create_task(self._heartbeats(), name="kvroute-relay-heartbeats"),
            asyncio.create_task(self._presence(), name="kvroute-relay-presence"),
            asyncio.create_task(self._startup_deadline(), name="kvroute-relay-deadline"),
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop the tasks (bounded: a cancellation lost while NATS was down made `kvroute
        relay` ignore SIGTERM for good, `router.cluster.tasks`) and close the connection."""
        self._closing = True
        for client in (self._connecting, self._nc):
            if client is not None:
                stop_retrying(client)
        left = await stop_tasks(self._tasks, STOP_TIMEOUT_S)
        if left:
            log.warning(
                "relay: %d task(s) still running %g s after being told to stop, left behind "
                "(%s); stopping anyway",
                len(left),
                STOP_TIMEOUT_S,
                ", ".join(task.get_name() for task in left),
            )
        # the errors of those that ended are theirs (a connect given up on): not logged
        await asyncio.gather(*(t for t in self._tasks if t.done()), return_exceptions=True)
        nc, self._nc = self._nc, None
        if nc is not None:
            # flushes what the client still buffers, if NATS answers
            await close_client(nc, 2.0)
        if self._connecting is not None and self._connecting is not nc:
            await close_client(self._connecting, 2.0)  # one stopped mid-attempt: its socket

    @property
    def connected(self) -> bool:
        """Whether NATS answers now."""
        return self._nc is not None and self._nc.is_connected

    def describe(self) -> dict[str, object]:
        """What `/health` says of the relay."""
        return {
            "status": "ok" if self.connected else "degraded",
            "stream": relay_stream_name(self.config),
            "epoch": f"{self.epoch:x}",
            "published": self.published,
            "dropped": self.dropped,
            "waiting": len(self._queue),
        }

    def gauges(self) -> dict[str, float]:
        """What `/metrics` exports of it (`kvroute_cluster_degraded`, `..._relay_records_*`)."""
        return {
            "degraded": float(not self.connected),
            "relay_records_published": float(self.published),
            "relay_records_dropped": float(self.dropped),
            "relay_records_waiting": float(len(self._queue)),
        }

    async def _connect(self) -> None:
        """Connect (retrying until NATS answers) and write; a client closed for good is
        replaced. nats-py closes its client for good, and reconnects no more, on a server's
        `-ERR` other than a stale connection or a permissions violation (a line past the
        server's control line limit, credentials revoked while connected): before, the relay
        then wrote nothing until restarted, and its followers predicted nothing. Now a new
        client connects after a pause (`Replacements`: doubling while each one closes before it
        wrote anything), said once per reason; the records waiting are kept."""
        while True:
            closed = asyncio.Event()
            nc = await self._open(closed)
            self._nc = nc
            self.connected_once = True
            self._said.discard("down")
            writing = (
                f"writing the workers' KV events to JetStream stream "
                f"{relay_stream_name(self.config)} (epoch {self.epoch:x})"
            )
            if self._late:
                log.warning("relay resynced: NATS at %s answers; %s", self._servers, writing)
            else:
                log.info("relay: %s", writing)
            published = self.published
            await self._drain(nc, closed)
            if self.published != published:
                self._replacements.worked()  # it wrote meanwhile: a new incident
            self._replacements.say_closed(nc, log, "relay", "records wait (bounded)")
            self._late = True  # its answering is said again
            await self._replacements.pause()

    async def _open(self, closed: asyncio.Event) -> NATS:
        """A client connected to NATS with the relay's stream made (retrying until both);
        `closed` is set when the client is closed for good."""
        nc = self._connecting = TlsGuardedClient()

        async def on_error(exc: Exception) -> None:
            # every failed attempt lands here (the client retries a refused connect itself,
            # forever): kept for the one line the startup deadline says
            self._last_error = attempt_error(exc, self.config.servers)
            log.debug("relay nats: %s", self._last_error)
            if isinstance(exc, TlsNotOffered):
                # no waiting mends it: said at once, as a replica says it
                self._say_once(
                    "tls",
                    "relay: a tls:// URL asked for TLS, but the NATS server did not offer it: "
                    "not talking to it in plain text, credentials unsent (use nats:// to allow "
                    "plain text); still trying",
                )

        async def on_disconnected() -> None:
            if self.connected_once and not self._closing:
                self._say_once("down", "relay: NATS connection lost; records wait (bounded)")

        async def on_reconnected() -> None:
            self._said.discard("down")
            log.warning("relay: NATS answers again")
            self._reconnected = True  # the stream is checked before anything is written
            self._wake.set()

        async def on_closed() -> None:
            closed.set()
            self._wake.set()  # the writer sees it and returns

        delay = 0.2
        while True:
            try:
                await nc.connect(
                    servers=self.config.servers,
                    name=self.name,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=min(1.0, self.config.heartbeat_interval_s),  # type: ignore[arg-type]
                    connect_timeout=2,
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected,
                    closed_cb=on_closed,
                )
                js = nc.jetstream(timeout=5.0)
                await ensure_relay_stream(js, self.config)
                return nc
            except _NATS_ERRORS as exc:
                if self._closing:
                    raise  # told to try no more (`__aexit__`)
                # an option the client refused at once, or a server that answers but would
                # not make the stream (JetStream off): a refused connection never lands here
                said = attempt_error(exc, self.config.servers)
                self._last_error = said
                self._say_once(
                    "connect",
                    f"relay: NATS at {self._servers} "
                    + (
                        f"answers, but JetStream stream {relay_stream_name(self.config)} "
                        f"was not made ({said})"
                        if nc.is_connected
                        else f"does not answer ({said})"
                    )
                    + "; still trying, records wait (bounded)",
                )
                self._late = True  # said: its end is said too, and the deadline says nothing
                await close_client(nc, 2.0)
                nc = self._connecting = TlsGuardedClient()
                closed.clear()  # the closing of the client given up on is not ours
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    @property
    def _servers(self) -> str:
        return ", ".join(self.config.shown_servers)

    async def _startup_deadline(self) -> None:
        """Say once that NATS has not answered within `startup_timeout_s`, as a replica does
        (`cluster degraded: ...`): the client's own retries say nothing above DEBUG."""
        await asyncio.sleep(self.config.startup_timeout_s)
        if self.connected_once or self._late:
            return  # connected, or the reason it is not was said already
        self._late = True
        last = f" (last attempt: {self._last_error})" if self._last_error else ""
        log.warning(
            "relay degraded: NATS at %s did not answer within %g s%s; nothing is written, the "
            "records wait (bounded) and the replicas following this relay predict nothing "
            "until NATS answers; still trying",
            self._servers,
            self.config.startup_timeout_s,
            last,
        )

    async def _drain(self, nc: NATS, closed: asyncio.Event) -> None:
        """Write the queue through `nc` as NATS takes it; returns once `nc` is closed."""
        queue = self._queue
        while True:
            await self._wake.wait()
            self._wake.clear()
            if closed.is_set():
                return
            if self._reconnected:
                # a server restarted without its store would take the records into nothing
                self._reconnected = False
                await self._check_stream()
            while queue:
                if not nc.is_connected:
                    break  # reconnected_cb wakes us
                subject, data = queue.popleft()
                try:
                    await nc.publish(subject, data)
                    if subject != self._presence_subject:  # records only
                        self.published += 1
                except _NATS_ERRORS as exc:
                    self.dropped += 1
                    self._say_once("publish", f"relay: a record not written ({exc})")

    async def _presence(self) -> None:
        while True:
            await asyncio.sleep(self.presence_s)
            self.presence()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            self.heartbeat()
            await self._check_stream()

    async def _check_stream(self) -> None:
        """Make the stream again if the server lost it (restarted without its store): the
        records written meanwhile are gone, so numbering starts over under a new epoch, and
        the replicas start their streams afresh."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            return
        js = nc.jetstream(timeout=2.0)
        try:
            await js.stream_info(relay_stream_name(self.config))
            return
        except nats.js.errors.NotFoundError:
            pass
        except _NATS_ERRORS:
            return  # NATS busy or away: the next heartbeat asks again
        try:
            await ensure_relay_stream(js, self.config)
        except _NATS_ERRORS as exc:
            self._say_once("recreate", f"relay: its stream is gone and not made again ({exc})")
            return
        self._said.discard("recreate")
        self.lost_streams += 1
        self.new_epoch()
        log.warning(
            "relay: JetStream stream %s was gone (the NATS server lost its store?): made "
            "again; what was written meanwhile is lost, so the replicas start afresh",
            relay_stream_name(self.config),
        )

    def _say_once(self, kind: str, message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            log.warning(message)
