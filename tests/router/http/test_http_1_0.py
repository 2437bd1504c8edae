"""HTTP/1.0 clients against a real router and reference workers, over raw sockets.

HTTP/1.0 has no chunked coding: a streamed answer (no Content-Length) ends where the server
closes the connection, so the router must close it after the body even for a client that asked
to keep it (`Connection: keep-alive`); an answer with a Content-Length can be kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from tests.raw_http import parse_responses, wait_eof
from tests.router.conftest import Fleet

# far below the idle timeout (75 s): a connection still open after this was kept, not closing
CLOSED_WITHIN_S = 5.0
KEEP_ALIVE = b"Connection: keep-alive\r\n"


def _completion(stream: bool, keep_alive: bool) -> bytes:
    body = json.dumps({"model": "m", "prompt": "ten", "max_tokens": 3, "stream": stream})
    return (
        b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        + (KEEP_ALIVE if keep_alive else b"")
        + b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
    )


@contextlib.asynccontextmanager
async def _connect(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def _head(raw: bytes) -> dict[str, str]:
    return parse_responses(raw.partition(b"\r\n\r\n")[0] + b"\r\n\r\n")[0].headers


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("served_by", ["router", "worker"])
async def test_a_streamed_answer_to_http_1_0_ends_with_the_connection(
    fleet: Fleet, keep_alive: bool, served_by: str
) -> None:
    """Before, a keep-alive HTTP/1.0 client waited out the idle timeout for the end of its
    body: no length, no chunks, and the connection kept (aiohttp's own behaviour)."""
    url = fleet.url if served_by == "router" else fleet.workers["w0"].url
    async with _connect(url) as (reader, writer):
        writer.write(_completion(stream=True, keep_alive=keep_alive))
        raw = await wait_eof(reader, CLOSED_WITHIN_S)
    assert raw.startswith(b"HTTP/1.0 200 "), raw[:200]
    headers = _head(raw)
    assert headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in headers and "transfer-encoding" not in headers
    assert headers.get("connection", "close").lower() == "close"  # never "keep-alive"
    assert raw.rstrip().endswith(b"data: [DONE]")  # the whole stream, then the close


async def test_a_whole_answer_to_http_1_0_keeps_the_connection_it_was_asked_to_keep(
    fleet: Fleet,
) -> None:
    async with _connect(fleet.url) as (reader, writer):
        # two on one connection: the first asks to keep it, the second does not
        writer.write(_completion(stream=False, keep_alive=True))
        writer.write(_completion(stream=False, keep_alive=False))
        raw = await wait_eof(reader, CLOSED_WITHIN_S)
    first, second = parse_responses(raw)
    assert (first.status, second.status) == (200, 200)
    assert first.headers["connection"].lower() == "keep-alive"
    assert int(first.headers["content-length"]) == len(first.body)
    assert json.loads(first.body)["choices"] and json.loads(second.body)["choices"]


async def test_a_streamed_answer_to_http_1_1_still_keeps_the_connection(fleet: Fleet) -> None:
    body = json.dumps({"model": "m", "prompt": "ten", "max_tokens": 3, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with _connect(fleet.url) as (reader, writer):
        writer.write(request + request.replace(b"Host: r\r\n", b"Host: r\r\nConnection: close\r\n"))
        raw = await wait_eof(reader, CLOSED_WITHIN_S)
    answers = parse_responses(raw)
    assert [a.status for a in answers] == [200, 200]
    assert answers[0].headers["transfer-encoding"] == "chunked"
    assert all(a.body.rstrip().endswith(b"data: [DONE]") for a in answers)
