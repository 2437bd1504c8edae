"""`send_whole` against aiohttp's own `web.Response`, over real sockets: the same answer.

One aiohttp server answers each request twice over, by path: `/aiohttp` through `web.Response`
(what the proxy did before), `/whole` through `send_whole`. Raw requests read both answers'
bytes, so the status line, every header but Date, the body and what happens to the connection
are compared as a client sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from multidict import CIMultiDict

from router.http.direct_answer import ChunkedResponse, ClientStalledError, send_whole
from tests.raw_http import (
    exchange,
    parse_responses,
    read_to_close,
    request_bytes,
    stalled_client,
    wait_eof,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# a Date header line in raw bytes (two answers a second apart differ in it)
_DATE_LINE = re.compile(rb"(?im)^date: [^\r\n]*\r\n")
_DATE = re.compile(r"^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$")


def _headers(request: web.Request) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in request.query.items():
        out.add(name, value)
    return out


async def _aiohttp(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    status = int(request.headers.get("x-status", "200"))
    return web.Response(status=status, body=body, headers=_headers(request))


async def _whole(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    status = int(request.headers.get("x-status", "200"))
    return await send_whole(request, status, _headers(request), body)


@contextlib.asynccontextmanager
async def _serve(routes: dict[str, Handler]) -> AsyncIterator[int]:
    """An aiohttp server on 127.0.0.1 answering POSTs to `routes`; yields its port."""
    app = web.Application(client_max_size=16 * 1024 * 1024)
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def _server() -> contextlib.AbstractAsyncContextManager[int]:
    return _serve({"/aiohttp": _aiohttp, "/whole": _whole})


async def _both_ways(
    port: int,
    paths: tuple[bytes, bytes],
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    close: bool,
) -> list[bytes]:
    """What the server sent for the same request to each of `paths`, each on its own
    connection; without `close`, a second request that closes follows, so the exchange ends."""
    raw = []
    for path in paths:
        sent = request_bytes(b"POST", path + query, headers, body, close=close)
        if not close:
            sent += request_bytes(b"POST", b"/aiohttp", [], b"", close=True)
        raw.append(await exchange(port, sent))
    return raw


async def _read_slowly(port: int, path: bytes, events: list[str]) -> bytes:
    """Ask for `path`, wait before reading (noted in `events`), then read it all."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes(b"POST", path))
        await writer.drain()
        await asyncio.sleep(0.3)  # without backpressure the handler would be done by now
        events.append("reading")
        return await asyncio.wait_for(reader.read(-1), 30)
    finally:
        writer.close()


CASES = [
    # (query: the answer's headers, request headers, body)
    (b"?Content-Type=application/json&x-kvroute-worker=w0", [], b'{"text": "hi"}'),
    (b"", [], b"no content type: aiohttp's default is added"),
    (b"?Content-Type=text/plain", [], b""),
    (b"?x-a=1&x-a=2", [(b"x-status", b"503")], b'{"error": 1}'),
    (b"?Content-Type=application/json", [(b"x-status", b"299")], b"{}"),  # no reason phrase
    (b"?Content-Type=application/json", [(b"x-status", b"204")], b""),
]


@pytest.mark.parametrize(("query", "headers", "body"), CASES)
@pytest.mark.parametrize("close", [True, False])
async def test_an_answer_is_what_aiohttp_would_send(
    query: bytes, headers: list[tuple[bytes, bytes]], body: bytes, close: bool
) -> None:
    async with _server() as port:
        raw = await _both_ways(port, (b"/aiohttp", b"/whole"), query, headers, body, close)
    theirs, mine = (parse_responses(data)[:1] for data in raw)
    assert len(theirs) == len(mine) == 1
    (t,), (m,) = theirs, mine
    assert _DATE.match(m.headers["date"]), m.headers["date"]
    assert (m.status, m.body) == (t.status, t.body)
    del t.headers["date"], m.headers["date"]
    assert m.headers == t.headers
    assert m.body == (body if t.status != 204 else b"")


async def test_keep_alive_serves_pipelined_requests_and_connection_close_ends_it() -> None:
    body = b'{"n": 1}'
    keep = request_bytes(b"POST", b"/whole?Content-Type=application/json", [], body, close=False)
    last = request_bytes(b"POST", b"/whole?Content-Type=application/json", [], body, close=True)
    async with _server() as port:
        # the server closes after the third answer: had it closed earlier, fewer come back
        answers = parse_responses(await exchange(port, keep + keep + last))
    assert [a.status for a in answers] == [200, 200, 200]
    assert [a.body for a in answers] == [body] * 3
    assert "connection" not in answers[0].headers
    assert answers[2].headers["connection"] == "close"


async def test_an_http_1_0_request_is_answered_as_aiohttp_does() -> None:
    request = b"POST /whole?x-k=v HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi"
    reference = b"POST /aiohttp?x-k=v HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi"
    async with _server() as port:
        (m,) = parse_responses(await exchange(port, request))
        (t,) = parse_responses(await exchange(port, reference))
    del t.headers["date"], m.headers["date"]
    assert (m.status, m.headers, m.body) == (t.status, t.headers, t.body)
    assert m.body == b"hi"


