"""`kvroute bench proxy` measures latency one target at a time, alternating with direct."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.proxy_bench import _latencies


async def test_each_target_alternates_with_direct_and_is_held_against_its_own_pass() -> None:
    order: list[str] = []

    def app(name: str) -> web.Application:
        async def answer(request: web.Request) -> web.Response:
            await request.read()
            order.append(name)
            return web.json_response({})

        application = web.Application()
        application.router.add_post("/v1/completions", answer)
        return application

    servers = {name: TestServer(app(name), host="127.0.0.1") for name in ("direct", "a", "b")}
    for server in servers.values():
        await server.start_server()
    try:
        urls = {name: str(server.make_url("")).rstrip("/") for name, server in servers.items()}
        async with aiohttp.ClientSession() as session:
            samples, paired = await _latencies(session, urls, 5, 30.0)
    finally:
        for server in servers.values():
            await server.close()
    measured = order[150:]  # after 50 warm-up requests per target
    assert measured == ["direct", "a"] * 5 + ["direct", "b"] * 5
    assert {name: len(values) for name, values in samples.items()} == {"direct": 10, "a": 5, "b": 5}
    assert {name: len(values) for name, values in paired.items()} == {"a": 5, "b": 5}
    assert sorted(samples["direct"]) == sorted(paired["a"] + paired["b"])
