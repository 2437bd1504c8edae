"""Republish a recording on real PUB + replay ROUTER sockets, paced, with injected faults.

Each recorded stream gets its own publisher, exactly like one (worker, dp rank): a PUB sending
`[topic, seq, payload]` with the recorded bytes and seqs, a bounded replay buffer, and a ROUTER
answering replay requests in the newer layout (`[topic, seq, payload]`, end marker with an
empty topic). A live router subscribed to these endpoints cannot tell them from real workers.

Faults (seeded, so a failing run can be repeated):
- `drop`: a message is not sent live but stays in the replay buffer (what a PUB at its
  high-water mark does); the subscriber sees a gap and should repair it by replay;
- `dup`: a message is sent twice;
- `reorder`: a message is held back and sent after the next one of its stream;
- `restart-at=SEQ`: when a stream reaches recorded seq SEQ it behaves like a restarted engine:
  its seqs start again from 0 and its replay buffer is emptied.
A recorded seq decrease (a real restart in the capture) also empties the buffer. A replayed
record at the seq of the message just sent (the recorder keeps an undecodable batch twice: its
live copy and the refetch) is no second message: it takes that seq's place in the buffer. The last
message of each stream is never lost for good: a subscriber only notices a gap when a later
message arrives, so a dropped or held tail is sent once more at the end.

The recorder's marks (`RecordMark`, version 3), when `run` is given them: a clear becomes what
an engine sends when it drops its cache, a batch of one `AllBlocksCleared` (in the layout and
with the dp rank of the stream's recorded batches) at the seq after the last one sent, so a
subscriber drops the stream's entries where the recorder's did; the stream's later seqs are
one higher than recorded from there (until a restart in the recording starts them again). A
forget-seq mark has no message on the wire (no event tells a subscriber to forget its seq: a
restarted engine's seqs going back do, and those are republished as recorded): it is counted,
not sent, and said once per run. A clear before a stream's first message is not sent either:
the subscriber holds nothing of the stream yet.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable, Iterable
from types import TracebackType

import msgspec
import zmq
import zmq.asyncio

from indexer.errors import IndexerError, ProtocolError
from indexer.protocol.decode import batch_layout
from indexer.protocol.encode import WireLayout, encode_batch
from indexer.protocol.events import Cleared, EventBatch
from indexer.protocol.frames import (
    build_live,
    build_replay_end,
    build_replay_reply,
    parse_replay_request,
)
from indexer.recording.format import Record, RecordMark, Source

__all__ = [
    "FaultPlan",
    "PublishedStream",
    "RepublishConfig",
    "Republisher",
    "parse_faults",
]

log = logging.getLogger(__name__)

_Message = tuple[bytes, int, bytes]  # topic, seq, payload


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Which faults to inject, with what probability per message."""

    drop: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    restart_at: int | None = None
    seed: int = 0

    @property
    def any(self) -> bool:
        """True when some fault can happen."""
        return bool(self.drop or self.dup or self.reorder or self.restart_at is not None)


def parse_faults(text: str, *, seed: int = 0) -> FaultPlan:
    """Parse `drop=0.01,dup=0.01,reorder=0.01,restart-at=SEQ`; ValueError names the bad part."""
    values: dict[str, float | int | None] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"fault {part!r}: expected NAME=VALUE")
        if key == "restart_at":
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(f"fault restart-at: {raw!r} is not a seq number") from None
            if values[key] < 0:  # type: ignore[operator]
                raise ValueError("fault restart-at: seq must be >= 0")
            continue
        if key not in ("drop", "dup", "reorder"):
            raise ValueError(f"unknown fault {key!r} (drop, dup, reorder, restart-at)")
        try:
            p = float(raw)
        except ValueError:
            raise ValueError(f"fault {key}: {raw!r} is not a probability") from None
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"fault {key}: probability {p} is outside [0, 1]")
        values[key] = p
    return msgspec.convert({**values, "seed": seed}, FaultPlan)


class RepublishConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how fast to republish.

    `endpoint` is the PUB of the first stream; stream i binds port + i (port 0: each picks a
    free port). `replay_endpoint` likewise for the ROUTERs; by default they follow the PUB ports
    (port + streams + i), or pick free ports when the PUB port is 0.
    """

    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str | None = None
    speed: float | None = 1.0  # None: as fast as possible
    replay_buffer: int = 10_000
    faults: FaultPlan = FaultPlan()
    sndhwm: int = 100_000


class PublishedStream(msgspec.Struct, kw_only=True):
    """One republished stream: where it is bound and what happened to its messages."""

    stream: str
    endpoint: str
    replay_endpoint: str
    topic: str = ""
    sent: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    restarts: int = 0
    replay_requests: int = 0
    replayed: int = 0
    last_seq: int | None = None
    clears: int = 0  # clear marks, each sent as an AllBlocksCleared batch
    forgets: int = 0  # forget-seq marks: nothing on the wire says them


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    head, sep, port = endpoint.rpartition(":")
    if not sep or not head.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r}: expected tcp://HOST:PORT")
    return head, int(port)


class _Publisher:
    """The sockets and replay buffer of one stream."""

    def __init__(self, ctx: zmq.asyncio.Context, info: PublishedStream, buffer: int) -> None:
        self.info = info
        # XPUB sends like a PUB and also tells us when a subscriber's subscription arrived,
        # so a run can wait for its consumer instead of losing the first messages
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first
        self.subscribers = 0
        self.subscribed = asyncio.Event()
        self.router = ctx.socket(zmq.ROUTER)
        self.buffer: deque[_Message] = deque(maxlen=max(1, buffer))
        # subtracted from recorded seqs: after an injected restart, and less one per clear
        # sent (each takes a seq of its own)
        self.offset = 0
        self.restarted = False
        self.prev_recorded: int | None = None
        self.last: _Message | None = None  # the last message put out (sent or not)
        # the layout and dp rank of the stream's recorded batches, once one showed them
        self.layout: tuple[WireLayout, int | None] | None = None
        self.held: _Message | None = None
        self.tail_lost: _Message | None = None

    def wire_shape(self) -> tuple[WireLayout, int | None]:
        """The layout and dp rank of the stream's latest batch that shows them (in the replay
        buffer, else as last found), for a batch made to read like the recorded ones; the
        newest layout of both engines, and no rank, when none did."""
        for _, _, payload in reversed(self.buffer):
            shape = batch_layout(payload)
            if shape is not None:
                self.layout = shape
                break
        return self.layout or ("map", None)

    def bind(self, pub_endpoint: str, replay_endpoint: str, sndhwm: int) -> None:
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        self.info.endpoint = _bind(self.pub, pub_endpoint)
        self.info.replay_endpoint = _bind(self.router, replay_endpoint)

    async def send(self, message: _Message) -> None:
        topic, seq, payload = message
        await self.pub.send_multipart(build_live(topic, seq, payload))
        self.info.sent += 1
        self.info.last_seq = seq

    async def watch_subscriptions(self) -> None:
        """Count subscriptions (b"\\x01topic") and unsubscriptions until cancelled."""
        while True:
            message = await self.pub.recv()
            if message[:1] == b"\x01":
                self.subscribers += 1
                self.subscribed.set()
            elif message[:1] == b"\x00":
                self.subscribers = max(0, self.subscribers - 1)

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled; malformed requests are ignored."""
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) < 2:
                continue
            identity, request = frames[0], frames[1:]
            try:
                start = parse_replay_request(request)
            except ProtocolError:
                continue
            self.info.replay_requests += 1
            for topic, seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart(
                        [identity, *build_replay_reply(topic, seq, payload)]
                    )
                    self.info.replayed += 1
                    if self.info.replayed % 64 == 0:
                        await asyncio.sleep(0)  # a long answer must not stall the live sends
            await self.router.send_multipart([identity, *build_replay_end(with_topic=True)])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    head, port = _split_endpoint(endpoint)
    try:
        if port == 0:
            return f"{head}:{sock.bind_to_random_port(head)}"
        sock.bind(endpoint)
    except zmq.ZMQError as exc:  # e.g. the port is taken: a message for the operator
        raise IndexerError(f"cannot bind {endpoint}: {exc}") from exc
    return endpoint


