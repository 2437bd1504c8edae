"""Raw HTTP/1.1 over asyncio streams, for the bytes an HTTP client refuses to send.

aiohttp's client (rightly) will not put a control character or a non-UTF-8 byte in a header, a
space in a path, or a Content-Length it does not mean; hostile clients do all of that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

__all__ = [
    "RawResponse",
    "exchange",
    "json_error",
    "parse_responses",
    "read_to_close",
    "request_bytes",
    "stalled_client",
    "wait_eof",
]


class RawResponse(NamedTuple):
    """One parsed response: status, lower-cased headers (last one wins), body."""

    status: int
    headers: dict[str, str]
    body: bytes


def request_bytes(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]] = [],  # noqa: B006 - never mutated
    body: bytes = b"",
    *,
    close: bool = True,
) -> bytes:
    """A request as bytes; Host and Content-Length are added, `Connection: close` unless told."""
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1"]
    if close:
        lines.append(b"Connection: close")
    lines += [name + b": " + value for name, value in headers]
    if body or method == b"POST":
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until EOF; a reset (the server closed with our bytes unread) ends it too."""
    chunks: list[bytes] = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def exchange(port: int, data: bytes, *, timeout_s: float = 10.0) -> bytes:
    """Connect, send `data`, and return all the server sent until it closed the connection."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            with contextlib.suppress(ConnectionResetError):
                await writer.drain()
            return await _read_all(reader)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def wait_eof(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """What the server sends until it closes, failing if it is still open after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_all(reader)
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open for {timeout_s} s") from None


@contextlib.asynccontextmanager
async def stalled_client(port: int, data: bytes) -> AsyncIterator[socket.socket]:
    """A client that sends `data`, then reads nothing: a 4 KiB receive buffer (set before it
    connects, so the window it offers stays small), which fills at once."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, data)
        yield sock
    finally:
        sock.close()


async def read_to_close(sock: socket.socket, timeout_s: float) -> bytes:
    """What `sock` receives until the server closes (or resets) it, failing if it is still open
    after `timeout_s`."""
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            with contextlib.suppress(ConnectionResetError):
                while chunk := await loop.sock_recv(sock, 1 << 20):
                    chunks.append(chunk)
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open for {timeout_s} s") from None
    return b"".join(chunks)


def _chunked(data: bytes) -> tuple[bytes, bytes]:
    """(body, what follows the message) of a chunked message body."""
    body = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:  # then trailers (none from our servers) and a blank line
            return body, data.partition(b"\r\n")[2] if data.startswith(b"\r\n") else b""
        body, data = body + data[:size], data[size + 2 :]


def parse_responses(data: bytes) -> list[RawResponse]:
    """Every complete response in `data` (pipelined answers come one after another)."""
    out: list[RawResponse] = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            raise AssertionError(f"truncated response head: {data[:200]!r}")
        status_line, *header_lines = head.split(b"\r\n")
        status = int(status_line.split(b" ")[1])
        headers: dict[str, str] = {}
        for line in header_lines:
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200 or status in (204, 304):
            body = b""  # no body, whatever the headers say
            data = rest
        elif "content-length" in headers:
            length = int(headers["content-length"])
            body, data = rest[:length], rest[length:]
        elif "chunked" in headers.get("transfer-encoding", ""):
            body, data = _chunked(rest)
        else:
            body, data = rest, b""
        out.append(RawResponse(status, headers, body))
    return out


def json_error(response: RawResponse) -> dict[str, Any]:
    """The `{"type", "message"}` of a JSON error answer (AssertionError if it is not one)."""
    assert response.headers.get("content-type", "").startswith("application/json"), response
    error = json.loads(response.body)["error"]
    assert isinstance(error["type"], str) and isinstance(error["message"], str), error
    return error  # type: ignore[no-any-return]
