"""An XSUB/XPUB forwarder for tests: a worker's KV events reach the subscriber through it, as
through a `zmq.proxy` between the workers and their routers (the router's SUB connects to the
forwarder, which stays up while the worker behind it restarts).

Its loop is `zmq.proxy`'s, with two switches a test needs: `dropping` (the forwarder reads and
discards what its upstream publishes: its path to the worker away a moment, so the new
process's first batches are lost) and `repoint` (its upstream is another PUB from now on).
"""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = ["Forwarder"]


class Forwarder:
    """XSUB connected to `upstream`, XPUB bound on a loopback port (`endpoint`)."""

    def __init__(self, ctx: zmq.asyncio.Context, upstream: str) -> None:
        self._ctx = ctx
        self.upstream = upstream
        self.dropping = False
        self.forwarded = 0  # messages passed on
        self.dropped = 0  # messages read while `dropping`
        self.handshakes = 0  # connections the XSUB made upstream
        self.subscriptions = 0  # subscriptions a subscriber sent it (passed upstream)
        self._task: asyncio.Task[None] | None = None
        self._xsub = ctx.socket(zmq.XSUB)
        self._xpub = ctx.socket(zmq.XPUB)
        self._monitor = self._xsub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        for sock in (self._xsub, self._xpub):
            sock.setsockopt(zmq.LINGER, 0)
        port = self._xpub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._xsub.connect(upstream)

    async def __aenter__(self) -> Forwarder:
        self._task = asyncio.create_task(self._run(), name="test-forwarder")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(zmq.ZMQError):
            self._xsub.disable_monitor()
        for sock in (self._monitor, self._xsub, self._xpub):
            sock.close(linger=0)

    def repoint(self, upstream: str) -> None:
        """Read another PUB from now on (the subscriptions go there as the XSUB connects)."""
        self._xsub.disconnect(self.upstream)
        self.upstream = upstream
        self._xsub.connect(upstream)

    async def connected(self, handshakes: int, timeout_s: float = 10.0) -> None:
        """Wait until the XSUB made `handshakes` connections upstream in all, then a moment
        for its subscriptions to reach the PUB (a PUB sends to subscribers it knows only)."""
        async with asyncio.timeout(timeout_s):
            while self.handshakes < handshakes:  # noqa: ASYNC110 (no event for it)
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)

    async def subscribed(self, timeout_s: float = 10.0) -> None:
        """Wait until a subscriber's subscription came, then a moment for it to reach the
        PUB upstream: what is published before reaches no subscriber."""
        async with asyncio.timeout(timeout_s):
            while not self.subscriptions:  # noqa: ASYNC110 (no event for it)
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)

    async def _run(self) -> None:
        poller = zmq.asyncio.Poller()
        for sock in (self._xsub, self._xpub, self._monitor):
            poller.register(sock, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if self._monitor in ready:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.handshakes += 1
            if self._xpub in ready:  # subscriptions, upstream
                frames = await self._xpub.recv_multipart()
                self.subscriptions += frames[0][:1] == b"\x01"
                await self._xsub.send_multipart(frames)
            if self._xsub in ready:
                frames = await self._xsub.recv_multipart()
                if self.dropping:
                    self.dropped += 1
                else:
                    self.forwarded += 1
                    await self._xpub.send_multipart(frames)