class Republisher:
    """Async context manager: binds one publisher per stream on enter, `run` sends the records.

    The replay ROUTERs keep answering after `run` returns, until the context exits, so a
    consumer can still repair its last gaps.
    """

    def __init__(self, sources: Iterable[Source], config: RepublishConfig | None = None) -> None:
        self.config = config or RepublishConfig()
        self._sources = list(sources)
        self._ctx = zmq.asyncio.Context()
        self._publishers: dict[str, _Publisher] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random(self.config.faults.seed)
        self._forgets_said = False

    @property
    def streams(self) -> list[PublishedStream]:
        """Per-stream endpoints and counters."""
        return [p.info for p in self._publishers.values()]

    async def __aenter__(self) -> Republisher:
        try:
            self._bind_all()
        except Exception:
            self._close()
            raise
        for p in self._publishers.values():
            self._tasks.append(asyncio.create_task(p.serve_replay()))
            self._tasks.append(asyncio.create_task(p.watch_subscriptions()))
        return self

    async def wait_subscribed(self, timeout_s: float = 10.0, subscribers: int = 1) -> bool:
        """Wait until every stream has `subscribers` subscriptions; False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                for p in self._publishers.values():
                    while p.subscribers < subscribers:
                        p.subscribed.clear()
                        await p.subscribed.wait()
        except TimeoutError:
            return False
        return True

    def _bind_all(self) -> None:
        n = len(self._sources)
        pub_head, pub_port = _split_endpoint(self.config.endpoint)
        if self.config.replay_endpoint is not None:
            rep_head, rep_port = _split_endpoint(self.config.replay_endpoint)
        else:
            rep_head, rep_port = pub_head, (pub_port + n if pub_port else 0)
        for i, source in enumerate(self._sources):
            info = PublishedStream(
                stream=source.stream, endpoint="", replay_endpoint="", topic=source.topic
            )
            publisher = _Publisher(self._ctx, info, self.config.replay_buffer)
            self._publishers[source.stream] = publisher
            publisher.bind(
                f"{pub_head}:{pub_port + i if pub_port else 0}",
                f"{rep_head}:{rep_port + i if rep_port else 0}",
                self.config.sndhwm,
            )

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        for task in self._tasks:
            task.cancel()
        try:
            if self._tasks:
                # not `suppress(CancelledError): await task`, which would also swallow a
                # cancellation of the caller arriving meanwhile
                await asyncio.wait(self._tasks)
        finally:
            self._close()

    def _close(self) -> None:
        for publisher in self._publishers.values():
            publisher.close()
        self._ctx.term()

    async def run(
        self, records: Iterable[Record], *, on_sent: Callable[[Record], None] | None = None
    ) -> list[PublishedStream]:
        """Send `records` (file order) at the recorded pace times `speed`, faults applied;
        marks among them (`RecordingReader.records(marks=True)`) as the module says."""
        loop = asyncio.get_running_loop()
        speed = self.config.speed
        start = loop.time()
        first_time: float | None = None
        for n, record in enumerate(records):
            publisher = self._publishers.get(record.stream)
            if publisher is None:
                continue
            if first_time is None:
                first_time = record.recv_time
            delay = 0.0
            if speed is not None:
                delay = start + (record.recv_time - first_time) / speed - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif n % 64 == 0:
                # flat out, or a burst recorded at one instant: sends do not yield by
                # themselves, so let the ROUTERs answer replay requests
                await asyncio.sleep(0)
            if record.mark:
                await self._emit_mark(publisher, record)
            else:
                await self._emit(publisher, record)
            if on_sent is not None:
                on_sent(record)
        for publisher in self._publishers.values():
            await self._finish(publisher)
        return self.streams

    async def _emit(self, p: _Publisher, record: Record) -> None:
        faults = self.config.faults
        if record.replayed and record.seq == p.prev_recorded and p.buffer:
            seq = record.seq - p.offset
            if p.buffer[-1][1] == seq:
                # the refetch of the batch just sent (its live copy did not decode): what the
                # engine's buffer held at that seq, no second message. Sent and buffered as
                # one, the replay answers held the seq twice, which no buffer does: every one
                # was refused and a router following the republisher never converged (QA)
                p.buffer[-1] = (record.topic, seq, record.payload)
                return
        if p.prev_recorded is not None and record.seq < p.prev_recorded:
            p.offset = 0  # a restart in the capture: the engine's buffer was new too
            p.buffer.clear()
        p.prev_recorded = record.seq
        if faults.restart_at is not None and not p.restarted and record.seq >= faults.restart_at:
            p.restarted = True
            p.offset = record.seq
            p.buffer.clear()
            p.info.restarts += 1
        await self._put(p, (record.topic, record.seq - p.offset, record.payload))

    async def _emit_mark(self, p: _Publisher, record: Record) -> None:
        if record.mark is RecordMark.FORGET_SEQ:
            p.info.forgets += 1
            if not self._forgets_said:
                self._forgets_said = True
                log.warning(
                    "stream %s: a forget-seq mark is not republished (no message tells a "
                    "subscriber to forget its seq; the clear before it is sent); this is "
                    "said once per run, `forgets` counts them per stream",
                    record.stream,
                )
            return
        if record.mark is not RecordMark.CLEAR or p.last is None:
            return  # before the stream's first message: nothing to clear yet
        topic, seq, _ = p.last
        layout, dp_rank = p.wire_shape()
        payload = encode_batch(EventBatch(record.recv_time, [Cleared()], dp_rank), layout)
        p.offset -= 1  # the recorded seqs after it follow it
        p.info.clears += 1
        await self._put(p, (topic, seq + 1, payload))

    async def _put(self, p: _Publisher, message: _Message) -> None:
        """Buffer `message` and send it, faults applied."""
        faults = self.config.faults
        p.last = message
        p.buffer.append(message)
        held, p.held = p.held, None
        if faults.reorder and held is None and self._rng.random() < faults.reorder:
            p.held = message
            p.tail_lost = message
            p.info.reordered += 1
            return
        if faults.drop and self._rng.random() < faults.drop:
            p.info.dropped += 1
            p.tail_lost = message
        else:
            await p.send(message)
            p.tail_lost = None
            if faults.dup and self._rng.random() < faults.dup:
                await p.send(message)
                p.info.duplicated += 1
        if held is not None:
            await p.send(held)

    async def _finish(self, p: _Publisher) -> None:
        if p.held is not None:
            # held back at the stream's last message: nothing came after it, so it goes out
            # in order and was not reordered after all
            await p.send(p.held)
            p.info.reordered -= 1
            p.held = None
            p.tail_lost = None
        if p.tail_lost is not None:
            await p.send(p.tail_lost)
            p.tail_lost = None
