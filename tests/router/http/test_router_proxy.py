"""The proxy against real in-test HTTP upstreams: streaming, disconnects, retries, limits."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from router.config import (
    BreakerConfig,
    HealthConfig,
    LimitsConfig,
    PolicyConfig,
    TimeoutsConfig,
)
from router.http.keys import DECISIONS
from router.http.listener import DIRECT_ROUTES
from router.prompt.request import Endpoint
from router.routing.breaker import BreakerState
from router.service import RouterService
from tests.raw_http import (
    exchange,
    parse_responses,
    read_to_close,
    request_bytes,
    stalled_client,
)
from tests.router.conftest import AUTH, eventually, router_config, serve_app

BIG_ANSWER = b'{"text": "' + b"y" * (16 << 20) + b'"}'


class Upstream:
    """A tiny worker stand-in whose behaviour each test sets; it records what it saw."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.bodies: list[dict[str, Any]] = []
        self.cookies: list[str | None] = []  # the Cookie header of each completion request
        self.expects: list[str | None] = []  # the Expect header of each completion request
        self.headers: list[dict[str, str]] = []  # every header of each completion request
        self.release = asyncio.Event()
        self.health_open = asyncio.Event()  # cleared: /health hangs until set again
        self.health_open.set()
        self.health_probed = asyncio.Event()
        self.health_checks = 0
        self.disconnected = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.cookies.append(request.headers.get("Cookie"))
        self.expects.append(request.headers.get("Expect"))
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.mode == "fail":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "sse-fail":  # a streamed 5xx (SGLang streams its errors as SSE too)
            resp = web.StreamResponse(status=500, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"error": "boom"}\n\n')
            await resp.write_eof()
            return resp
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()  # the worker process "dies" mid-request
            await asyncio.sleep(1)
        if self.mode == "slow":
            await asyncio.sleep(5)
        if self.mode == "slow-body":  # the head at once, then the body stalls
            resp = web.StreamResponse(
                headers={"Content-Type": "application/json", "Content-Length": "20"}
            )
            await resp.prepare(request)
            await resp.write(b'{"a": "')
            await asyncio.sleep(5)
            await resp.write(b'0123456789"}')
            return resp
        if self.mode == "sse":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                await resp.write(b'data: {"n": 1}\n\n')
                await self.release.wait()
                for n in range(2, 200):
                    await resp.write(f'data: {{"n": {n}}}\n\n'.encode())
                    await asyncio.sleep(0.01)
                    if self.mode == "sse" and n == 3:
                        break
                await resp.write(b"data: [DONE]\n\n")
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise
            await resp.write_eof()
            return resp
        if self.mode == "sse-endless":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for n in range(100_000):  # bounded: ~17 minutes at most, the test ends it
                    await resp.write(f'data: {{"n": {n}}}\n\n'.encode())
                    await asyncio.sleep(0.01)
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise
            return resp
        if self.mode == "sse-big":  # 20 MB of events, as fast as the router takes them
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for _ in range(2000):
                    await resp.write(b"data: " + b"y" * 10_000 + b"\n\n")
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise
            await resp.write_eof()
            return resp
        if self.mode in ("hop-named", "hop-named-sse"):  # headers for its hop only, named
            named = {"Connection": "keep-alive, X-Private", "X-Private": "secret", "X-Public": "ok"}
            if self.mode == "hop-named":
                return web.json_response({"worker": self.name}, headers=named)
            resp = web.StreamResponse(headers={**named, "Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if self.mode == "big":  # a whole answer far beyond what loopback buffers hold
            return web.Response(body=BIG_ANSWER, content_type="application/json")
        answer = web.json_response({"worker": self.name, "echo": body})
        if self.mode == "cookie":
            answer.set_cookie("session", f"for-request-{len(self.bodies)}")
        return answer

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        self.health_probed.set()
        await self.health_open.wait()
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def __aenter__(self) -> Upstream:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner, self.url = await serve_app(app, handler_cancellation=True)
        return self

    async def stop(self) -> None:
        """Stop serving (idempotent): the port then refuses connections."""
        self.release.set()
        self.health_open.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _plain(workers: list[tuple[str, str]], **overrides: Any) -> Any:
    config = router_config(workers, **overrides)
    plain = tuple(msgspec.structs.replace(w, kv_events=False) for w in config.workers)
    return msgspec.structs.replace(config, workers=plain)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Upstream, Upstream]]:
    async with Upstream("a") as a, Upstream("b") as b:
        yield a, b


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_streams_pass_through_chunk_by_chunk(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    a.mode = "sse"
    async with (
        RouterService(_plain([("a", a.url)])) as router,
        session.post(router.url + "/v1/completions", json={"prompt": "x", "stream": True}) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-kvroute-worker"] == "a"
        # the first event arrives while the upstream still holds the rest back
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert first == b'data: {"n": 1}\n\n'
        a.release.set()
        rest = await resp.content.read()
    assert rest.endswith(b"data: [DONE]\n\n") and b'"n": 3' in rest


async def test_client_disconnect_cancels_the_upstream_request(
    pair: tuple[Upstream, Upstream],
) -> None:
    a, _ = pair
    a.mode = "sse-endless"
    async with RouterService(_plain([("a", a.url)])) as router:
        async with aiohttp.ClientSession() as client:
            resp = await client.post(
                router.url + "/v1/completions", json={"prompt": "x", "stream": True}
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()  # drop the connection mid-stream
        await asyncio.wait_for(a.disconnected.wait(), 5)
        # the router's load bookkeeping for that request is released too
        await eventually(lambda: _running(router, "a", 0), what="in-flight count back to 0")


async def _running(router: RouterService, worker: str, n: int) -> bool:
    return router.planner.load.of(worker).running == n


async def test_a_5xx_is_retried_on_the_next_worker(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, b = pair
    a.mode = "fail"
    config = _plain([("a", a.url), ("b", b.url)])
    async with RouterService(config) as router:
        for _ in range(60):  # ties are broken at random: go on until a was tried 3 times
            async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-worker"] == "b"
                assert (await resp.json())["worker"] == "b"
            if len(a.bodies) == 3:
                break
        # three consecutive failures opened a's circuit: it left rotation
        assert len(a.bodies) == 3
        for _ in range(5):
            async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.headers["x-kvroute-worker"] == "b"
        assert len(a.bodies) == 3
        async with session.get(router.url + "/admin/workers", headers=AUTH) as resp:
            rows = {w["id"]: w for w in (await resp.json())["workers"]}
        assert rows["a"]["status"] == "circuit_open" and rows["b"]["status"] == "ready"


async def test_a_cookie_a_worker_sets_is_never_sent_on_another_request(
    session: aiohttp.ClientSession,
) -> None:
    """The upstream session keeps no cookies: a worker's Set-Cookie reaches that client only,
    never a later request (of any client) through the router's shared session."""
    async with Upstream("a") as a:
        a.mode = "cookie"
        by_name = a.url.replace("127.0.0.1", "localhost")  # a cookie jar ignores IP hosts
        async with RouterService(_plain([("a", by_name)])) as router:
            for _ in range(2):
                async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 200 and "session=" in r.headers["Set-Cookie"]
        assert a.cookies == [None, None]


async def test_a_client_expect_100_continue_is_answered_by_the_router_not_forwarded(
    session: aiohttp.ClientSession,
) -> None:
    async with Upstream("a") as a, RouterService(_plain([("a", a.url)])) as router:
        async with session.post(
            router.url + "/v1/completions",
            json={"prompt": "x"},
            headers={"Expect": "100-continue"},
        ) as r:
            assert r.status == 200
        assert a.expects == [None]  # the worker got the body with the headers, and no Expect


async def test_a_refused_connection_is_retried_and_opens_the_circuit(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, b = pair
    # health rounds far apart: the first check passes, so only the refused request can tell
    config = _plain(
        [("a", a.url), ("b", b.url)],
        policy=PolicyConfig(name="round_robin"),
        health=HealthConfig(interval_s=60.0, timeout_s=0.5),
    )
    async with RouterService(config) as router:
        entry = router.planner.pool.get("a")
        assert entry.healthy
        await a.stop()  # the worker process is gone: its port refuses connections
        for _ in range(2):  # round robin: one of the two requests goes to a first
            async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 200 and resp.headers["x-kvroute-worker"] == "b"
        assert entry.healthy  # not the health check: the refused attempt opened the circuit
        assert entry.breaker.state(router.planner.clock()) is BreakerState.OPEN
        assert len(b.bodies) == 2


async def test_every_worker_failing_is_a_502_and_none_routable_a_503(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, b = pair
    a.mode = b.mode = "drop"
    async with RouterService(_plain([("a", a.url), ("b", b.url)])) as router:
        async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 502
            error = (await resp.json())["error"]
            assert error["type"] == "UpstreamError"
            assert "a:" in error["message"] and "b:" in error["message"]
        # dropped on every worker: the request's failure, no circuit opened
        # (tests/router/http/test_router_blame.py); gone workers refuse, and that opens both
        await a.stop()
        await b.stop()
        async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 502
        async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "NoWorkerError"
        async with session.get(router.url + "/health") as resp:
            assert resp.status == 503


async def test_the_request_timeout_is_a_504(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    a.mode = "slow"
    config = _plain([("a", a.url)], timeouts=TimeoutsConfig(request_s=0.3))
    async with (
        RouterService(config) as router,
        session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp,
    ):
        assert resp.status == 504
        error = (await resp.json())["error"]
        assert error["type"] == "UpstreamTimeoutError"
        assert "did not answer within the request timeout (timeouts.request_s)" in error["message"]


async def test_a_body_that_stalls_after_the_head_is_a_504_saying_so(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    """The worker answered: "did not answer" sent the operator looking at the wrong thing."""
    a, _ = pair
    a.mode = "slow-body"
    config = _plain([("a", a.url)], timeouts=TimeoutsConfig(request_s=0.5))
    async with (
        RouterService(config) as router,
        session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp,
    ):
        assert resp.status == 504
        error = (await resp.json())["error"]
    assert error["type"] == "UpstreamTimeoutError"
    assert error["message"] == (
        "worker a sent the head of its answer but not its body within the request timeout "
        "(timeouts.request_s)"
    )


async def test_bad_requests_are_json_4xx_naming_the_problem(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    config = _plain([("a", a.url)], limits=LimitsConfig(max_body_bytes=4096))
    async with RouterService(config) as router:
        url = router.url + "/v1/completions"
        async with session.post(url, json={"prompt": "x" * 5000}) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["type"] == "PayloadTooLargeError"
        async with session.post(url, json={"prompt": "x", "cache_salt": 7}) as resp:
            assert resp.status == 400
            assert "cache_salt" in (await resp.json())["error"]["message"]
        async with session.post(url, data=b"{not json") as resp:
            assert resp.status == 400
        async with session.get(router.url + "/nope") as resp:
            assert resp.status == 404 and "error" in await resp.json()
    assert a.bodies == []


async def test_a_trusted_header_sets_the_salt_the_worker_sees(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    config = _plain([("a", a.url)], salt_header="x-tenant-salt")
    async with RouterService(config) as router:
        body = {"prompt": "x", "cache_salt": "from-body"}
        async with session.post(
            router.url + "/v1/completions", json=body, headers={"x-tenant-salt": "from-gateway"}
        ) as resp:
            assert resp.status == 200
        async with session.post(router.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
    assert [b["cache_salt"] for b in a.bodies] == ["from-gateway", "from-body"]


async def test_sglangs_routing_overrides_of_a_client_never_reach_the_worker(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    """With SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES the engine takes these over the body: a
    client's would move the request off the rank (or pair) the router booked it on."""
    a, _ = pair
    overrides = {
        "x-override-routed-dp-rank": "1",
        "x-override-disagg-prefill-dp-rank": "1",
        "x-override-bootstrap-host": "10.0.0.9",
        "x-override-bootstrap-port": "9000",
        "x-override-bootstrap-room": "7",
    }
    async with (
        RouterService(_plain([("a", a.url)])) as router,
        session.post(
            router.url + "/v1/completions",
            json={"prompt": "x"},
            headers={**overrides, "x-override-priority": "3"},
        ) as resp,
    ):
        assert resp.status == 200
    (seen,) = a.headers
    assert not set(overrides) & set(seen)
    assert seen["x-override-priority"] == "3"  # not the router's to decide: passed on


async def test_a_compressed_request_body_reaches_the_worker_decoded(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    async with RouterService(_plain([("a", a.url)])) as router:
        body = gzip.compress(b'{"prompt": "x", "cache_salt": "t"}')
        async with session.post(
            router.url + "/v1/completions", data=body, headers={"Content-Encoding": "gzip"}
        ) as resp:
            assert resp.status == 200, await resp.text()
    assert a.bodies == [{"prompt": "x", "cache_salt": "t"}]


async def test_a_gzip_body_cut_short_or_broken_is_a_400_naming_gzip_never_forwarded(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    """aiohttp's parser checked that a deflate stream ended, not a gzip one (QA): a body
    without its CRC32 and length trailer, or cut in its deflate data, was forwarded as whole,
    and one with a broken header read as empty ("request body is empty")."""
    a, _ = pair
    whole = gzip.compress(b'{"prompt": "x", "cache_salt": "t"}')
    bad_crc = bytearray(whole)
    bad_crc[-8] ^= 0xFF
    broken = {
        "no trailer": whole[:-8],
        "no length": whole[:-4],
        "cut in the deflate data": whole[:20],
        "header only": whole[:10],
        "a broken header": b"\x1f\x8b\x08\x00garbage",
        "a bad CRC32": bytes(bad_crc),
        "bytes after the member": whole + b"GARBAGE",
    }
    async with RouterService(_plain([("a", a.url)])) as router:
        for what, body in broken.items():
            async with session.post(
                router.url + "/v1/completions", data=body, headers={"Content-Encoding": "gzip"}
            ) as resp:
                assert resp.status == 400, (what, await resp.text())
                error = (await resp.json())["error"]
            assert error["type"] == "BadHttpRequestError", (what, error)
            assert "(ContentEncodingError)" in error["message"], (what, error)
            assert "valid gzip stream" in error["message"], (what, error)
        assert a.bodies == []  # none reached the worker
        # a whole one is routed; a bomb still stops at limits.max_body_bytes (16 MiB)
        for body, status in ((whole, 200), (gzip.compress(bytes(17 << 20)), 413)):
            async with session.post(
                router.url + "/v1/completions", data=body, headers={"Content-Encoding": "gzip"}
            ) as resp:
                assert resp.status == status, await resp.text()
    assert a.bodies == [{"prompt": "x", "cache_salt": "t"}]


@pytest.mark.parametrize("coding", ["br", "zstd"])
async def test_a_br_or_zstd_body_cut_short_is_a_400_naming_it_never_forwarded(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession, coding: str
) -> None:
    """aiohttp's br and zstd decoders never checked that the stream ended (QA): a body cut
    short read as what it held (an admin `{"drain": false}` cut to nothing drained the worker,
    its default). Now whole or a 400, as gzip."""
    a, _ = pair
    text = b'{"prompt": "x", "cache_salt": "t"}' + b" " * 512
    whole = _compressed(text, coding)
    async with RouterService(_plain([("a", a.url)])) as router:
        for what, body in (("cut short", whole[:-1]), ("bytes after it", whole + b"GARBAGE")):
            async with session.post(
                router.url + "/v1/completions", data=body, headers={"Content-Encoding": coding}
            ) as resp:
                assert resp.status == 400, (what, await resp.text())
                error = (await resp.json())["error"]
            assert f"valid {coding} stream" in error["message"], (what, error)
        assert a.bodies == []
        async with session.post(
            router.url + "/v1/completions", data=whole, headers={"Content-Encoding": coding}
        ) as resp:
            assert resp.status == 200, await resp.text()
    assert a.bodies == [{"prompt": "x", "cache_salt": "t"}]


def _compressed(data: bytes, coding: str) -> bytes:
    import brotli

    if coding == "br":
        return bytes(brotli.compress(data))
    try:
        from compression import zstd  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        from backports import zstd  # type: ignore[no-redef,unused-ignore]
    return bytes(zstd.compress(data))


async def test_salts_never_reach_logs_or_metrics(
    pair: tuple[Upstream, Upstream],
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    a, b = pair
    a.mode = "fail"
    secret = "SECRET-salt-4242"
    async with RouterService(_plain([("a", a.url), ("b", b.url)])) as router:
        for body in ({"prompt": "x", "cache_salt": secret}, {"prompt": 5, "cache_salt": secret}):
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                await resp.read()
        async with session.post(
            router.url + "/admin/namespaces/evict", json={"cache_salt": secret}, headers=AUTH
        ) as resp:
            assert secret not in await resp.text()
        async with session.get(router.url + "/metrics") as resp:
            metrics = await resp.text()
    assert "kvroute_requests_total" in metrics and 'worker="b"' in metrics
    assert secret not in metrics
    assert secret not in caplog.text


async def test_health_models_and_drain(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, b = pair
    async with RouterService(_plain([("a", a.url), ("b", b.url)])) as router:
        async with session.get(router.url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["routable"] == 2
        async with session.get(router.url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "m"
        async with session.post(router.url + "/admin/workers/a/drain", headers=AUTH) as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "draining"
        for _ in range(3):
            async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.headers["x-kvroute-worker"] == "b"
        async with session.post(
            router.url + "/admin/workers/a/drain", json={"drain": False}, headers=AUTH
        ) as resp:
            assert (await resp.json())["status"] == "ready"


async def test_a_bug_is_a_json_500_not_a_crash(
    pair: tuple[Upstream, Upstream],
    session: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, _ = pair
    async with RouterService(_plain([("a", a.url)])) as router:

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug")  # a fault no real input produces

        monkeypatch.setattr(router.planner, "plan", broken)
        async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 500
            assert (await resp.json())["error"]["type"] == "InternalError"
        async with session.get(router.url + "/health") as resp:
            assert resp.status == 200  # and the router keeps serving
    assert "a bug" in caplog.text


async def test_a_stream_cut_by_the_request_deadline_does_not_open_the_circuit(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    a.mode = "sse-endless"
    config = _plain([("a", a.url)], timeouts=TimeoutsConfig(request_s=0.5))
    async with RouterService(config) as router:
        async with session.post(
            router.url + "/v1/completions", json={"prompt": "x", "stream": True}
        ) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.content.read()  # cut, not cleanly ended, when the deadline passes
        await asyncio.wait_for(a.disconnected.wait(), 5)
        # a long answer is no sign of a dead worker: no failure, the circuit stays closed
        entry = router.planner.pool.get("a")
        assert entry.breaker.failures == 0 and entry.routable(router.planner.clock())


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_stops_reading_is_cut_at_the_request_deadline(
    pair: tuple[Upstream, Upstream], stream: bool
) -> None:
    """The wait for a client to take its answer had no deadline: one that stopped reading
    kept its request running (its worker's connection, its load) for as long as it liked."""
    a, _ = pair
    a.mode = "sse-big" if stream else "big"
    config = _plain([("a", a.url)], timeouts=TimeoutsConfig(request_s=1.0))
    async with RouterService(config) as router:
        port = int(router.url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": "x", "stream": stream}).encode()
        request = request_bytes(b"POST", b"/v1/completions", [], body)
        async with stalled_client(port, request) as client:
            await eventually(lambda: _running(router, "a", 1), what="the request under way")
            # the client reads nothing: at the deadline its request ends all the same
            await eventually(lambda: _running(router, "a", 0), 8, what="the request cut")
            received = await read_to_close(client, 5)  # and its connection is closed
        assert 0 < len(received) < len(BIG_ANSWER)
        if stream:  # the worker was told: its connection closed
            await asyncio.wait_for(a.disconnected.wait(), 5)
        # a client that stops reading is no failure of the worker
        entry = router.planner.pool.get("a")
        assert entry.breaker.failures == 0 and entry.routable(router.planner.clock())
        # and it left before it had its answer: 499, as a client that disconnects (it was
        # counted as the worker's 200)
        async with aiohttp.ClientSession() as session, session.get(router.url + "/metrics") as r:
            metrics = await r.text()
        counted = [
            line for line in metrics.splitlines() if line.startswith("kvroute_requests_total{")
        ]
        assert len(counted) == 1 and 'code="499"' in counted[0], counted


async def test_rejections_are_labelled_by_route_not_by_raw_path(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    async with RouterService(_plain([("a", a.url)])) as router:
        for i in range(3):  # client-chosen ids must not each become a metric series
            async with session.post(router.url + f"/admin/workers/nobody-{i}/drain") as resp:
                assert resp.status == 401
        async with session.post(router.url + "/v1/completions", data=b"{") as resp:
            assert resp.status == 400
        async with session.get(router.url + "/metrics") as resp:
            metrics = await resp.text()
    assert "nobody-" not in metrics
    # answered before a model was read: no model label value
    assert 'endpoint="/admin/workers/{id}/drain",error="AuthError",model=""} 3.0' in metrics
    assert 'endpoint="/v1/completions",error="RequestError",model=""} 1.0' in metrics


async def test_a_worker_removed_mid_health_check_leaves_no_metric_series(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, b = pair
    async with RouterService(_plain([("a", a.url), ("b", b.url)])) as router:
        a.health_open.clear()
        a.health_probed.clear()
        await asyncio.wait_for(a.health_probed.wait(), 5)  # a health round is stuck on a
        async with session.delete(router.url + "/admin/workers/a", headers=AUTH) as resp:
            assert resp.status == 200
        seen = b.health_checks
        a.health_open.set()  # the round ends; the next one proves the late answer was handled

        async def next_round() -> bool:
            return b.health_checks > seen

        await eventually(next_round, what="the next health round")
        async with session.get(router.url + "/metrics") as resp:
            metrics = await resp.text()
    assert 'worker="b"' in metrics and 'worker="a"' not in metrics


async def test_a_removed_workers_series_go_with_it_late_answers_too(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    async with RouterService(_plain([("a", a.url)])) as router:
        async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200

        async def counted() -> bool:  # a whole answer is counted just after it is written
            async with session.get(router.url + "/metrics") as resp:
                text = await resp.text()
            return (
                'kvroute_routed_requests_total{dp_rank="",model="m",worker="a"} 1.0' in text
                and 'endpoint="/v1/completions",model="m",worker="a"} 1.0' in text
            )

        await eventually(counted, what="the first answer counted")
        a.mode = "sse"  # a stream the worker holds open while it is removed
        stream = await session.post(
            router.url + "/v1/completions", json={"prompt": "x", "stream": True}
        )
        assert stream.status == 200
        assert (await stream.content.readline()).startswith(b"data:")
        async with session.delete(router.url + "/admin/workers/a", headers=AUTH) as resp:
            assert resp.status == 200
        async with session.get(router.url + "/metrics") as resp:
            assert 'worker="a"' not in await resp.text()
        a.release.set()
        assert (await stream.read()).rstrip().endswith(b"data: [DONE]")
        stream.release()

        async def late_answer_counted() -> bool:  # the stream's end is counted after its write
            return bool(router.app[DECISIONS].recent) and len(router.app[DECISIONS].recent) == 2

        await eventually(late_answer_counted, what="the late answer counted")
        async with session.get(router.url + "/metrics") as resp:
            after = await resp.text()
    # every series naming the removed worker is gone, the late stream's too
    assert 'worker="a"' not in after
    assert "kvroute_request_duration_seconds_count" in after  # not a worker series: it stays


async def test_the_generation_endpoints_are_served_past_the_apps_router_alike(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, _ = pair
    async with RouterService(_plain([("a", a.url)])) as router:
        # the listener calls the proxy by path, without the app's router and middlewares
        routes = router.app[DIRECT_ROUTES]
        assert set(routes) == {endpoint.value for endpoint in Endpoint}
        url = router.url + "/v1/completions"
        async with session.post(url + "?client=x", json={"prompt": "x"}) as resp:
            assert resp.status == 200 and resp.headers["x-kvroute-worker"] == "a"
        async with session.get(url) as resp:  # not a POST: the app answers, as it did
            assert resp.status == 405
            assert (await resp.json())["error"]["type"] == "HTTPMethodNotAllowed"
        async with session.post(url, json={"prompt": 3}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "RequestError"
    assert len(a.bodies) == 1


async def test_without_the_proxy_there_is_no_direct_route(session: aiohttp.ClientSession) -> None:
    async with RouterService(_plain([]), proxy=False) as router:
        assert DIRECT_ROUTES not in router.app
        async with session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 404


async def test_streamed_5xx_answers_open_the_circuit_as_whole_ones_do(
    pair: tuple[Upstream, Upstream], session: aiohttp.ClientSession
) -> None:
    a, b = pair
    a.mode = "sse-fail"
    # no retries: each is its last try, passed through (and b routable: a failure of a
    # request that reached one worker of several counts, `Proxy._charge`)
    config = _plain(
        [("a", a.url), ("b", b.url)],
        breaker=BreakerConfig(failure_threshold=3, cooldown_s=30.0),
        health=HealthConfig(interval_s=60.0, timeout_s=0.5),
        limits=LimitsConfig(max_retries=0),
    )
    async with RouterService(config) as router:
        body = {"prompt": "x", "stream": True}
        for _ in range(60):  # ties are broken at random: until a was tried 3 times
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == (500 if resp.headers["x-kvroute-worker"] == "a" else 200)
                await resp.read()
            if len(a.bodies) == 3:
                break
        entry = router.planner.pool.get("a")
        assert entry.breaker.state(router.planner.clock()) is BreakerState.OPEN
        for _ in range(3):
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.headers["x-kvroute-worker"] == "b"
                await resp.read()


async def _raw_worker(head: bytes, body: bytes) -> asyncio.Server:
    """A worker written byte by byte: any GET is a model list, any POST gets `head` + `body`
    (what aiohttp would not send: a header that is not UTF-8)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while request := await reader.readuntil(b"\r\n\r\n"):
                length = 0
                for line in request.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                if request.startswith(b"GET"):
                    models = b'{"object": "list", "data": [{"id": "m"}]}'
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(models), models)
                    )
                else:
                    writer.write(head + body)
                await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.parametrize(("stream", "version"), [(False, b"1.1"), (True, b"1.1"), (False, b"1.0")])
async def test_a_worker_header_that_is_not_utf8_passes_as_its_bytes(
    session: aiohttp.ClientSession, stream: bool, version: bytes
) -> None:
    if stream:
        body = b'10\r\ndata: {"n": 1}\n\n\r\n0\r\n\r\n'
        framing = b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked"
    else:
        body = b'{"ok": 1}'
        framing = b"Content-Type: application/json\r\nContent-Length: 9"
    head = b"HTTP/1.1 200 OK\r\nX-Name: caf\xe9 \xff\r\n" + framing + b"\r\n\r\n"
    server = await _raw_worker(head, body)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with RouterService(_plain([("raw", url)])) as router:
            reader, writer = await asyncio.open_connection(*router.url[7:].split(":"))
            request = json.dumps({"prompt": "x", "stream": stream}).encode()
            writer.write(
                b"POST /v1/completions HTTP/%s\r\nHost: r\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (version, len(request), request)
            )
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
    finally:
        server.close()
    # not a 500: the worker's bytes, as it sent them; where aiohttp writes the head (an
    # HTTP/1.0 client), U+FFFD in place of each byte that is not UTF-8
    assert answer.startswith(b"HTTP/" + version + b" 200"), answer[:200]
    sent = b"caf\xe9 \xff" if version == b"1.1" else "caf\ufffd \ufffd".encode()
    assert b"\r\nX-Name: " + sent + b"\r\n" in answer


async def test_headers_the_worker_names_in_connection_stay_on_its_hop(
    session: aiohttp.ClientSession,
) -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Private\r\nX-Private: secret\r\n"
        b"X-Public: ok\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n"
    )
    server = await _raw_worker(head, b'{"ok": 1}')
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with (
            RouterService(_plain([("raw", url)])) as router,
            session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp,
        ):
            assert resp.status == 200 and await resp.json() == {"ok": 1}
            assert resp.headers["X-Public"] == "ok"
            assert "X-Private" not in resp.headers  # RFC 9110 7.6.1: hop-by-hop
    finally:
        server.close()


async def test_a_workers_trailer_fields_never_become_response_headers() -> None:
    """llhttp reports a chunked answer's trailer fields as headers: arriving in the same read as
    the head, they were copied into the client's head (a second Content-Type, a Set-Cookie)."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    body = b"6\r\ndata:\n\r\n0\r\nContent-Type: text/html\r\nSet-Cookie: session=evil\r\n\r\n"
    server = await _raw_worker(head, body)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with RouterService(_plain([("raw", url)])) as router:
            port = int(router.url.rsplit(":", 1)[1])
            request = json.dumps({"prompt": "x", "stream": True}).encode()
            answer = await exchange(port, request_bytes(b"POST", b"/v1/completions", [], request))
    finally:
        server.close()
    (response,) = parse_responses(answer)
    assert response.status == 200 and response.body == b"data:\n"
    head_lines = answer.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")
    assert [line for line in head_lines if line.startswith(b"content-type:")] == [
        b"content-type: text/event-stream"
    ]
    assert not [line for line in head_lines if line.startswith(b"set-cookie:")]


async def test_headers_the_client_names_in_connection_stay_on_its_hop(
    pair: tuple[Upstream, Upstream],
) -> None:
    """RFC 9110 7.6.1: a proxy removes every header its client's `Connection` names, in any
    case and over several `Connection` lines, and passes the others on. A request id named
    there is not adopted either: the worker and the answer carry the router's own (before, the
    router took it as the request's id and set it on the worker's request again)."""
    a, _ = pair
    body = json.dumps({"prompt": "x"}).encode()
    named = [
        (b"Connection", b"keep-alive, X-Secret"),
        (b"X-Secret", b"hop"),
        (b"X-Public", b"end-to-end"),
        (b"connection", b" x-other ,,X-SECOND-secret , X-Request-Id"),
        (b"X-Other", b"hop"),
        (b"X-Second-Secret", b"hop"),
        (b"X-Request-Id", b"cid-123"),
    ]
    plain = [(b"X-Public", b"end-to-end"), (b"X-Request-Id", b"cid-123")]
    echoed: list[str] = []
    async with RouterService(_plain([("a", a.url)])) as router:
        port = int(router.url.rsplit(":", 1)[1])
        for headers in (named, plain):
            # with `Connection: close` too, a third line
            raw = request_bytes(b"POST", b"/v1/completions", headers, body)
            (response,) = parse_responses(await exchange(port, raw))
            assert response.status == 200, response
            echoed.append(response.headers["x-request-id"])
    assert len(a.headers) == 2
    for seen in a.headers:
        assert seen["x-public"] == "end-to-end"
        assert not {"x-secret", "x-other", "x-second-secret"} & set(seen), seen
    # named: the router's own id, on the worker's request and the answer; else the client's
    assert echoed[0] != "cid-123" and a.headers[0]["x-request-id"] == echoed[0]
    assert echoed[1] == "cid-123" == a.headers[1]["x-request-id"]


@pytest.mark.parametrize("mode", ["hop-named", "hop-named-sse"])
async def test_headers_an_aiohttp_worker_names_in_connection_stay_on_its_hop(
    pair: tuple[Upstream, Upstream], mode: str
) -> None:
    a, _ = pair
    a.mode = mode
    body = json.dumps({"prompt": "x", "stream": mode.endswith("sse")}).encode()
    async with RouterService(_plain([("a", a.url)])) as router:
        port = int(router.url.rsplit(":", 1)[1])
        answer = await exchange(port, request_bytes(b"POST", b"/v1/completions", [], body))
    (response,) = parse_responses(answer)
    assert response.status == 200, response
    assert response.headers["x-public"] == "ok" and "x-private" not in response.headers
