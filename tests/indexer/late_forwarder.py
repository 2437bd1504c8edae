"""A ZMQ XSUB/XPUB forwarder between a worker's PUB and a router's SUB, for integration tests.

What a fleet puts between its workers and its routers (`zmq.proxy(xsub, xpub)`), as an asyncio
relay of frames so that a test can break it the ways that leave the router's SUB connected:
- `cut()`: the XSUB disconnects from the worker's PUB (the forwarder lost its upstream: a
  partition, the worker's host gone), its XPUB and every subscriber's connection stay up;
- `swallow = True`: frames from upstream are read and dropped, every connection up (a hop that
  swallows bytes, a TCP proxy blackholing);
- bound late (`start` after the router subscribed): the router's SUB is not connected until
  then (an events port that reaches nothing yet).
Subscriptions go upstream as `zmq.proxy` sends them (the XSUB keeps them and sends them again
when it reconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import zmq
import zmq.asyncio

__all__ = ["Forwarder", "free_endpoint"]


def free_endpoint() -> str:
    """A tcp endpoint on 127.0.0.1 free now (a forwarder binds it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Forwarder:
    """XSUB connected to `upstream`, XPUB bound on `endpoint`; `start` / `aclose`."""

    def __init__(self, ctx: zmq.asyncio.Context, upstream: str, endpoint: str) -> None:
        self.upstream = upstream
        self.endpoint = endpoint
        self.swallow = False
        self.relayed = 0  # data messages passed downstream
        self.swallowed = 0  # data messages read from upstream and dropped
        self._ctx = ctx
        self._xsub: zmq.asyncio.Socket | None = None
        self._xpub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Forwarder:
        xsub = self._xsub = self._ctx.socket(zmq.XSUB)
        xpub = self._xpub = self._ctx.socket(zmq.XPUB)
        for sock in (xsub, xpub):
            sock.setsockopt(zmq.LINGER, 0)
        xpub.bind(self.endpoint)
        xsub.connect(self.upstream)
        self._task = asyncio.create_task(self._relay(xsub, xpub))
        return self

    def cut(self) -> None:
        """Lose the upstream: the worker's batches reach the forwarder no more."""
        assert self._xsub is not None
        self._xsub.disconnect(self.upstream)

    def mend(self) -> None:
        """Reach the upstream again (the XSUB sends its subscriptions again)."""
        assert self._xsub is not None
        self._xsub.connect(self.upstream)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sock in (self._xsub, self._xpub):
            if sock is not None:
                sock.close(linger=0)

    async def __aenter__(self) -> Forwarder:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _relay(self, xsub: zmq.asyncio.Socket, xpub: zmq.asyncio.Socket) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(xsub, zmq.POLLIN)
        poller.register(xpub, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if xpub in ready:  # a subscription (or its end) from a subscriber: upstream
                await xsub.send_multipart(await xpub.recv_multipart())
            if xsub in ready:
                frames = await xsub.recv_multipart()
                if self.swallow:
                    self.swallowed += 1
                else:
                    self.relayed += 1
                    await xpub.send_multipart(frames)
