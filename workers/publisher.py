"""The KV-event publisher of one DP rank: SGLang's ZMQ transport, PUB live plus ROUTER replay.

Live: every batch goes out on a PUB socket as `[topic, seq, payload]`, seq counting from 0 when
the publisher starts. PUB drops messages for slow subscribers, so the last `buffer_steps`
batches (at most `buffer_bytes` of them: `workers.replay_ring`) are also kept for replay: a
DEALER sends `[b"", start_seq]` to the ROUTER socket and gets every buffered batch with
seq >= start_seq in the newer layout `[b"", topic, seq, payload]`, then the end marker
`[b"", b"", END_SEQ, b""]` (SGLang >= 0.5.22).

A plain ROUTER drops what a slow requester cannot take (the end marker included: it then waits
for nothing), so the replay socket is `ROUTER_MANDATORY`: a full pipe makes the send wait, a
requester that stalls past `replay_stall_s` (or has gone) loses its replay, and the others are
served.

`bind_port_run` binds one socket per DP rank on consecutive ports (rank r on base + r), also
when the base is ephemeral.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from types import TracebackType

import zmq
import zmq.asyncio

from indexer.protocol import ProtocolError
from indexer.protocol.encode import WireLayout, encode_batch
from indexer.protocol.events import Event, EventBatch
from indexer.protocol.frames import (
    build_live,
    build_replay_end,
    build_replay_reply,
    parse_replay_request,
)
from workers.errors import PortRangeError
from workers.port_runs import ephemeral_range, run_base
from workers.replay_ring import ReplayRing

__all__ = ["EventPublisher", "bind_port_run"]

_log = logging.getLogger(__name__)

# SGLang's publisher default: a deep send queue, so bursts are not dropped locally.
_SNDHWM = 100_000
# the replay buffer's byte bound (see workers.replay_ring): 32 MiB holds 2,000-10,000 batches
DEFAULT_BUFFER_BYTES = 32 << 20
_REPLAY_STALL_S = 5.0
_PORT_ATTEMPTS = 64
_RUNS = random.Random()  # the bases tried for runs of ports


def bind_port_run(
    ctx: zmq.asyncio.Context, kind: int, host: str, base: int, count: int
) -> tuple[list[zmq.asyncio.Socket], int]:
    """Bind `count` sockets of `kind` on host:base+r; base 0 picks a free run (outside the
    kernel's ephemeral ports when there are several: `workers.port_runs`). Returns the base."""
    ephemeral = ephemeral_range()
    for _ in range(_PORT_ATTEMPTS if base == 0 else 1):
        sockets: list[zmq.asyncio.Socket] = []
        rank = 0  # the rank being bound: a failure names its port
        try:
            first = ctx.socket(kind)
            first.linger = 0
            sockets.append(first)
            if base == 0 and count == 1:
                port = first.bind_to_random_port(f"tcp://{host}")
            elif base == 0:
                port = run_base(count, _RUNS, ephemeral)
                first.bind(f"tcp://{host}:{port}")
            else:
                port = base
                first.bind(f"tcp://{host}:{port}")
            for rank in range(1, count):
                sock = ctx.socket(kind)
                sock.linger = 0
                sockets.append(sock)
                sock.bind(f"tcp://{host}:{port + rank}")
        except zmq.ZMQError as exc:
            for sock in sockets:
                sock.close(linger=0)
            if base != 0:
                raise PortRangeError(_bind_failure(host, base, rank, count, exc)) from exc
            continue
        return sockets, port
    raise PortRangeError(f"no run of {count} free consecutive ports on {host}")


def _bind_failure(host: str, base: int, rank: int, count: int, exc: zmq.ZMQError) -> str:
    """Name the port that failed as a port, and a run as the ranks' (not as `base+count`,
    which read as one port past `base`)."""
    where = f"tcp://{host}:{base + rank}"
    if count == 1:
        return f"cannot bind {where}: {exc}"
    return (
        f"cannot bind {where} (DP rank {rank}; the {count} ranks take consecutive ports "
        f"from {base}): {exc}"
    )


class EventPublisher:
    """One stream: a PUB socket, a bounded replay buffer and the ROUTER replay service.

    An async context manager owning its replay task; `publish` is synchronous (PUB never
    blocks: it drops at the high-water mark), so seq order is publish order.
    """

    def __init__(
        self,
        *,
        pub: zmq.asyncio.Socket,
        replay: zmq.asyncio.Socket,
        topic: str,
        layout: WireLayout,
        buffer_steps: int,
        dp_rank: int,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        clock: Callable[[], float] = time.time,
        replay_stall_s: float = _REPLAY_STALL_S,
    ) -> None:
        self._pub = pub
        self._replay = replay
        self._topic = topic.encode("utf-8")
        self._layout: WireLayout = layout
        self._dp_rank = dp_rank
        self._clock = clock
        self._buffer = ReplayRing(max_batches=buffer_steps, max_bytes=buffer_bytes)
        self._next_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._replay_stall_s = replay_stall_s
        self.bad_replay_requests = 0
        self.abandoned_replays = 0
        self.send_failures = 0
        pub.sndhwm = _SNDHWM
        replay.router_mandatory = True

    @property
    def next_seq(self) -> int:
        """The seq the next batch will get (= batches published so far)."""
        return self._next_seq

    async def __aenter__(self) -> EventPublisher:
        self._task = asyncio.create_task(self._serve_replays(), name="kv-event-replay")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._buffer.close()

    def publish(self, events: list[Event]) -> int | None:
        """Publish one batch (nothing if `events` is empty); returns its seq."""
        if not events:
            return None
        batch = EventBatch(ts=self._clock(), events=events, dp_rank=self._dp_rank)
        payload = encode_batch(batch, self._layout)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append(seq, payload)
        sent = self._pub.send_multipart(build_live(self._topic, seq, payload), flags=zmq.NOBLOCK)
        # NOBLOCK sends complete inside the call; read the outcome so no error goes unretrieved.
        if isinstance(sent, asyncio.Future) and sent.done() and sent.exception() is not None:
            self.send_failures += 1
        return seq

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) < 2:
                self.bad_replay_requests += 1
                continue
            identity, request = frames[0], frames[1:]
            try:
                start = parse_replay_request(request)
            except ProtocolError as exc:
                self.bad_replay_requests += 1
                if self.bad_replay_requests == 1:
                    _log.warning("ignoring a malformed replay request: %s", exc)
                continue
            try:
                await self._send_replay(identity, start)
            except (TimeoutError, zmq.ZMQError) as exc:
                self.abandoned_replays += 1
                if self.abandoned_replays == 1:
                    _log.warning("abandoned a replay (requester gone or not reading): %s", exc)

    async def _send_replay(self, identity: bytes, start: int) -> None:
        # A snapshot: batches published while replies go out are live, not replayed.
        replies = [
            build_replay_reply(self._topic, seq, payload)
            for seq, payload in self._buffer.since(start)
        ]
        replies.append(build_replay_end(with_topic=True))
        for reply in replies:
            async with asyncio.timeout(self._replay_stall_s):
                await self._replay.send_multipart([identity, *reply])