async def test_a_header_with_a_control_character_is_refused_not_sent() -> None:
    # %0d%0a decodes to CR LF: a header injection, which aiohttp's writer refuses (a 500)
    request = request_bytes(b"POST", b"/whole?x-evil=a%0d%0aSet-Cookie:%20x=1", [], b"{}")
    async with _server() as port:
        (answer,) = parse_responses(await exchange(port, request))
    assert answer.status == 500
    assert "set-cookie" not in answer.headers


async def test_a_large_answer_waits_for_a_slow_reader_and_reaches_it_whole() -> None:
    body = bytes(range(256)) * (256 * 1024)  # 64 MiB: far more than loopback buffers hold
    events: list[str] = []

    async def big(request: web.Request) -> web.StreamResponse:
        response = await send_whole(request, 200, CIMultiDict(), body)
        events.append("sent")  # only once the client read enough for the rest to fit
        return response

    async with _serve({"/big": big}) as port:
        data = await _read_slowly(port, b"/big", events)
    assert events == ["reading", "sent"]
    (answer,) = parse_responses(data)
    assert answer.status == 200
    assert answer.body == body


# ------------------------------------------------------------------ streamed (chunked) answers


def _chunks(request: web.Request) -> tuple[list[bytes], bytes]:
    count = int(request.headers.get("x-chunks", "3"))
    chunks = [f"data: {{'n': {i}}}\n\n".encode() * (i + 1) for i in range(count)]
    chunks.insert(1, b"")  # an empty write sends nothing (an empty chunk would end the body)
    return chunks, request.headers.get("x-tail", "").encode()


async def _stream_with(response: web.StreamResponse, request: web.Request) -> web.StreamResponse:
    await request.read()
    chunks, tail = _chunks(request)
    await response.prepare(request)
    for chunk in chunks:
        await response.write(chunk)
    await response.write_eof(tail)
    return response


async def _aiohttp_stream(request: web.Request) -> web.StreamResponse:
    status = int(request.headers.get("x-status", "200"))
    return await _stream_with(web.StreamResponse(status=status, headers=_headers(request)), request)


async def _direct_stream(request: web.Request) -> web.StreamResponse:
    status = int(request.headers.get("x-status", "200"))
    return await _stream_with(ChunkedResponse(status=status, headers=_headers(request)), request)


def _stream_server(*extra: tuple[str, Handler]) -> contextlib.AbstractAsyncContextManager[int]:
    return _serve({"/aiohttp": _aiohttp_stream, "/direct": _direct_stream, **dict(extra)})


STREAM_CASES = [
    (b"?Content-Type=text/event-stream&x-kvroute-worker=w0", [], b""),
    (b"", [(b"x-tail", b"data: [DONE]")], b"no content type"),
    (b"?x-a=1&x-a=2", [(b"x-status", b"502"), (b"x-chunks", b"1")], b""),
    (b"?Content-Type=text/event-stream", [(b"x-chunks", b"0")], b""),
]


@pytest.mark.parametrize(("query", "headers", "body"), STREAM_CASES)
@pytest.mark.parametrize("close", [True, False])
async def test_a_streamed_answer_is_what_aiohttp_would_send(
    query: bytes, headers: list[tuple[bytes, bytes]], body: bytes, close: bool
) -> None:
    async with _stream_server() as port:
        raw = await _both_ways(port, (b"/aiohttp", b"/direct"), query, headers, body, close)
    (t, *_), (m, *_) = (parse_responses(data) for data in raw)
    assert _DATE.match(m.headers["date"]), m.headers["date"]
    del t.headers["date"], m.headers["date"]
    assert (m.status, m.headers, m.body) == (t.status, t.headers, t.body)
    # the framing too: each write one chunk, byte for byte as aiohttp frames it (what follows
    # may hold another answer's head, whose Date may fall in another second: left out)
    after = [_DATE_LINE.sub(b"", r.partition(b"\r\n\r\n")[2]) for r in raw]
    assert after[1] == after[0]
    if t.status == 200:
        assert m.headers["transfer-encoding"] == "chunked"


async def test_streamed_answers_keep_the_connection_for_the_next_request() -> None:
    keep = request_bytes(b"POST", b"/direct", [(b"x-tail", b"end")], b"", close=False)
    last = request_bytes(b"POST", b"/direct", [(b"x-tail", b"end")], b"", close=True)
    async with _stream_server() as port:
        answers = parse_responses(await exchange(port, keep + keep + last))
    assert [a.status for a in answers] == [200, 200, 200]
    assert len({a.body for a in answers}) == 1 and answers[0].body.endswith(b"end")
    assert "connection" not in answers[0].headers
    assert answers[2].headers["connection"] == "close"


