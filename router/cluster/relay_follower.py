"""A replica's side of the relay: the relay's records, applied to this replica's fed streams.

With `[cluster] events = "relay"` a replica opens no socket to any worker: its indexer's streams
are `indexer.fed_stream.FedStream`s, and this follower reads the relay's JetStream stream
(`router.cluster.relay_publisher`) with an ordered consumer (the client re-creates it where it
left off after a reconnect) and hands each record to its stream. Where it starts:
- after a warm start, shortly before the snapshot was taken (`SNAPSHOT_MARGIN_S`): each
  stream skips what the snapshot holds until the relay shows the batch the snapshot ended on,
  which proves it (`FedStream`);
- on a cold start, at the start of what the stream keeps (`relay_max_age_s`): each stream joins
  at its oldest record kept, as a subscriber joining mid-stream would.
`caught_up` is set once the consumer has delivered everything the stream held when it began.
Until then, and while a stream followed later is read back (`_catch_up`), the streams read are
the workers' past: each predicts nothing (`FedStream.catching_up`) until its records reach the
ones written now.

Whether the relay is alive is heard apart, on `<prefix>.relay.presence` (core NATS: NATS says
nothing to a subscriber when a publisher dies). A relay process not heard for `PRESENCE_MISSES`
of the intervals it announces (0.75 s by default) is taken for gone, and so is every relay
once this replica's connection to NATS drops (`disconnected`): the streams it wrote predict
nothing at once (`FedStream.relay_lost`), until a record of a relay heard alive comes.

Records of a stream this replica does not follow are dropped (counted, and said once per
stream); records of a rank its worker was not known to have make the router read the worker's
settings again (a worker restarted with more ranks), as a stream restart does with direct
subscriptions; so do a restart of the worker the relay counted, and pages that do not fit the
stream's block size (a worker restarted with another page size), which each `FedStream` tells.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from indexer.fed_stream import FedStream
from indexer.log_throttle import LogThrottle
from indexer.relay_record import (
    PRESENCE_MISSES,
    RelayRecord,
    presence_decoder,
    presence_subject,
    relay_decoder,
    relay_subject,
)
from indexer.service import IndexerService
from indexer.subscriptions import stream_worker
from router.cluster.relay_publisher import ensure_relay_stream, relay_stream_name
from router.config import ClusterConfig

__all__ = ["SNAPSHOT_MARGIN_S", "RelayFollower"]

log = logging.getLogger(__name__)

# a warm start reads the relay's records from this long before its snapshot was taken: the
# batch the snapshot ended on is among them unless the stream was idle longer (a heartbeat then
# shows it)
SNAPSHOT_MARGIN_S = 5.0
# how often a stream this replica does not follow may re-read its worker's settings
_REREAD_EVERY_S = 10.0
# a followed stream with no record this long after the follower started is said once
_SILENT_WARN_S = 15.0
# reading a stream back ends when the relay's stream sends nothing of it for this long
_READ_BACK_IDLE_S = 2.0


class RelayFollower:
    """Applies the relay's records to an indexer's fed streams (module docstring)."""

    def __init__(
        self,
        config: ClusterConfig,
        indexer: IndexerService,
        *,
        clock: Callable[[], float],
    ) -> None:
        if indexer.fed is None:
            raise ValueError("the relay follower needs an IndexerService(fed=True)")
        self.config = config
        self.indexer = indexer
        self._streams = indexer.fed.by_stream
        self._clock = clock
        self.caught_up = asyncio.Event()
        self.applied = 0
        self.unknown = 0  # records of streams this replica does not follow
        self.malformed = 0
        self._unknown_said: set[str] = set()
        self._reread_at: dict[str, float] = {}
        self._sub: object | None = None
        self.last_written: float | None = None  # the newest record's time (server clock)
        self.heard: set[str] = set()  # streams that got a record
        self._silent_said: set[str] = set()
        self._live = False  # read to the stream's end once (see `_on_message`)
        # (server time, this host's monotonic time) of the last record delivered live
        self._anchor: tuple[float, float] | None = None
        self._js: JetStreamContext | None = None
        # streams being read back (`_catch_up`): the records the main subscription brings
        # meanwhile, with their freshness, applied after what was read back
        self._catching: dict[str, list[tuple[RelayRecord, float | None]]] = {}
        self._catch_tasks: set[asyncio.Task[None]] = set()
        # the relays heard alive (shared with the fed streams), and when each runs out
        self._relays = indexer.fed.relays
        self._presence_sub: Subscription | None = None
        self._expiry: dict[int, asyncio.TimerHandle] = {}
        self._lost_said = LogThrottle(indexer.config.log_interval_s, clock=clock)
        indexer.fed.on_added = self._added
        indexer.fed.on_rebound = self._rebound

    async def resubscribe(self, nc: NATS) -> None:
        """After NATS came back: subscribe again from the newest record read (the stream is
        made again if the server lost it; records seen already are skipped, and records lost
        show as numbers skipped)."""
        await self._unsubscribe()
        last = self.last_written
        # `start` reads from SNAPSHOT_MARGIN_S before `since`: from a second before the last
        since = None if last is None else last + SNAPSHOT_MARGIN_S - 1.0
        await self.start(nc, since=since, why="again after a reconnect, from its last record")

    def disconnected(self) -> None:
        """This replica's connection to NATS dropped: nothing any relay writes reaches it now,
        so every stream predicts nothing at once (as a subscriber whose socket dropped), until
        a record of a relay heard alive comes after the reconnect. Before, the streams were
        trusted until their relay's silence ran past `heartbeat_timeout_s` (3 s)."""
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()
        self._relays.forget()
        for fed in self._streams.values():
            fed.relay_lost()

    async def _on_presence(self, msg: Msg) -> None:
        try:
            said = presence_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.malformed += 1
            return
        bound = PRESENCE_MISSES * said.every_s
        now = self._clock()
        self._relays.heard(said.epoch, said.n, now=now, until=now + bound)
        timer = self._expiry.pop(said.epoch, None)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._expiry[said.epoch] = loop.call_later(bound, self._relay_silent, said.epoch, bound)

    def _relay_silent(self, epoch: int, bound: float) -> None:
        """The relay process `epoch` has not said it is alive for `bound` seconds: gone (its
        process died, or it lost NATS)."""
        self._expiry.pop(epoch, None)
        self._relays.forget(epoch)
        lost = [fed.stream_id for fed in self._streams.values() if fed.relay_lost(epoch)]
        if not lost:
            return
        held_back = self._lost_said.allow("relay")
        if held_back is not None:
            log.warning(
                "cluster: the relay (epoch %x) has not said it is alive for %.2g s (its process "
                "stopped, or it lost NATS): %d stream(s) it wrote (%s) predict nothing until "
                "its records come again%s",
                epoch,
                bound,
                len(lost),
                ", ".join(lost[:5]) + (", ..." if len(lost) > 5 else ""),
                f" ({held_back} similar suppressed)" if held_back else "",
            )

    def check_silent(self) -> None:
        """Say once of each followed stream that got no record at all for a while: its
        worker is one the relay does not write (not in its config?)."""
        now = self._clock()
        for stream, fed in self._streams.items():
            if now - fed.added_at < _SILENT_WARN_S:
                continue
            if stream not in self.heard and stream not in self._silent_said:
                self._silent_said.add(stream)
                log.warning(
                    "cluster: no record of stream %s from the relay in %.0f s: is a kvroute "
                    "relay running with this worker in its config? Nothing of it is predicted",
                    stream,
                    _SILENT_WARN_S,
                )

    async def start(self, nc: NATS, *, since: float | None, why: str = "from the snapshot") -> None:
        """Subscribe: from shortly before `since` (a snapshot's wall time), or from the start
        of what the stream keeps; and to the relay's presence."""
        js = nc.jetstream(timeout=5.0)
        # first: a record is trusted only while its relay is heard alive
        self._presence_sub = await nc.subscribe(
            presence_subject(self.config.subject_prefix), cb=self._on_presence
        )
        await ensure_relay_stream(js, self.config)
        stream = relay_stream_name(self.config)
        if since is None:
            consumer = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        else:
            start = datetime.datetime.fromtimestamp(since - SNAPSHOT_MARGIN_S, datetime.UTC)
            consumer = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start
            )
        self._live = False
        self._anchor = None  # a resubscription may be to another server
        self._js = js
        info = await js.stream_info(stream)
        if info.state.messages == 0:
            self._go_live()  # nothing to read back: what comes is written now
        else:
            for fed in self._streams.values():
                fed.catching_up(True)  # what it missed comes first (`_go_live` ends it)
        self._sub = await js.subscribe(
            f"{self.config.subject_prefix}.events.>",
            stream=stream,
            cb=self._on_message,
            ordered_consumer=True,
            config=consumer,
            idle_heartbeat=max(0.5, self.config.heartbeat_timeout_s),
        )
        log.info(
            "cluster: following the relay's stream %s (%s)",
            stream,
            "cold: what it keeps" if since is None else why,
        )

    def gauges(self) -> dict[str, float]:
        """What `/metrics` exports of it (`kvroute_cluster_relay_records_*`)."""
        return {
            "relay_records_applied": float(self.applied),
            "relay_records_skipped": float(self.unknown),
            "relay_records_malformed": float(self.malformed),
        }

    def _go_live(self) -> None:
        """The relay's stream is read to its end: what comes next is written now, and every
        stream not being read back on its own is caught up."""
        self._live = True
        self.caught_up.set()
        for sid, fed in self._streams.items():
            if sid not in self._catching:
                fed.catching_up(False)

    def _added(self, fed: FedStream) -> None:
        """A stream followed after the follower read the relay's stream to its end (a worker
        added, a rank discovered): read back what the relay's stream keeps of it, so it starts
        where the relay's records it missed would have left it (joined at the oldest kept).
        It predicts nothing until that read-back and the records the main subscription brought
        meanwhile are applied (before, each record read back set the relay's state as written,
        `synced`: a page the worker stored early and evicted later was predicted)."""
        if fed.stream_id in self._catching:
            return
        if self._js is None or not self._live:
            # at start the main subscription reads the past itself: caught up with it
            fed.catching_up(self._js is not None)
            return
        fed.catching_up(True)
        self._catching[fed.stream_id] = []
        task = asyncio.create_task(self._catch_up(fed), name=f"kvroute-relay {fed.stream_id}")
        self._catch_tasks.add(task)
        task.add_done_callback(self._catch_tasks.discard)

    def _rebound(self, fed: FedStream) -> None:
        """A snapshot was loaded into the running index (`POST /admin/index/load`): read back
        what the relay's stream keeps of `fed`, the records the main subscription brings held
        until then, so a stream held unproven finds the batch the snapshot ended on and applies
        what follows, and one the snapshot did not know is rebuilt as one followed anew.
        Before, only a warm start read from the snapshot's time: the next live heartbeat, past
        the snapshot, dropped every stream behind it (pages the worker still held predicted
        nothing until stored again; QA). At a start, the main subscription reads from the
        snapshot's time itself (`start`)."""
        if self._js is not None and self._live:
            self._added(fed)

    async def _catch_up(self, fed: FedStream) -> None:
        sid = fed.stream_id
        read = 0
        try:
            read = await self._read_back(fed)
        except Exception as exc:
            log.info("cluster: stream %s not read back from the relay's stream (%s)", sid, exc)
        finally:
            brought = self._catching.pop(sid, [])
            if self._streams.get(sid) is fed:
                for record, age in brought:
                    fed.take(record, age_s=age)
                fed.catching_up(not self._live)  # the present, unless the follower is behind
        if read:
            log.info("cluster: stream %s read back from the relay's stream (%d records)", sid, read)

    async def _read_back(self, fed: FedStream) -> int:
        """Feed `fed` the relay's records of it that the stream keeps, with their ages as the
        main subscription tells them (a stream the relay made anew after the worker was last
        seen down here needs no proof of a restart: `FedStream.suspect_restart`)."""
        js = self._js
        assert js is not None
        subject = relay_subject(self.config.subject_prefix, fed.stream_id)
        sub = await js.subscribe(
            subject,
            stream=relay_stream_name(self.config),
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE),
        )
        read = 0
        try:
            while self._streams.get(fed.stream_id) is fed:
                try:
                    msg = await sub.next_msg(timeout=_READ_BACK_IDLE_S)
                except nats.errors.TimeoutError:
                    break  # nothing kept of it (or nothing more)
                server_now = self._server_now(self._clock())
                written = msg.metadata.timestamp.timestamp()
                age = None if server_now is None else server_now - written
                try:
                    fed.take(relay_decoder.decode(msg.data), age_s=age)
                    read += 1
                except msgspec.DecodeError:
                    self.malformed += 1
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return read

    async def stop(self) -> None:
        """Unsubscribe (the connection's owner closes the connection)."""
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        tasks = list(self._catch_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sub in (self._sub, self._presence_sub):
            unsubscribe = getattr(sub, "unsubscribe", None)
            if unsubscribe is not None:
                try:
                    await unsubscribe()
                except Exception as exc:
                    log.debug("relay follower: unsubscribe failed (%s)", exc)
        self._sub = self._presence_sub = None

    async def _on_message(self, msg: Msg) -> None:
        try:
            meta = msg.metadata
        except Exception:
            self.malformed += 1
            return
        # a record's age, by the server's clock alone: how far its time is behind the
        # server's now, known from the last record delivered with nothing behind it (once the
        # stream was read to its end) plus the time since on this host's monotonic clock. No
        # two hosts' clocks are compared (they may differ). Until such a record, the ages are
        # unknown: records read back from the stream's past (a start, a resubscription) say
        # nothing of now, so a dead relay's last heartbeat never looks alive
        written = meta.timestamp.timestamp()
        now = self._clock()
        # the server's now, as known before this record (None: not known yet)
        server_now = self._server_now(now)
        live = meta.num_pending == 0
        if live and self._live:
            # never backwards: a record that waited in this host's buffers (the loop paused,
            # or behind) was last when the server sent it, not now
            self._anchor = (written if server_now is None else max(written, server_now), now)
            server_now = self._anchor[0]
        age = None if server_now is None else server_now - written
        self.last_written = written  # where to resume (`resubscribe`)
        try:
            self._take(relay_decoder.decode(msg.data), age)
        except msgspec.DecodeError:
            self.malformed += 1
        if live and not self._live:
            self._go_live()  # once the last record read back is applied

    def _take(self, record: RelayRecord, age: float | None) -> None:
        """Hand one record of the main subscription to its stream (`age`: see `take`)."""
        stream = self._streams.get(record.stream)
        if stream is None:
            self._not_followed(record.stream)
            return
        waiting = self._catching.get(record.stream)
        if waiting is not None:
            waiting.append((record, age))
            return
        stream.take(record, age_s=age)
        self.heard.add(record.stream)
        self.applied += 1

    def _server_now(self, now: float) -> float | None:
        """The server's now as known from the last record delivered live (`_on_message`);
        None until one was."""
        anchor = self._anchor
        return None if anchor is None else anchor[0] + (now - anchor[1])

    def _not_followed(self, stream: str) -> None:
        self.unknown += 1
        worker = stream_worker(stream)
        now = self._clock()
        # a rank this replica does not know its worker to have: read its settings again
        if (
            worker is not None
            and self.indexer.has_worker(worker)
            and now - self._reread_at.get(worker, -_REREAD_EVERY_S) >= _REREAD_EVERY_S
        ):
            self._reread_at[worker] = now
            for listener in self.indexer.restart_listeners:
                listener(worker)
        if stream not in self._unknown_said:
            self._unknown_said.add(stream)
            log.info(
                "cluster: the relay writes stream %s, which this replica does not follow "
                "(a worker not in its fleet, or a rank not discovered yet): its records are "
                "skipped",
                stream,
            )
