"""A worker's answer passed to the client by writing it straight to the client's connection.

aiohttp's `web.Response` and `web.StreamResponse` make the same bytes through `prepare`, a
second header dict and their payload writer's framing, a few Python calls for every head and
every chunk. For the proxy's answers, a JSON body of known length or an SSE stream to an
HTTP/1.1 client, that machinery was a tenth of the router's CPU per tiny request and a fifth
per streamed one (`kvroute bench proxy` under py-spy). Here a head is joined once, a whole
answer goes out with its body in one `transport.write`, and each chunk of a streamed one in
one write with its chunked framing; aiohttp gets back a response it sees as sent.

The answers are those aiohttp would send (the same Date, Server, Content-Type default,
Transfer-Encoding and Connection rules; tests/router/http/test_direct_answer.py compares them
over real sockets), and a large answer still waits for a slow client, until the request's
deadline when one is given: a client that stops reading is then cut (`ClientStalledError`),
else it would hold the request, its worker's connection and its place in the worker's load
for as long as it likes. What this does not cover
(an HTTP/1.0 client, a status whose body must be empty, a header with a control character)
goes through aiohttp as before, which also refuses what would be a header injection.

A streamed answer to an HTTP/1.0 client has neither chunks (HTTP/1.0 has none) nor a length:
its body ends where the connection does, so the connection is closed after it, whatever the
client's `Connection: keep-alive` asked (aiohttp alone kept it, and that client waited for the
idle timeout to see its answer end). A whole answer has its Content-Length and keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from multidict import CIMultiDict

__all__ = ["ChunkedResponse", "ClientStalledError", "SentResponse", "send_whole"]

log = logging.getLogger(__name__)

# what aiohttp refuses in a header name or value (its writer's rule): control characters but TAB
_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# statuses whose answer has no body and whose framing headers aiohttp's rules rewrite
_EMPTY_BODY = frozenset({204, 304})
_CONTENT_TYPE = "content-type"
_OCTETS = "application/octet-stream"
_JOIN_BELOW = 256 * 1024  # a smaller body is copied behind its head (or framing): one send
_LAST_CHUNK = b"0\r\n\r\n"


class _Clock:
    """The Date header's value, made once a second (as aiohttp caches its own)."""

    def __init__(self) -> None:
        self._second = -1
        self._value = ""

    def date(self) -> str:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True)
        return self._value


_CLOCK = _Clock()
_STATUS_LINES: dict[int, str] = {}


def _status_line(status: int) -> str:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""  # aiohttp sends an unknown status with an empty reason
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}"
    return line


def _head(
    request: web.BaseRequest, status: int, headers: CIMultiDict[str], framing: str
) -> bytes | None:
    """The head aiohttp would send for this answer with `framing` (its Content-Length or
    Transfer-Encoding line); None where aiohttp must make it (see the module's doc)."""
    if request.version != HttpVersion11 or status in _EMPTY_BODY or status < 200:
        return None
    items = list(headers.items())
    if _FORBIDDEN.search("".join([k + v for k, v in items])) is not None:
        return None
    lines = [_status_line(status)]
    lines.extend([k + ": " + v for k, v in items])
    lines.append(framing)
    if _CONTENT_TYPE not in headers and framing != "Content-Length: 0":
        lines.append("Content-Type: " + _OCTETS)
    if "date" not in headers:
        lines.append("Date: " + _CLOCK.date())
    if "server" not in headers:
        lines.append("Server: " + SERVER_SOFTWARE)
    if not request.keep_alive and "connection" not in headers:
        lines.append("Connection: close")
    lines.append("\r\n")
    # a worker's header value that is not UTF-8 was decoded with surrogateescape
    # (`router.http.upstream_client`): it goes out as the very bytes the worker sent
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")


