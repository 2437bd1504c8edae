"""The replay side of one stream: a DEALER asking a publisher's replay ROUTER for its buffer.

The publisher answers a request "from seq N" with every batch it still buffers from N on,
then an end marker (layouts in `indexer.protocol.frames`). `ReplayClient` sends the request
and yields the replies, in order, until the end marker; an answer that stops short for
`timeout_s` (on a connection made, until its heartbeat can have dropped it: below) raises
TimeoutError. A publisher's buffer is its own batches under its topic, with
seqs that follow each other: an answer with frames that do not parse (reported to
`on_malformed` too), a batch of another topic, a seq that does not follow the one before, or
more replies or time than any buffer takes (`MAX_REPLIES`, `deadline_s`) is not this stream's
buffer, and raises ReplayError: it proves nothing, as an answer that never came. Every request
whose answer raises either is reported to `on_unanswered` (`newest` swallows both, and the
subscriber's warnings are rate-limited: without it a replay socket that keeps timing out would
go uncounted). Whenever an
answer is left before its end marker the socket is reset, so that late replies of one
request are never read as the answer to the next. What the replies mean is the subscriber's
business (`indexer.stream`).

The DEALER is connected to the publisher's process itself (its events may come through a
forwarder, which hides the process going away), so its connection is watched too: `connect`
opens it ahead of any request, `link` (polled on `link_socket`) says whether a connection made
before dropped (the process may have ended: a restart candidate) and whether it is up now. A
request left unanswered (timed out, or proving nothing) counts as a drop too, once the socket
is reset for it: the fresh connection may never complete its handshake with a hung process, or
meet a new one (through a TCP hop that kept our side open while the process restarted), so no
drop of its own would ever tell. Before, such a reset was silent: a worker killed and restarted
while its answer hung was never suspected (QA: the dead process's 288 tokens predicted for good).

The DEALER's connection carries a ZMTP heartbeat: a PING every quarter of `timeout_s`, and the
connection is dropped (a drop `link` tells, as any other) when nothing came back within
`timeout_s` of one. The process's ZMQ I/O thread answers it, busy or not, so only a process that
is gone, stopped, or cut off is silent that long. It is the one sign of a process that went away
behind a hop that keeps our side of the connection open (a TCP proxy, a stateful middlebox):
no close reaches us, and nothing was asked to time out. Before, only a request's timeout told,
and a busy stream asks nothing (its idle probe never runs): a worker restarted behind such a
hop, its first batches lost on the events' path, had its dead cache predicted for good (QA v13:
288 tokens matched, 0 cached). The engines' replay ROUTERs (libzmq 4.2 and later) answer PINGs
without being asked to; no TTL is sent, so they never drop us for our silence. A request's
wait watches the monitor too: a drop while it waits ends it at once (its answer never comes,
and the caller hears of the drop without waiting out `timeout_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, Callable
from typing import NamedTuple, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.errors import ProtocolError, ReplayError
from indexer.protocol.frames import (
    ReplayData,
    ReplayEnd,
    build_replay_request,
    parse_replay_reply,
    topic_matches,
)

__all__ = ["MAX_REPLIES", "ReplayClient", "ReplayLink", "silence_bound_s"]

# more replies than any engine buffers (SGLang and vLLM keep 10,000 batches by default)
MAX_REPLIES = 1 << 20
# what the DEALER's monitor reports: a connection made (handshake done) or lost
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# ZMTP heartbeat PINGs sent within one `timeout_s` (module docstring)
_PINGS_PER_TIMEOUT = 4
# a request's wait beyond the heartbeat's bound (`ReplayClient._silence_s`), in `timeout_s`:
# libzmq's timers run late on a loaded host
_DROP_SLACK = 0.1


def silence_bound_s(timeout_s: float) -> float:
    """How long after its process went silent a DEALER's connection is dropped, at most (by
    libzmq's timers: a PING within a quarter of `timeout_s`, its answer awaited `timeout_s`)."""
    return timeout_s * (1 + 1 / _PINGS_PER_TIMEOUT)


class ReplayLink(NamedTuple):
    """What the DEALER's connection did since last asked (`ReplayClient.link`)."""

    dropped: bool  # a connection made before went away (the publisher's process may be gone)
    up: bool  # a connection is made now
    # a request went unanswered and the socket was reset for it (counted as a drop: the
    # process may have restarted meanwhile, unseen); apart, as only `dropped` is a sign of a
    # whole server going away (its other ranks are suspected for it)
    unanswered: bool = False


