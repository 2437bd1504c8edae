"""The upstream hop's HTTP/1.1 client: one POST to a worker, its answer read as it arrives.

Why not aiohttp's client, as for every other outgoing request: on the proxy's hot path it was
a quarter of the router's CPU per request (a py-spy profile of `kvroute serve` under
`kvroute bench proxy`'s load: `ClientSession._request`, its request and response objects, its
timers and tracing signals), more than routing itself. This client does only what the hop
needs: a keep-alive pool per worker origin, the request written in one `transport.write`, the
answer parsed by llhttp (`httptools`, the parser uvicorn uses) into a status, headers and body
chunks, and one timer per request for its deadline. Bodies are passed on as the worker sent
them (no decompression: the proxy forwards `Content-Encoding` as it is), and no cookie is kept.

Errors say what happened, so the proxy can tell a retry from a failure: `UpstreamConnectError`
(refused, unreachable, or not connected within the connect timeout: `UpstreamConnectTimeout`,
unless the router's own stall expired it, when the connection is made again once,
`router.late_timeout`; or the router's own socket not made, out of descriptors: its cause's errno
tells, `router.http.local_shortage`), `UpstreamDroppedError` (the connection closed or sent
something that is not HTTP before the answer ended) and `TimeoutError` (the request's deadline
passed).

A connection goes back to the pool only when its answer was read to the end and the worker
allows keep-alive; an idle one is closed after `keepalive_s` (4 s, under uvicorn's 5 s default,
so the router closes first and seldom sends on a connection the worker is closing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from router.late_timeout import late_by

__all__ = [
    "Exchange",
    "Origin",
    "UnsafeHeaderError",
    "UpstreamClient",
    "UpstreamClientError",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamDroppedError",
    "UpstreamResponse",
]

log = logging.getLogger(__name__)

# bytes of answer buffered before the socket stops being read (a slow client slows the worker)
_HIGH_WATER = 256 * 1024
# what one answer's head may hold: a worker whose headers never end would fill the router's
# memory (a client's head is held to 128 lines of 8190 bytes by the listener)
_MAX_HEADERS = 256
_MAX_HEADER_BYTES = 256 * 1024
# a whole (not streamed) answer is held in memory to read its usage: beyond this it is refused
# as broken (an LLM answer with every token's logprobs is a few megabytes)
_MAX_WHOLE_ANSWER_BYTES = 256 * 1024 * 1024


class Origin(NamedTuple):
    """Where a worker listens: the pool's key, and what the request's `Host` says."""

    host: str
    port: int
    tls: bool
    netloc: str  # the Host header: host:port as the URL wrote it (IPv6 in brackets)

    @classmethod
    def split(cls, url: str) -> tuple[Origin, str]:
        """The origin of an http(s) URL and its path (no trailing slash): the base of the
        worker's routes."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        netloc = parts.netloc.rpartition("@")[2]  # credentials never go in a Host header
        return cls(parts.hostname, port, tls, netloc), parts.path.rstrip("/")


class UpstreamClientError(Exception):
    """The upstream request failed."""


class UpstreamConnectError(UpstreamClientError):
    """No connection to the worker (refused, unreachable)."""


class UpstreamConnectTimeout(UpstreamConnectError):
    """No connection within the connect timeout."""


class UpstreamDroppedError(UpstreamClientError):
    """The connection closed, or carried something that is not HTTP, before the answer ended."""


class UnsafeHeaderError(UpstreamClientError):
    """A header name or value holds a line break (it would smuggle a header of its own)."""


