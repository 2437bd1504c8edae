"""A lean forwarder: an asyncio Protocol with httptools, set beside kvroute in the proxy bench.

`kvroute bench proxy` holds kvroute's throughput against SGLang's Rust router. This forwarder
is one point of comparison for how much of the gap a router's own work accounts for: an
`asyncio.Protocol` that parses requests with httptools (the C parser uvicorn uses) and forwards
each body with kvroute's own upstream client (`router.http.upstream_client`), on uvloop. No
routing, no headers passed on, no streaming, no limits, no error pages: a request whose forward
fails gets a bare 502. It is a measuring stick, not a server; nothing in kvroute uses it. It is
a lean forwarder, not a floor: the parser lane below, on aiohttp's parser, has matched or beaten
its requests/s in some runs (docs/benchmarks/proxy.md).

Requests on one connection are answered in the order they came (pipelining), each forwarded
as soon as it is parsed.

`serve_parser_lane` is the same forwarder on aiohttp's own connection protocol and C parser
(`web.RequestHandler`, `feed_data`), answering from the parsed message: no `web.Request`, no
`web.Response`, no handler task of aiohttp's. Set beside the lean forwarder and the bare aiohttp
forwarders, it says how much of aiohttp's server-side cost is its parser and how much its
request and response objects, which decides whether a leaner server side for kvroute can keep
aiohttp's parser and limits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import httptools
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader

from router.http.upstream_client import Origin, UpstreamClient

__all__ = ["LeanForwarder", "ParserLaneForwarder", "serve_lean", "serve_parser_lane"]

_JSON = [("Content-Type", "application/json")]
_DEADLINE_S = 30.0
_CONNECT_TIMEOUT_S = 5.0


class LeanForwarder(asyncio.Protocol):
    """One client connection: parse, forward, answer in order."""

    def __init__(self, client: UpstreamClient, origin: Origin, base: str) -> None:
        self._client = client
        self._origin = origin
        self._base = base
        self._parser = httptools.HttpRequestParser(self)
        self._url = bytearray()
        self._body = bytearray()
        self._transport: asyncio.Transport | None = None
        # the answer written last (or on its way): the next one waits for it
        self._previous: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP transport (uvloop's is not an asyncio.Transport subclass, but has its methods)
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    # httptools' callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        path, body = self._url.decode(), bytes(self._body)
        self._url.clear()
        self._body.clear()
        self._previous = asyncio.ensure_future(self._answer(path, body, self._previous))

    async def _answer(self, path: str, body: bytes, previous: asyncio.Future[None] | None) -> None:
        answer = await _forward(self._client, self._origin, self._base + path, body)
        if previous is not None:
            await previous
        if self._transport is not None:
            self._transport.write(answer)


async def _forward(client: UpstreamClient, origin: Origin, path: str, body: bytes) -> bytes:
    """The whole HTTP/1.1 answer to one forwarded request (a bare 502 if the forward failed)."""
    loop = asyncio.get_running_loop()
    status, data = 502, b""
    with contextlib.suppress(Exception):
        async with client.post(
            origin,
            path,
            _JSON,
            body,
            deadline=loop.time() + _DEADLINE_S,
            connect_timeout_s=_CONNECT_TIMEOUT_S,
        ) as resp:
            status, data = resp.status, await resp.read()
    head = b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    return head % (status, len(data)) + data


class ParserLaneForwarder(web.RequestHandler):
    """aiohttp's per-connection protocol whose parsed messages skip aiohttp's request path."""

    def __init__(self, manager: _LaneServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._lane = manager
        self._previous: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close or self._parser is None:
            return
        try:
            messages, _, _ = self._parser.feed_data(data)
        except HttpProcessingError:
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            self.force_close()
            return
        for message, payload in messages:
            self._parser.message_consumed()
            path = getattr(message, "path", "/")
            self._previous = asyncio.ensure_future(self._answer(path, payload, self._previous))

    async def _answer(
        self, path: str, payload: StreamReader, previous: asyncio.Future[None] | None
    ) -> None:
        lane = self._lane
        body = await payload.read()  # all of it (the parser may still be feeding the rest)
        answer = await _forward(lane.client, lane.origin, lane.base + path, body)
        if previous is not None:
            await previous
        if self.transport is not None:
            self.transport.write(answer)


class _LaneServer(web.Server):
    def __init__(self, client: UpstreamClient, origin: Origin, base: str) -> None:
        super().__init__(self._unused, access_log=None)
        self.client, self.origin, self.base = client, origin, base

    async def _unused(self, request: web.BaseRequest) -> web.StreamResponse:
        raise AssertionError("the parser lane answers every request itself")

    def __call__(self) -> ParserLaneForwarder:
        return ParserLaneForwarder(self, loop=self._loop, **self._kwargs)


@contextlib.asynccontextmanager
async def serve_lean(upstream: str, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve the lean forwarder in front of `upstream` on an ephemeral port; yields its URL."""
    origin, base = Origin.split(upstream)
    async with UpstreamClient() as client:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: LeanForwarder(client, origin, base), host, 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://{host}:{port}"
        finally:
            server.close()
            await server.wait_closed()


@contextlib.asynccontextmanager
async def serve_parser_lane(upstream: str, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve the parser-lane forwarder in front of `upstream` on an ephemeral port; its URL."""
    origin, base = Origin.split(upstream)
    async with UpstreamClient() as client:
        loop = asyncio.get_running_loop()
        lane = _LaneServer(client, origin, base)
        server = await loop.create_server(lane, host, 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://{host}:{port}"
        finally:
            server.close()
            await lane.shutdown(1.0)
            await server.wait_closed()
