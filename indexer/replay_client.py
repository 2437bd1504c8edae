"""The replay side of one stream: a DEALER asking a publisher's replay ROUTER for its buffer.

The publisher answers a request "from seq N" with every batch it still buffers from N on,
then an end marker (layouts in `indexer.protocol.frames`). `ReplayClient` sends the request
and yields the replies that carry our topic, in order, until the end marker; an answer that
stops short for `timeout_s` raises TimeoutError after the socket is reset, so that late
replies of one request are never read as the answer to the next. Replies that do not parse
are reported to `on_malformed` and skipped. What the replies mean is the subscriber's business
(`indexer.subscriber`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from indexer.errors import ProtocolError
from indexer.protocol.frames import (
    ReplayData,
    ReplayEnd,
    build_replay_request,
    parse_replay_reply,
    topic_matches,
)

__all__ = ["ReplayClient"]


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
    ) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._topic = topic
        self._timeout_s = timeout_s
        self._yield_every = yield_every
        self._on_malformed = on_malformed
        self._dealer: zmq.asyncio.Socket | None = None

    async def replies(self, start: int) -> AsyncIterator[ReplayData]:
        """Every buffered batch from `start` of our topic, in the publisher's order.

        TimeoutError when the publisher stops answering before its end marker.
        """
        dealer = self._socket()
        try:
            await dealer.send_multipart(build_replay_request(start))
            received = 0
            while True:
                async with asyncio.timeout(self._timeout_s):
                    frames = await dealer.recv_multipart()
                received += 1
                if received % self._yield_every == 0:
                    await asyncio.sleep(0)  # a long replay must not starve the other streams
                try:
                    reply = parse_replay_reply(frames)
                except ProtocolError as exc:
                    self._on_malformed(f"bad replay frames: {exc}")
                    continue
                if isinstance(reply, ReplayEnd):
                    return
                if reply.topic is None or topic_matches(reply.topic, self._topic):
                    yield reply
        except TimeoutError:
            self.close()  # late replies of this request must not answer the next one
            raise

    async def newest(self) -> int | None:
        """The newest seq the publisher buffers (asking from 0); None: nothing, or no answer."""
        newest: int | None = None
        try:
            async for reply in self.replies(0):
                newest = reply.seq if newest is None else max(newest, reply.seq)
        except TimeoutError:
            return None
        return newest

    def close(self) -> None:
        """Drop the socket (the next request connects a fresh one)."""
        if self._dealer is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.close(linger=0)
            self._dealer = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self._endpoint)
            self._dealer = dealer
        return self._dealer