async def test_a_streamed_answer_to_http_1_0_is_answered_as_aiohttp_does() -> None:
    query = b"?x-k=v HTTP/1.0\r\nContent-Length: 0\r\n\r\n"
    async with _stream_server() as port:
        mine = parse_responses(await exchange(port, b"POST /direct" + query))
        theirs = parse_responses(await exchange(port, b"POST /aiohttp" + query))
    (m,), (t,) = mine, theirs
    del t.headers["date"], m.headers["date"]
    assert (m.status, m.headers, m.body) == (t.status, t.headers, t.body)
    assert "transfer-encoding" not in m.headers  # HTTP/1.0 has no chunks: the body ends at close


async def test_a_streamed_answer_to_http_1_0_closes_even_when_asked_to_keep_alive() -> None:
    """Here it differs from aiohttp, which keeps the connection: its client waited for the
    idle timeout to see the body end. The head stays aiohttp's (no `Connection: keep-alive`)."""
    request = b"POST /direct HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n"
    async with _stream_server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            (answer,) = parse_responses(await wait_eof(reader, 5.0))
        finally:
            writer.close()
    assert answer.status == 200 and "connection" not in answer.headers
    assert answer.body == b"".join(f"data: {{'n': {i}}}\n\n".encode() * (i + 1) for i in range(3))


async def test_a_streamed_header_with_a_control_character_is_never_sent() -> None:
    # %0d%0a decodes to CR LF: aiohttp refuses the head (and its error answer is its own)
    request = request_bytes(b"POST", b"/direct?x-evil=a%0d%0aSet-Cookie:%20x=1", [], b"")
    async with _stream_server() as port:
        raw = await exchange(port, request)
    assert not raw.startswith(b"HTTP/1.1 200")
    assert b"Set-Cookie" not in raw


async def test_writing_after_the_end_is_refused_as_aiohttp_refuses_it() -> None:
    refused: list[str] = []

    async def twice(request: web.Request) -> web.StreamResponse:
        response = ChunkedResponse()
        await response.prepare(request)
        await response.write_eof(b"one")
        try:
            await response.write(b"two")
        except RuntimeError as exc:
            refused.append(str(exc))
        return response

    async with _stream_server(("/twice", twice)) as port:
        (answer,) = parse_responses(await exchange(port, request_bytes(b"POST", b"/twice")))
    assert answer.body == b"one"
    assert refused == ["Cannot call write() after write_eof()"]


async def test_a_client_gone_mid_stream_is_a_connection_reset_for_the_writer() -> None:
    seen: list[str] = []
    ended = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = ChunkedResponse()
        await response.prepare(request)
        try:
            for _ in range(10_000):  # bounded: 10 s at most
                await response.write(b"data: tick\n\n")
                await asyncio.sleep(0.001)
            seen.append("never noticed")
        except ConnectionResetError:
            seen.append("reset")
        ended.set()
        return response

    async with _stream_server(("/endless", endless)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes(b"POST", b"/endless", close=False))
        await reader.readuntil(b"data: tick")  # the stream is under way
        writer.close()
        await writer.wait_closed()
        async with asyncio.timeout(10):
            await ended.wait()
    assert seen == ["reset"]


async def test_a_large_streamed_chunk_waits_for_a_slow_reader_and_arrives_whole() -> None:
    chunk = bytes(range(256)) * (64 * 1024)  # 16 MiB a chunk, four of them
    events: list[str] = []

    async def big(request: web.Request) -> web.StreamResponse:
        response = ChunkedResponse()
        await response.prepare(request)
        for _ in range(4):
            await response.write(chunk)
        events.append("sent")  # only once the client read enough for the rest to fit
        await response.write_eof()
        return response

    async with _serve({"/big": big}) as port:
        data = await _read_slowly(port, b"/big", events)
    assert events == ["reading", "sent"]
    (answer,) = parse_responses(data)
    assert answer.body == chunk * 4


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])  # written here, and by aiohttp
@pytest.mark.parametrize("path", [b"/whole", b"/stream"])
async def test_a_client_that_stops_reading_is_cut_at_the_deadline(
    path: bytes, version: bytes
) -> None:
    body = bytes(range(256)) * (64 * 1024)  # 16 MiB: far more than loopback buffers hold
    seen: list[str] = []
    cut = asyncio.Event()

    async def whole(request: web.Request) -> web.StreamResponse:
        deadline = asyncio.get_running_loop().time() + 0.5
        try:
            return await send_whole(request, 200, CIMultiDict(), body, deadline=deadline)
        except ClientStalledError:
            seen.append("cut")
            cut.set()
            raise

    async def stream(request: web.Request) -> web.StreamResponse:
        deadline = asyncio.get_running_loop().time() + 0.5
        response = ChunkedResponse(deadline=deadline)
        await response.prepare(request)
        try:
            for _ in range(16):
                await response.write(body[: 1 << 20])
            await response.write_eof()
        except ClientStalledError:
            seen.append("cut")
            cut.set()
        return response

    async with _serve({"/whole": whole, "/stream": stream}) as port:
        request = request_bytes(b"POST", path).replace(b"HTTP/1.1", b"HTTP/" + version)
        async with stalled_client(port, request) as client:
            await asyncio.wait_for(cut.wait(), 10)
            received = await read_to_close(client, 5)  # aborted: nothing more to come
    assert seen == ["cut"]
    assert 0 < len(received) < len(body)