def _encodable(headers: CIMultiDict[str]) -> CIMultiDict[str]:
    """`headers` as aiohttp can write them (it encodes strictly as UTF-8): a value holding a
    worker's bytes that are not UTF-8 gets U+FFFD in their place. `headers` itself when none
    does (the usual case, checked at the cost of one encode)."""
    try:
        "".join(headers.values()).encode()
    except UnicodeEncodeError:
        return CIMultiDict(
            (k, v.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
            for k, v in headers.items()
        )
    return headers


def _open_transport(request: web.BaseRequest) -> asyncio.Transport:
    """The client's connection; ConnectionResetError once it is closed or closing (as
    aiohttp's writer raises)."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client closed the connection")
    return transport


class ClientStalledError(ConnectionResetError):
    """The client did not read its answer by the request's deadline: its connection was
    aborted (`close` would wait for the unread bytes to go, which never happens). A
    ConnectionResetError, as for a client gone: the writer's callers treat it as one."""


async def _bounded(request: web.BaseRequest, deadline: float | None, step: Awaitable[None]) -> None:
    """`step` (a write that waits for the client to read), cut at `deadline` (event-loop time;
    None: unbounded): then the connection is aborted and ClientStalledError raised."""
    if deadline is None:
        await step
        return
    try:
        async with asyncio.timeout_at(deadline):
            await step
    except TimeoutError:
        transport = request.transport
        if transport is not None:
            transport.abort()
        log.info("an answer was cut at the request deadline: the client stopped reading it")
        raise ClientStalledError("the client did not read its answer by the deadline") from None


class SentResponse(web.StreamResponse):
    """A response already written to the client: aiohttp's `prepare` and `write_eof` on it are
    no-ops (it is `eof_sent`), and aiohttp reads its status, keep-alive and length as usual."""

    def __init__(self, status: int, headers: CIMultiDict[str], keep_alive: bool, size: int):
        super().__init__(status=status, headers=headers)
        self._keep_alive = keep_alive
        self._eof_sent = True
        self._body_length = size


async def send_whole(
    request: web.BaseRequest,
    status: int,
    headers: CIMultiDict[str],
    body: bytes,
    *,
    deadline: float | None = None,
) -> web.StreamResponse:
    """Answer `request` with `status`, `headers` and `body`; the response it was sent as.

    Raises ConnectionResetError when the client is gone (as aiohttp's writer does), and
    ClientStalledError when it has not taken the body by `deadline` (event-loop time)."""
    head = _head(request, status, headers, f"Content-Length: {len(body)}")
    if head is None:
        response = web.Response(status=status, body=body, headers=_encodable(headers))
        await response.prepare(request)
        await _bounded(request, deadline, response.write_eof())
        return response
    transport = _open_transport(request)
    if len(body) < _JOIN_BELOW:
        transport.write(head + body)
    else:
        transport.write(head)
        transport.write(body)
    # a large answer to a slow client: wait for room, as aiohttp's writer does
    if request.protocol.writing_paused:
        await _bounded(request, deadline, request.writer.drain())
    return SentResponse(status, headers, request.keep_alive, len(body))


class ChunkedResponse(web.StreamResponse):
    """A streamed answer (chunked transfer coding) whose head and chunks go straight to the
    client's connection, each in one write; a `web.StreamResponse` to its user and to aiohttp
    (which finds it prepared, and ended once `write_eof` was called). Where aiohttp must make
    the head (see the module's doc), every call is aiohttp's own.

    `deadline` (event-loop time): a write still waiting for the client to read then is cut
    (ClientStalledError); None waits as long as the client takes."""

    _direct = False  # the head went out here: the chunks follow it
    _request: web.BaseRequest | None = None

    def __init__(
        self,
        *,
        status: int = 200,
        headers: CIMultiDict[str] | None = None,
        deadline: float | None = None,
    ) -> None:
        super().__init__(status=status, headers=headers)
        self._deadline = deadline

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        """Send the head (once; aiohttp's own call after the handler finds it sent)."""
        if self._direct or self._eof_sent:
            return None
        if self._payload_writer is not None:  # aiohttp's own path, under way
            return self._payload_writer
        head = _head(request, self.status, self.headers, "Transfer-Encoding: chunked")
        if head is None:
            if request.version < HttpVersion11 and self.content_length is None:
                # no chunks in HTTP/1.0: the body ends where the connection does. aiohttp
                # frames it so but keeps the connection when the client asked to keep it,
                # leaving that client waiting for an end until the idle timeout
                self.force_close()
            encodable = _encodable(self.headers)
            if encodable is not self.headers:
                self.headers.clear()
                self.headers.extend(encodable)
            return await super().prepare(request)
        transport = _open_transport(request)
        self._direct = True
        self._request = request
        self._keep_alive = request.keep_alive
        self._body_length = 0
        transport.write(head)
        return None

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data` as one chunk (nothing for empty data: an empty chunk ends a body)."""
        request = self._request
        if not self._direct or request is None:
            if self._req is None:  # not prepared: aiohttp's own error
                await super().write(data)
            else:
                await _bounded(self._req, self._deadline, super().write(data))
            return
        if self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        transport = _open_transport(request)
        size = len(data)
        if size < _JOIN_BELOW:
            chunk = data if isinstance(data, bytes) else bytes(data)
            transport.write(b"%x\r\n%b\r\n" % (size, chunk))
        else:
            transport.write(b"%x\r\n" % size)
            transport.write(data)
            transport.write(b"\r\n")
        self._body_length += size
        if request.protocol.writing_paused:  # a slow client: wait for room
            await _bounded(request, self._deadline, request.writer.drain())

    async def write_eof(self, data: bytes = b"") -> None:
        """Send `data` as a last chunk, then the end of the body (once)."""
        request = self._request
        if not self._direct or request is None:
            if self._req is None or self._eof_sent:  # aiohttp's own answer to these
                await super().write_eof(data)
            else:
                await _bounded(self._req, self._deadline, super().write_eof(data))
            return
        if self._eof_sent:
            return
        if data:
            await self.write(data)
        transport = _open_transport(request)
        transport.write(_LAST_CHUNK)
        self._eof_sent = True
        if request.protocol.writing_paused:
            await _bounded(request, self._deadline, request.writer.drain())
