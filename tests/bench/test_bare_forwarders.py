"""The proxy benchmark's bare forwarders forward for real, to a backend on 127.0.0.1: the lean
forwarder and the parser lane (`bench.lean_forwarder`) in process (bodies and statuses through,
several requests on one connection, pipelined ones in order, a body that comes after its
headers, a 502 for a worker that is gone, a 400 for bytes that are no HTTP), and each forwarder
role started as the benchmark starts it, a process on kvroute's loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.lean_forwarder import serve_lean, serve_parser_lane
from bench.proxy_bench import _process

# the lean forwarder (httptools) and the parser lane (aiohttp's parser, no request objects) alike
_SERVE = pytest.mark.parametrize("serve", [serve_lean, serve_parser_lane], ids=["lean", "lane"])
_Serve = Callable[[str], AbstractAsyncContextManager[str]]


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        status = 201 if request.path == "/created" else 200
        # a slow answer for the first of a pipelined pair: the second must still come second
        if body == b"slow":
            await asyncio.sleep(0.2)
        return web.Response(body=request.path.encode() + b":" + body, status=status)

    app = web.Application()
    app.router.add_post("/{tail:.*}", echo)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@_SERVE
async def test_bodies_and_statuses_come_through_on_one_connection(
    backend: str, serve: _Serve
) -> None:
    async with (
        serve(backend) as url,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session,
    ):
        answers = []
        for path, body in (("/v1/completions", b"a"), ("/created", b"bb"), ("/x", b"")):
            async with session.post(url + path, data=body) as resp:
                answers.append((resp.status, await resp.read()))
    assert answers == [(200, b"/v1/completions:a"), (201, b"/created:bb"), (200, b"/x:")]


@_SERVE
async def test_pipelined_requests_are_answered_in_order(backend: str, serve: _Serve) -> None:
    async with serve(backend) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        request = "POST /{} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{}"
        writer.write((request.format("one", 4, "slow") + request.format("two", 4, "fast")).encode())
        await writer.drain()
        got = b""
        async with asyncio.timeout(5):
            while got.count(b"HTTP/1.1") < 2 or not got.endswith(b"/two:fast"):
                got += await reader.read(4096)
        writer.close()
        await writer.wait_closed()
    assert got.index(b"/one:slow") < got.index(b"/two:fast")


async def _exchange(url: str, *parts: bytes) -> bytes:
    """Send `parts` on one raw connection, a pause between them; what came back until closed
    or the first whole answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    for n, part in enumerate(parts):
        if n:
            await asyncio.sleep(0.1)
        writer.write(part)
        await writer.drain()
    got = b""
    async with asyncio.timeout(5):
        while not (got.startswith(b"HTTP/1.1 400") or b":" in got.partition(b"\r\n\r\n")[2]):
            data = await reader.read(4096)
            if not data:
                break
            got += data
    writer.close()
    return got


@_SERVE
async def test_a_body_after_its_headers_is_waited_for(backend: str, serve: _Serve) -> None:
    async with serve(backend) as url:
        got = await _exchange(
            url, b"POST /late HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab", b"cd"
        )
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"/late:abcd")


@_SERVE
async def test_bytes_that_are_no_http_get_a_400(backend: str, serve: _Serve) -> None:
    async with serve(backend) as url:
        got = await _exchange(url, b"\x00\x01 not http\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400")


@_SERVE
async def test_a_worker_that_is_gone_is_a_502(unused_tcp_port: int, serve: _Serve) -> None:
    async with (
        serve(f"http://127.0.0.1:{unused_tcp_port}") as url,
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", data=b"{}") as resp,
    ):
        assert resp.status == 502


@pytest.mark.parametrize("role", ["forwarder-app", "forwarder-lowlevel", "parser-lane", "lean"])
async def test_each_forwarder_role_forwards(backend: str, role: str) -> None:
    async with (
        _process(sys.executable, "-m", "bench.proxy_bench", role, backend) as url,
        aiohttp.ClientSession() as session,
    ):
        for n in range(3):  # one kept-alive connection, several requests
            async with session.post(url + "/v1/completions", data=f"{n}".encode()) as resp:
                assert resp.status == 200
                assert await resp.read() == f"/v1/completions:{n}".encode()