class _Stop(Exception):
    """Raised in a parser callback to stop the parse (the connection says why)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker; the parser's callbacks fill the current answer."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        origin: Origin,
        on_lost: Callable[[_Connection], None],
    ) -> None:
        self.origin = origin
        self._on_lost = on_lost  # the pool forgets a connection once it is gone
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._busy = False
        self._paused = False
        self._deadline: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.headers_done = False
        self.complete = False
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self._until_close = False
        self._keep_alive = False
        self._interim = False  # a 1xx answer is being parsed: the real one follows
        self._head_bytes = 0
        self._refusal = ""  # why a parser callback stopped the parse (said in the error)

    # ------------------------------------------------------------ transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP transport (uvloop's is not an asyncio.Transport subclass, but has its methods)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            # nothing was asked: a worker talking out of turn is not to be trusted again
            self._fail(UpstreamDroppedError("the worker sent bytes with no request pending"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamDroppedError("the worker switched protocols"))
        except httptools.HttpParserError as exc:
            if self.complete:
                # bytes after the answer's end (a second answer nobody asked for): the answer
                # stands, the connection is not trusted again
                self._keep_alive = False
                if self.transport is not None:
                    self.transport.close()
                return
            self._fail(UpstreamDroppedError(self._refusal or f"not an HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        transport, self.transport = self.transport, None
        del transport
        if self._busy and not self.complete:
            if self.headers_done and self._until_close and exc is None:
                # an answer whose end is the connection's end
                self.complete = True
                self._cancel_deadline()
            else:
                reason = f": {exc}" if exc is not None else ""
                self._error = self._error or UpstreamDroppedError(
                    f"the worker closed the connection before its answer ended{reason}"
                )
        self._wake()
        self._on_lost(self)

    def pause_writing(self) -> None:
        """Large bodies wait in the transport's buffer; nothing to do."""

    def resume_writing(self) -> None:
        """See `pause_writing`."""

    # ------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            self._refusal = "the worker sent a second answer after the first"
            raise _Stop  # the parser stops here: nothing of it mixes into the first answer

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.headers_done:
            # a trailer field of a chunked answer (llhttp reports it as a header): the head
            # was passed on already, or is being copied right now when the trailer came in the
            # same read, and a trailer is not allowed to act as a header (RFC 9110 6.5.1; a
            # worker's `Content-Type` or `Set-Cookie` would end up in the client's head)
            return
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > _MAX_HEADER_BYTES or len(self.headers) >= _MAX_HEADERS:
            self._refusal = (
                f"the worker's answer head exceeds {_MAX_HEADERS} headers or "
                f"{_MAX_HEADER_BYTES // 1024} KiB"
            )
            raise _Stop
        self.headers.add(name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # 100 Continue, 103 Early Hints: not the answer (101 is refused by the parser)
            self._interim = True
            self.headers = CIMultiDict()
            return
        self.status = status
        self.headers_done = True
        headers = self.headers
        self._until_close = (
            "Content-Length" not in headers
            and "chunked" not in headers.get("Transfer-Encoding", "").lower()
            and self.status not in (204, 304)
        )
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        # asked here: once the callback returns, the parser has reset for the next answer
        self._keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._cancel_deadline()
        self._wake()

    # ------------------------------------------------------------ the request's side

    def send(self, request: bytes, deadline: float) -> None:
        """Write one request; its answer arrives through the parser callbacks."""
        assert self.transport is not None and not self._busy
        self._reset()
        self._busy = True
        self._deadline = self._loop.call_at(deadline, self._expire)
        self.transport.write(request)

    async def wait(self) -> None:
        """Until something arrives (headers, body, the end) or the request fails."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def take(self) -> bytes:
        """The body bytes arrived so far (the reader resumes once it took them)."""
        body = self.body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def usable(self, expired_before: float) -> bool:
        """Whether an idle connection is still open and idle since `expired_before` at most."""
        return self.transport is not None and self.idle_since > expired_before

    def reusable(self) -> bool:
        """Whether the answer ended cleanly on a connection the worker keeps open."""
        return (
            self.complete
            and self._error is None
            and self.transport is not None
            and not self.transport.is_closing()
            and self._keep_alive
        )

    def finish(self) -> None:
        """The answer is done with (read, or abandoned)."""
        self._busy = False
        self._cancel_deadline()

    def close(self) -> None:
        """Drop the connection (the worker sees it close: an abandoned request aborts)."""
        self._cancel_deadline()
        self._busy = False
        if self.transport is not None:
            self.transport.close()

    def _expire(self) -> None:
        self._deadline = None
        self._fail(TimeoutError("the request's deadline passed"))

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


class Exchange:
    """One request's exchange (`UpstreamClient.post`): a class, not a generator-based context
    manager, which costs a forwarded request about 2% more CPU (measured: the generator, its
    wrapper and their frames on every enter and exit)."""

    __slots__ = (
        "_client",
        "_connect_timeout_s",
        "_deadline",
        "_origin",
        "_request",
        "_response",
    )

    def __init__(
        self,
        client: UpstreamClient,
        origin: Origin,
        request: bytes,
        deadline: float,
        connect_timeout_s: float,
    ) -> None:
        self._client = client
        self._origin = origin
        self._request = request
        self._deadline = deadline
        self._connect_timeout_s = connect_timeout_s
        self._response: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        conn = await self._client._acquire(self._origin, self._deadline, self._connect_timeout_s)
        conn.send(self._request, self._deadline)
        try:
            while not conn.headers_done:
                await conn.wait()
        except BaseException:
            conn.close()
            raise
        response = self._response = UpstreamResponse(self._client, conn)
        return response

    async def __aexit__(self, kind: object, error: object, traceback: object) -> None:
        response = self._response
        assert response is not None  # entered
        if error is None and response._conn.complete:
            response.release()
        else:
            response.close()


class UpstreamResponse:
    """A worker's answer: status and headers at once, the body as it arrives."""

    __slots__ = ("_client", "_conn", "_done", "headers", "status")

    def __init__(self, client: UpstreamClient, conn: _Connection) -> None:
        self._client = client
        self._conn = conn
        self._done = False
        self.status = conn.status
        self.headers = conn.headers

    async def read(self) -> bytes:
        """The whole body (b"" once the answer was released: its connection may serve another
        request by then)."""
        if self._done:
            return b""
        conn = self._conn
        # taken as it arrives: past the high-water mark the socket is paused until the body
        # is taken, so waiting for the end with it all buffered would wait forever
        parts: list[bytes] = []
        size = 0
        while not conn.complete:
            if conn.body:
                part = conn.take()
                parts.append(part)
                size += len(part)
                if size > _MAX_WHOLE_ANSWER_BYTES:
                    self.close()
                    raise UpstreamDroppedError(
                        f"the worker's answer exceeds {_MAX_WHOLE_ANSWER_BYTES >> 20} MiB"
                    )
            await conn.wait()
        if conn.body:
            parts.append(conn.take())
        self.release()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; b"" at the end."""
        if self._done:
            return b""
        conn = self._conn
        while not conn.body:
            if conn.complete:
                self.release()
                return b""
            await conn.wait()
        return conn.take()

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if it can be reused."""
        if self._done:
            return
        self._done = True
        self._client._release(self._conn)

    def close(self) -> None:
        """Done with the answer before its end: its connection is dropped."""
        if self._done:
            return
        self._done = True
        self._conn.close()


class UpstreamClient:
    """Keep-alive connections to the workers, and one POST at a time on each."""

    def __init__(
        self,
        *,
        keepalive_s: float = 4.0,
        max_idle_per_origin: int = 256,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        """`tls_context` verifies https workers (default: the system's trust store and
        hostname checks, as aiohttp's client)."""
        self._keepalive_s = keepalive_s
        self._max_idle = max_idle_per_origin
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._tls_context = tls_context

    def _tls(self) -> ssl.SSLContext:
        # the system's trust store and hostname checks, made once (it reads the CA files)
        if self._tls_context is None:
            self._tls_context = ssl.create_default_context()
        return self._tls_context

    async def __aenter__(self) -> UpstreamClient:
        self._sweeper = asyncio.get_running_loop().create_task(
            self._sweep(), name="kvroute-upstream-sweep"
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection (those in use too)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()

    def post(
        self,
        origin: Origin,
        path: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        *,
        deadline: float,
        connect_timeout_s: float,
    ) -> Exchange:
        """POST `body` to `origin` + `path`; `async with` it for the answer once its headers
        arrived.

        `deadline` (event-loop time) bounds the whole exchange, the body included;
        `connect_timeout_s` bounds a new connection. Leaving the block releases the answer's
        connection (back to the pool when it was read to the end, else closed).
        """
        return Exchange(
            self, origin, _request_bytes(origin, path, headers, body), deadline, connect_timeout_s
        )

    async def _acquire(
        self, origin: Origin, deadline: float, connect_timeout_s: float
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(origin)
        if idle:
            expired_before = loop.time() - self._keepalive_s
            while idle:
                conn = idle.pop()
                if conn.usable(expired_before):
                    return conn
                conn.close()
                self._open.discard(conn)
        for attempt in range(2):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError("the request's deadline passed")
            connect_timeout = min(connect_timeout_s, remaining)
            try:
                async with asyncio.timeout(connect_timeout) as scope:
                    _, protocol = await loop.create_connection(
                        lambda: _Connection(loop, origin, self._open.discard),
                        origin.host,
                        origin.port,
                        ssl=self._tls() if origin.tls else None,
                    )
            except TimeoutError:
                if connect_timeout < connect_timeout_s:
                    raise TimeoutError("the request's deadline passed while connecting") from None
                late = late_by(scope)
                if late is not None and not attempt:
                    # the router's own stall expired it (`router.late_timeout`): the worker
                    # may have accepted all along, so a second connect has the verdict
                    log.debug(
                        "connecting to %s expired while the router's loop was held up (its "
                        "timer ran %.0f ms late): connecting again",
                        origin.netloc,
                        late * 1e3,
                    )
                    continue
                raise UpstreamConnectTimeout(
                    f"no connection to {origin.netloc} within {connect_timeout_s:g} s"
                ) from None
            except OSError as exc:
                raise UpstreamConnectError(
                    f"cannot connect to {origin.netloc}: {exc.strerror or exc}"
                ) from exc
            assert isinstance(protocol, _Connection)
            self._open.add(protocol)
            return protocol
        raise AssertionError("not reached: the second attempt returns or raises")

    def _release(self, conn: _Connection) -> None:
        reusable = conn.reusable()
        conn.finish()
        if not reusable:
            conn.close()
            self._open.discard(conn)
            return
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self._max_idle:
            conn.close()
            self._open.discard(conn)
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    async def _sweep(self) -> None:
        """Close the connections idle longer than the keep-alive, every half of it."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._keepalive_s / 2)
            expired_before = loop.time() - self._keepalive_s
            for origin, idle in list(self._idle.items()):
                keep = []
                for conn in idle:
                    if conn.usable(expired_before):
                        keep.append(conn)
                    else:
                        conn.close()
                        self._open.discard(conn)
                if keep:
                    self._idle[origin] = keep
                else:
                    del self._idle[origin]


def _request_bytes(
    origin: Origin, path: str, headers: Iterable[tuple[str, str]], body: bytes
) -> bytes:
    """The request as it goes on the wire: one buffer, one write."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {origin.netloc}"]
    lines.append(f"Content-Length: {len(body)}")
    lines.extend(map(": ".join, headers))  # (name, value) pairs
    head = "\r\n".join(lines)
    # a header carrying a line break would smuggle a header (or a request) of its own
    breaks = len(lines) - 1
    if head.count("\n") != breaks or head.count("\r") != breaks:
        raise UnsafeHeaderError("a header name or value holds a line break")
    return head.encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body
