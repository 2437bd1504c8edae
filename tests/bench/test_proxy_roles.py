"""The proxy benchmark's bare forwarders, started as the benchmark starts them (a process each,
on kvroute's loop), forward a completion to a real backend and back."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.proxy_bench import _process


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=b'{"echo": ' + await request.read() + b"}", status=200)

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.mark.parametrize("role", ["forwarder-app", "forwarder-lowlevel", "floor"])
async def test_each_bare_forwarder_forwards(backend: str, role: str) -> None:
    async with (
        _process(sys.executable, "-m", "bench.proxy_bench", role, backend) as url,
        aiohttp.ClientSession() as session,
    ):
        for n in range(3):  # one kept-alive connection, several requests
            async with session.post(url + "/v1/completions", data=f"{n}".encode()) as resp:
                assert resp.status == 200
                assert await resp.read() == f'{{"echo": {n}}}'.encode()
