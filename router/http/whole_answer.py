"""A worker's whole (non-streamed) answer, passed to the client in one write.

aiohttp's `web.Response` makes the same bytes through `prepare` and `write_eof`: a second
header dict, its payload writer, a separate write for the head and one for the body. For the
proxy's most common answer, a JSON body of known length to an HTTP/1.1 client, that machinery
was a tenth of the router's CPU per tiny request (`kvroute bench proxy` under py-spy). Here the
head is joined once and goes out with the body in one `transport.write`; the response object
aiohttp gets back is already sent, so its own `prepare` and `write_eof` do nothing.

The answer is byte for byte what aiohttp would send for it (the same Date, Server, Content-Type
default and Connection rules, tests/router/http/test_whole_answer.py compares them); anything
else (HTTP/1.0, a status whose body must be empty, a header with a control character) goes
through `web.Response` as before, which also refuses what would be a header injection.
"""

from __future__ import annotations

import re
import time
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from multidict import CIMultiDict

__all__ = ["SentResponse", "send_whole"]

# what aiohttp refuses in a header name or value (its writer's rule): control characters but TAB
_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# statuses whose answer has no body and whose Content-Length aiohttp's rules rewrite
_EMPTY_BODY = frozenset({204, 304})
_CONTENT_TYPE = "content-type"
_OCTETS = "application/octet-stream"
_JOIN_BELOW = 256 * 1024


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


class SentResponse(web.StreamResponse):
    """A response already written to the client: aiohttp's `prepare` and `write_eof` on it are
    no-ops (it is `eof_sent`), and aiohttp reads its status, keep-alive and length as usual."""

    def __init__(self, status: int, headers: CIMultiDict[str], keep_alive: bool, size: int):
        super().__init__(status=status, headers=headers)
        self._keep_alive = keep_alive
        self._eof_sent = True
        self._body_length = size


async def send_whole(
    request: web.BaseRequest, status: int, headers: CIMultiDict[str], body: bytes
) -> web.StreamResponse:
    """Answer `request` with `status`, `headers` and `body`; the response it was sent as.

    Raises ConnectionResetError when the client is gone (as aiohttp's writer does)."""
    if request.version != HttpVersion11 or status in _EMPTY_BODY or status < 200:
        return await _through_aiohttp(request, status, headers, body)
    items = list(headers.items())
    if _FORBIDDEN.search("".join([k + v for k, v in items])) is not None:
        return await _through_aiohttp(request, status, headers, body)
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client closed the connection")
    keep_alive = request.keep_alive
    lines = [_status_line(status)]
    lines.extend([k + ": " + v for k, v in items])
    lines.append(f"Content-Length: {len(body)}")
    if body and _CONTENT_TYPE not in headers:
        lines.append("Content-Type: " + _OCTETS)
    if "date" not in headers:
        lines.append("Date: " + _CLOCK.date())
    if "server" not in headers:
        lines.append("Server: " + SERVER_SOFTWARE)
    if not keep_alive and "connection" not in headers:
        lines.append("Connection: close")
    lines.append("\r\n")
    head = "\r\n".join(lines).encode()
    if len(body) < _JOIN_BELOW:
        transport.write(head + body)  # one send: a copy of a small body costs less than a call
    else:
        transport.write(head)
        transport.write(body)
    # a large answer to a slow client: wait for room, as aiohttp's writer does
    await request.writer.drain()
    return SentResponse(status, headers, keep_alive, len(body))


async def _through_aiohttp(
    request: web.BaseRequest, status: int, headers: CIMultiDict[str], body: bytes
) -> web.StreamResponse:
    response = web.Response(status=status, body=body, headers=headers)
    await response.prepare(request)
    await response.write_eof()
    return response