class ReplayClient:
    """One stream's DEALER to its publisher's replay socket (connected on first use)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        topic: bytes,
        *,
        timeout_s: float,
        yield_every: int,
        on_malformed: Callable[[str], None],
        on_unanswered: Callable[[], None] = lambda: None,
        deadline_s: float | None = None,
    ) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._topic = topic
        self._timeout_s = timeout_s
        # a whole answer: generous (a full buffer of large batches, applied as they come), but
        # bounded, so a socket that drips replies forever cannot hold a repair open
        self._deadline_s = deadline_s if deadline_s is not None else max(60.0, 30 * timeout_s)
        self._yield_every = yield_every
        self._on_malformed = on_malformed
        self._on_unanswered = on_unanswered
        self._dealer: zmq.asyncio.Socket | None = None
        # the DEALER's monitor, read without waiting (`link`): a plain socket over the same one
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_sync: zmq.Socket[bytes] | None = None
        # the DEALER as a plain socket: replies already queued are read without a future
        self._dealer_sync: zmq.Socket[bytes] | None = None
        self._drops = 0  # connections made that dropped (a request's answer ends at one)
        self._up = False  # a connection of the current DEALER is made
        self._dropped = False  # one made before dropped since `link` last said so
        self._unanswered = False  # a request went unanswered since `link` last said so
        # a connection was made since `link` last said so: read by a request (`replies` reads
        # the monitor too), it is still `link`'s news. Before, a request that read it left
        # `link` nothing to say, and a stream waiting for its replay connection to come back
        # never heard that it had (QA v4 `down`: `unverified` 15 s after the path healed)
        self._came_up = False

    async def replies(self, start: int) -> AsyncGenerator[ReplayData, None]:
        """Every buffered batch from `start` of our topic, in the publisher's order.

        TimeoutError when the publisher stops answering before its end marker; ReplayError
        when the answer cannot be this stream's buffer (module docstring), or when the
        connection it was asked on drops before its end (the rest never comes: a DEALER
        drops what it queued for a connection that went away).
        """
        dealer = self._socket()
        # a drop before the request is `link`'s news, not this answer's end
        self._read_link()
        drops = self._drops
        ended = False
        try:
            await dealer.send_multipart(build_replay_request(start))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._deadline_s
            received = 0
            previous: int | None = None
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise ReplayError(f"the answer did not end within {self._deadline_s:g}s")
                wait_s = self._silence_s()
                frames = await self._reply(min(wait_s, left), drops)
                if frames is None:
                    if wait_s < left:
                        raise TimeoutError(f"{wait_s:g}s without a reply")
                    raise ReplayError(f"the answer did not end within {self._deadline_s:g}s")
                received += 1
                if received > MAX_REPLIES:
                    raise ReplayError(f"the answer runs past {MAX_REPLIES} replies")
                if received % self._yield_every == 0:
                    await asyncio.sleep(0)  # a long replay must not starve the other streams
                try:
                    reply = parse_replay_reply(frames)
                except ProtocolError as exc:
                    self._on_malformed(f"bad replay frames: {exc}")
                    raise ReplayError(f"bad replay frames: {exc}") from exc
                if isinstance(reply, ReplayEnd):
                    ended = True
                    return
                if reply.topic is not None and not topic_matches(reply.topic, self._topic):
                    raise ReplayError(
                        f"it answers with batches of another topic ({reply.topic[:64]!r})"
                    )
                if previous is not None and reply.seq != previous + 1:
                    raise ReplayError(f"seq {reply.seq} follows seq {previous} in the answer")
                previous = reply.seq
                yield reply
        except (TimeoutError, ReplayError):
            # raised here, never by the consumer (which leaving early closes us, not raises)
            self._unanswered = True  # the reset below is a drop (module docstring)
            self._on_unanswered()
            raise
        finally:
            if not ended:
                self.close()  # late replies of this request must not answer the next one

    def _silence_s(self) -> float:
        """How long a request waits for its next reply: `timeout_s`, and on a connection made,
        until its heartbeat has had the time to drop it too (`silence_bound_s` and a slack).
        So a process that went silent (gone behind a hop, hung) ends the request as a drop,
        whose proof asks from a batch applied before the silence, and only one whose
        heartbeat still passes (alive, its answer slow) as unanswered. Before, whichever came
        first: a request sent just as the process went silent timed out before the drop, and
        its proof asked from the last whole answer's fence, which a busy worker's buffer no
        longer held: the stream was cleared and rebuilt (its entries lost) when the worker
        only hung a moment."""
        if not self._up:
            return self._timeout_s  # (no heartbeat runs before the handshake)
        return silence_bound_s(self._timeout_s) + _DROP_SLACK * self._timeout_s

    async def _reply(self, wait_s: float, drops: int) -> list[bytes] | None:
        """The next reply (None: none within `wait_s`), read as it is queued; waited for
        on the DEALER and its monitor together. ReplayError when the connection the request
        was sent on drops meanwhile (`drops`: the count at the request). Before, a drop was
        read only once the request had timed out: the heartbeat's drop of a process gone
        behind a hop that hides its close waited for a live check's timeout, and the dead
        process's cache was predicted a `timeout_s` longer (QA v20: 1.9 s after the kill)."""
        dealer, monitor = self._dealer_sync, self._monitor
        assert dealer is not None and monitor is not None and self._dealer is not None
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        poller: zmq.asyncio.Poller | None = None
        while True:
            try:
                return dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            self._read_link()
            if self._drops != drops:
                raise ReplayError("its connection dropped before the answer ended")
            left = until - loop.time()
            if left <= 0:
                return None
            if poller is None:
                poller = zmq.asyncio.Poller()
                poller.register(self._dealer, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)
            await poller.poll(max(1, math.ceil(left * 1000)))

    async def newest(self) -> int | None:
        """The newest seq the publisher buffers (asking from 0); None: nothing, or no answer."""
        newest: int | None = None
        try:
            async with contextlib.aclosing(self.replies(0)) as replies:
                async for reply in replies:
                    newest = reply.seq if newest is None else max(newest, reply.seq)
        except (TimeoutError, ReplayError):
            return None
        return newest

    def connect(self) -> None:
        """Connect the DEALER now, if it is not: its connection is watched (`link`) even
        while nothing is asked."""
        self._socket()

    @property
    def link_socket(self) -> zmq.asyncio.Socket | None:
        """The socket that turns readable when `link` has news (None: no DEALER now)."""
        return self._monitor

    def link(self) -> ReplayLink | None:
        """What the DEALER's connection did since last asked (None: nothing), read without
        waiting. A drop seen as the DEALER was closed (an answer left unended), a request
        left unanswered, and a connection made that a request's wait read, are kept for this."""
        monitor = self._monitor_sync
        if (
            not self._dropped
            and not self._unanswered
            and not self._came_up
            and (monitor is None or not cast(int, monitor.get(zmq.EVENTS)) & zmq.POLLIN)
        ):
            return None
        self._read_link()
        dropped, self._dropped = self._dropped, False
        unanswered, self._unanswered = self._unanswered, False
        self._came_up = False
        return ReplayLink(dropped, self._up, unanswered)

    def close(self) -> None:
        """Drop the socket (the next request connects a fresh one)."""
        if self._dealer is not None:
            self._read_link()  # a drop it saw is still told (`link`)
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.close(linger=0)
            self._dealer = self._monitor = self._monitor_sync = self._dealer_sync = None
            self._up = False

    def _read_link(self) -> None:
        monitor = self._monitor_sync
        if monitor is None:
            return
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed under us (the context is terminating)
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up = self._came_up = True
            elif event == zmq.EVENT_DISCONNECTED:
                # (a connection refused or never handshaken is no drop: nothing was there)
                self._drops += self._up
                self._dropped = self._dropped or self._up
                self._up = False

    def _socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            # the process's pulse (module docstring): a PING every quarter of the replay
            # timeout, the connection dropped when nothing came back within the timeout
            timeout_ms = max(1, round(self._timeout_s * 1000))
            dealer.setsockopt(zmq.HEARTBEAT_IVL, max(1, timeout_ms // _PINGS_PER_TIMEOUT))
            dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
            # before connecting, so that no event of the connection is missed
            monitor = dealer.get_monitor_socket(_LINK_EVENTS)
            dealer.connect(self._endpoint)
            self._dealer = dealer
            self._monitor = monitor
            self._monitor_sync = zmq.Socket.shadow(monitor.underlying)
            self._dealer_sync = zmq.Socket.shadow(dealer.underlying)
        return self._dealer
