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
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from multidict import CIMultiDict

from router.http.whole_answer import send_whole
from tests.raw_http import exchange, parse_responses, request_bytes

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
async def _server() -> AsyncIterator[int]:
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/aiohttp", _aiohttp)
    app.router.add_post("/whole", _whole)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


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
    answers = []
    async with _server() as port:
        for path in (b"/aiohttp", b"/whole"):
            sent = request_bytes(b"POST", path + query, headers, body, close=close)
            if not close:  # then a second request that closes, so the exchange ends
                sent += request_bytes(b"POST", b"/aiohttp", [], b"", close=True)
            answers.append(parse_responses(await exchange(port, sent))[:1])
    theirs, mine = answers
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

    app = web.Application()
    app.router.add_post("/big", big)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        try:
            writer.write(request_bytes(b"POST", b"/big"))
            await writer.drain()
            await asyncio.sleep(0.3)  # without backpressure the handler would be done by now
            events.append("reading")
            data = await asyncio.wait_for(reader.read(-1), 30)
        finally:
            writer.close()
    finally:
        await runner.cleanup()
    assert events == ["reading", "sent"]
    (answer,) = parse_responses(data)
    assert answer.status == 200
    assert answer.body == body
