"""`kvroute bench proxy` measures one target at a time: latency alternating with direct,
throughput in interleaved rounds."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.proxy_bench import _interleaved_throughput, _latencies


@contextlib.asynccontextmanager
async def _servers(names: Sequence[str], served: list[str]) -> AsyncIterator[dict[str, str]]:
    """One real HTTP server per name; each answered completion appends its name to `served`."""

    def app(name: str) -> web.Application:
        async def answer(request: web.Request) -> web.Response:
            await request.read()
            served.append(name)
            return web.json_response({})

        application = web.Application()
        application.router.add_post("/v1/completions", answer)
        return application

    servers = {name: TestServer(app(name), host="127.0.0.1") for name in names}
    for server in servers.values():
        await server.start_server()
    try:
        yield {name: str(server.make_url("")).rstrip("/") for name, server in servers.items()}
    finally:
        for server in servers.values():
            await server.close()


async def test_each_target_alternates_with_direct_and_is_held_against_its_own_pass() -> None:
    order: list[str] = []
    async with _servers(("direct", "a", "b"), order) as urls, aiohttp.ClientSession() as session:
        samples, paired = await _latencies(session, urls, 5, 30.0)
    measured = order[150:]  # after 50 warm-up requests per target
    assert measured == ["direct", "a"] * 5 + ["direct", "b"] * 5
    assert {name: len(values) for name, values in samples.items()} == {"direct": 10, "a": 5, "b": 5}
    assert {name: len(values) for name, values in paired.items()} == {"a": 5, "b": 5}
    assert sorted(samples["direct"]) == sorted(paired["a"] + paired["b"])


async def test_each_throughput_round_measures_every_target_once_in_turn() -> None:
    served: list[str] = []
    names = ("kvroute, observe off", "kvroute")
    async with _servers(names, served) as urls:
        args = argparse.Namespace(throughput_requests=0, concurrency=2, deadline_s=30.0)
        rates, errors, _, by_round = await _interleaved_throughput(args, urls, 4, per_round=6)
    assert {name: len(r) for name, r in by_round.items()} == dict.fromkeys(names, 4)
    # no process of theirs is known: no CPU figure, and the rates come from real requests
    assert all(r.rate > 0 and r.cpu_us is None for rs in by_round.values() for r in rs)
    assert errors == dict.fromkeys(names, 0)
    assert set(rates) == set(urls)
    # after the warm-up (concurrency x 10 each), each round serves 6 of one, then 6 of the
    # other, every other round in reverse order (no target always follows the same one)
    forward, backward = [names[0]] * 6 + [names[1]] * 6, [names[1]] * 6 + [names[0]] * 6
    assert served[40:] == (forward + backward) * 2
