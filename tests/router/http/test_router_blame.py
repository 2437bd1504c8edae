"""Whose failure is it: circuit breakers against a request that fails on every worker, and the
requests a client abandoned, in the request series. Real sockets: a scripted worker that
misbehaves per request (header `x-bad-mode`, as the QA backend does), raw client connections
closed mid-answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from router.config import (
    BreakerConfig,
    HealthConfig,
    LimitsConfig,
    PolicyConfig,
    RouterConfig,
    TimeoutsConfig,
)
from router.http import rank_refusal
from router.http.keys import DECISIONS
from router.http.rank_refusal import refuses_rank
from router.routing.breaker import BreakerState
from router.service import RouterService
from tests.raw_http import request_bytes
from tests.router.conftest import eventually, router_config, serve_app

_COMPLETIONS = "/v1/completions"


class BadWorker:
    """A worker whose answer to each completion request is named by its `x-bad-mode` header:
    ok, 500 (a JSON error), drop (the connection closed unanswered: the engine crashed),
    garbage (bytes that are not HTTP), slow (no answer for 30 s), stream (an endless SSE),
    cut (a few SSE events, then the connection closed: the engine crashed mid-stream), stall
    (two SSE events, then nothing for 30 s: the engine hung mid-stream).
    `mode@name` applies to the worker `name` only; the others answer it (several: comma
    separated)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.modes: list[str] = []  # the mode of each completion request, in order
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        mode = "ok"
        for named in request.headers.get("x-bad-mode", "ok").split(","):
            named_mode, _, only = named.partition("@")
            if not only or only == self.name:
                mode = named_mode
        self.modes.append(mode)
        transport = request.transport
        assert transport is not None
        if mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if mode == "drop":
            transport.close()
            await asyncio.sleep(30)
        if mode == "garbage":
            transport.write(b"NOT HTTP AT ALL\r\n\r\n")
            transport.close()
            await asyncio.sleep(30)
        if mode == "slow":
            await asyncio.sleep(30)
        if mode == "stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for n in range(3000):  # bounded: 30 s at most, the client leaves first
                await resp.write(f'data: {{"n": {n}}}\n\n'.encode())
                await asyncio.sleep(0.01)
            return resp
        if mode == "cut":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for n in range(3):
                # each event with its cached_tokens, as SGLang's /generate events carry it
                await resp.write(
                    f'data: {{"n": {n}, "meta_info": {{"cached_tokens": 0}}}}\n\n'.encode()
                )
            transport.close()  # no last chunk: the client's parser sees the answer unended
            await asyncio.sleep(30)
        if mode == "stall":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for n in range(2):
                await resp.write(f'data: {{"n": {n}}}\n\n'.encode())
            await asyncio.sleep(30)
        return web.json_response({"worker": self.name, "choices": [{"text": "hi"}]})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def __aenter__(self) -> BadWorker:
        app = web.Application()
        app.router.add_post(_COMPLETIONS, self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner, self.url = await serve_app(
            app, handler_cancellation=True, shutdown_timeout=0.1
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def _config(workers: list[BadWorker], **overrides: object) -> RouterConfig:
    # health rounds far apart: only requests move the breakers
    fields: dict[str, object] = {"health": HealthConfig(interval_s=60.0, timeout_s=0.5)}
    fields.update(overrides)
    config = router_config([(w.name, w.url) for w in workers], **fields)
    plain = tuple(msgspec.structs.replace(w, kv_events=False) for w in config.workers)
    return msgspec.structs.replace(config, workers=plain)


@pytest.fixture
async def two() -> AsyncIterator[tuple[BadWorker, BadWorker]]:
    async with BadWorker("a") as a, BadWorker("b") as b:
        yield a, b


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _post(session: aiohttp.ClientSession, router: RouterService, mode: str) -> int:
    async with session.post(
        router.url + _COMPLETIONS, json={"prompt": "x"}, headers={"x-bad-mode": mode}
    ) as resp:
        await resp.read()
        return resp.status


def _state(router: RouterService, worker: str) -> BreakerState:
    return router.planner.pool.get(worker).breaker.state(router.planner.clock())


@pytest.mark.parametrize(("mode", "count"), [("drop", 1), ("garbage", 1), ("500", 3)])
async def test_a_request_that_fails_on_every_worker_opens_no_circuit(
    two: tuple[BadWorker, BadWorker], session: aiohttp.ClientSession, mode: str, count: int
) -> None:
    """An engine that crashes on one prompt crashes on it on every worker the retry carries it
    to: that is the request's failure, and the fleet goes on serving everyone else."""
    a, b = two
    async with RouterService(_config([a, b])) as router:
        for _ in range(count):
            assert await _post(session, router, mode) in (500, 502)
        assert a.modes == b.modes == [mode] * count  # each was retried on the other
        assert _state(router, "a") is _state(router, "b") is BreakerState.CLOSED
        await _serves_everyone(session, router)


async def test_a_worker_that_drops_a_request_another_answers_leaves_rotation_at_once(
    two: tuple[BadWorker, BadWorker], session: aiohttp.ClientSession
) -> None:
    """The other side: when a retry proves the request sound, the dropped connection was the
    worker's (its process died), and that one request opens its circuit, as before."""
    a, b = two
    async with RouterService(_config([a, b], policy=PolicyConfig(name="round_robin"))) as router:
        for _ in range(2):  # round robin: one of the two goes to a first
            assert await _post(session, router, "drop@a") == 200
            if a.modes:
                break
        assert a.modes == ["drop"]
        assert _state(router, "a") is BreakerState.OPEN
        assert _state(router, "b") is BreakerState.CLOSED


async def test_a_worker_failing_what_another_answers_leaves_rotation_at_the_threshold(
    two: tuple[BadWorker, BadWorker], session: aiohttp.ClientSession
) -> None:
    a, b = two
    config = _config([a, b], breaker=BreakerConfig(failure_threshold=3, cooldown_s=30.0))
    async with RouterService(config) as router:
        for _ in range(60):  # ties are broken at random: until a was tried 3 times
            assert await _post(session, router, "500@a") == 200
            if len(a.modes) == 3:
                break
        assert a.modes == ["500"] * 3
        assert _state(router, "a") is BreakerState.OPEN


@pytest.mark.parametrize(("mode", "status"), [("drop@a", 502), ("500@a", 500)])
async def test_without_retries_a_failing_worker_still_leaves_rotation(
    two: tuple[BadWorker, BadWorker], session: aiohttp.ClientSession, mode: str, status: int
) -> None:
    """With `max_retries = 0` nothing tells the request's fault from the worker's: each such
    request charges its worker one ordinary failure (never a hard one), so a worker that fails
    every request still reaches the threshold; a 5xx passed through counts as one."""
    a, b = two
    config = _config(
        [a, b],
        limits=LimitsConfig(max_retries=0),
        breaker=BreakerConfig(failure_threshold=3, cooldown_s=30.0),
    )
    async with RouterService(config) as router:
        for _ in range(60):  # ties are broken at random: until a was sent 3
            tried = len(a.modes)
            got = await _post(session, router, mode)
            assert got == (status if len(a.modes) > tried else 200)
            if len(a.modes) == 1:
                assert _state(router, "a") is BreakerState.CLOSED  # one is no proof
            if len(a.modes) == 3:
                break
        assert len(a.modes) == 3
        assert _state(router, "a") is BreakerState.OPEN


async def _metrics(session: aiohttp.ClientSession, router: RouterService) -> dict[str, float]:
    async with session.get(router.url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if sample.name.endswith(("_created", "_bucket")):
                continue
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


async def _abandon(
    router: RouterService, body: dict[str, object], mode: str, *, wait_for: bytes
) -> None:
    """Send one request on a raw connection and close it once `wait_for` came back (b"": once
    the worker has it, `seen` below)."""
    host, port = "127.0.0.1", int(router.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        request_bytes(
            b"POST",
            _COMPLETIONS.encode(),
            [(b"Content-Type", b"application/json"), (b"x-bad-mode", mode.encode())],
            json.dumps(body).encode(),
        )
    )
    await writer.drain()
    if wait_for:
        await asyncio.wait_for(reader.readuntil(wait_for), 5)
    else:
        await asyncio.sleep(0.3)  # the worker holds it unanswered
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def test_requests_their_clients_abandoned_count_as_499(
    two: tuple[BadWorker, BadWorker], session: aiohttp.ClientSession
) -> None:
    """A client that gives up (the fleet is slow) is counted where every proxied request is,
    by the worker serving it and code 499, the time until it left in the latency: a whole
    answer it waited for, and a stream that had delivered chunks already."""
    a, _ = two
    async with RouterService(_config([a])) as router:
        before = await _metrics(session, router)
        await _abandon(router, {"prompt": "x"}, "slow", wait_for=b"")
        await _abandon(router, {"prompt": "x", "stream": True}, "stream", wait_for=b"data: ")
        key = "kvroute_requests_total{code=499,endpoint=/v1/completions,model=m,worker=a}"
        latency = "kvroute_request_duration_seconds_count{endpoint=/v1/completions,model=m}"

        async def counted() -> bool:
            return (await _metrics(session, router)).get(key) == 2.0

        await eventually(counted, what="the two abandoned requests to be counted")
        after = await _metrics(session, router)
        assert after[latency] - before.get(latency, 0.0) == 2.0
        assert a.modes == ["slow", "stream"]


async def test_a_stream_its_worker_broke_off_counts_as_502_not_as_its_200(
    two: tuple[BadWorker, BadWorker], session: aiohttp.ClientSession
) -> None:
    """A worker dying mid-stream: its client has the worker's 200 and a cut body, but the
    request was counted as that 200 and among the successful answers without usage, so an
    error rate never showed it. It counts as 502 (nginx's bad gateway), in the decisions too,
    with no usage (prediction accuracy is over answers that came whole); the worker is charged
    one ordinary failure."""
    a, _ = two
    async with RouterService(_config([a])) as router:
        body = {"prompt": "x", "stream": True}
        headers = {"x-bad-mode": "cut"}
        async with session.post(router.url + _COMPLETIONS, json=body, headers=headers) as resp:
            assert resp.status == 200  # the worker's status line, sent with its first chunk
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        key = "kvroute_requests_total{code=502,endpoint=/v1/completions,model=m,worker=a}"

        async def counted() -> bool:
            return key in await _metrics(session, router)

        await eventually(counted, what="the broken stream to be counted")
        after = await _metrics(session, router)
        requests = {k: v for k, v in after.items() if k.startswith("kvroute_requests_total{")}
        assert requests == {key: 1.0}
        usage = ("kvroute_usage_", "kvroute_prediction_outcomes_total")
        assert not {k: v for k, v in after.items() if k.startswith(usage) and v}
        assert [(d.status, d.cached_tokens) for d in router.app[DECISIONS].recent] == [(502, None)]
        assert a.modes == ["cut"]
        assert router.planner.pool.get("a").breaker.failures == 1
        assert _state(router, "a") is BreakerState.CLOSED


async def _cut_stream(session: aiohttp.ClientSession, router: RouterService, rid: str) -> str:
    """Send a stream its worker breaks off; the worker that had it."""
    body = {"prompt": "x", "stream": True}
    headers = {"x-bad-mode": "cut", "x-request-id": rid}
    async with session.post(router.url + _COMPLETIONS, json=body, headers=headers) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
        return resp.headers["x-kvroute-worker"]


async def test_one_prompt_cut_mid_stream_on_every_worker_leaves_the_fleet_serving(
    two: tuple[BadWorker, BadWorker], session: aiohttp.ClientSession
) -> None:
    """A prompt whose stream the engine breaks off, sent again by its client (each stream cut
    once its status went out: no retry by the router), reached both workers: each cut opened
    its worker's circuit at once, and for `breaker.cooldown_s` every healthy request was a 503,
    `/health` too. A cut counts one ordinary failure toward the threshold, as a 5xx does."""
    a, b = two
    config = _config(
        [a, b],
        policy=PolicyConfig(name="round_robin"),
        breaker=BreakerConfig(failure_threshold=3, cooldown_s=30.0),
    )
    async with RouterService(config) as router:
        cut = {await _cut_stream(session, router, f"poison-{n}") for n in range(2)}
        assert cut == {"a", "b"} and a.modes == b.modes == ["cut"]
        assert _state(router, "a") is _state(router, "b") is BreakerState.CLOSED
        await _serves_everyone(session, router)


async def test_a_503_for_open_circuits_says_so_and_until_when(
    two: tuple[BadWorker, BadWorker], session: aiohttp.ClientSession
) -> None:
    """Every worker out because its circuit opened was answered "no routable worker among 2",
    as if the fleet were gone: the client and the operator could not tell it is back within
    the cooldown."""
    a, b = two
    config = _config(
        [a, b],
        policy=PolicyConfig(name="round_robin"),
        breaker=BreakerConfig(failure_threshold=1, cooldown_s=30.0),
    )
    async with RouterService(config) as router:
        assert {await _cut_stream(session, router, f"cut-{n}") for n in range(2)} == {"a", "b"}
        async with session.post(router.url + _COMPLETIONS, json={"prompt": "x"}) as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
        assert error["type"] == "NoWorkerError"
        message = error["message"]
        prefix = (
            "no routable worker among 2: 2 with an open circuit after failures "
            "(breaker.cooldown_s), the first tried again in "
        )
        assert message.startswith(prefix) and message.endswith(" s"), message
        assert 25.0 < float(message.removeprefix(prefix).removesuffix(" s")) <= 30.0


def _warnings(caplog: pytest.LogCaptureFixture, rid: str) -> list[str]:
    """The WARNING lines logged for the request `rid`."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and getattr(r, "request_id", None) == rid
    ]


@pytest.mark.usefixtures("log_request_ids")
@pytest.mark.parametrize(("mode", "charged"), [("stall", 1), ("stream", 0)])
async def test_a_stream_the_request_deadline_cuts_counts_as_504(
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    charged: int,
) -> None:
    """A stream cut at `timeouts.request_s` was counted as the worker's 200 (metrics and
    decisions), logged at INFO only, and a worker that hung mid-stream was never charged. Its
    client has a cut body: it counts as 504, with a WARNING naming the worker (on the
    request's id); a worker that had sent nothing for `timeouts.connect_s` is charged one
    ordinary failure, one still streaming nothing."""
    caplog.set_level(logging.INFO)
    async with BadWorker("a") as a:
        config = _config([a], timeouts=TimeoutsConfig(request_s=1.0, connect_s=0.3))
        async with RouterService(config) as router:
            body = {"prompt": "x", "stream": True}
            headers = {"x-bad-mode": mode, "x-request-id": f"cut-{mode}"}
            async with session.post(router.url + _COMPLETIONS, json=body, headers=headers) as r:
                assert r.status == 200  # the worker's status line, sent with its first chunk
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()  # cut, not cleanly ended
            key = "kvroute_requests_total{code=504,endpoint=/v1/completions,model=m,worker=a}"

            async def counted() -> bool:
                return key in await _metrics(session, router)

            await eventually(counted, what="the cut stream to be counted")
            after = await _metrics(session, router)
            requests = {k: v for k, v in after.items() if k.startswith("kvroute_requests_total{")}
            assert requests == {key: 1.0}
            assert [d.status for d in router.app[DECISIONS].recent] == [504]
            assert router.planner.pool.get("a").breaker.failures == charged
        said = _warnings(caplog, f"cut-{mode}")
        assert len(said) == 1 and "worker a" in said[0] and "timeouts.request_s" in said[0]
        assert ("sent nothing" in said[0]) == bool(charged), said


@pytest.mark.usefixtures("log_request_ids")
@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_that_does_not_answer_in_time_is_logged(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """A 504 for a worker that did not answer within `timeouts.request_s` left no log line,
    where every other upstream failure has a WARNING naming the worker and the request."""
    caplog.set_level(logging.INFO)
    async with BadWorker("a") as a:
        config = _config([a], timeouts=TimeoutsConfig(request_s=0.5))
        async with RouterService(config) as router:
            body = {"prompt": "x", "stream": stream}
            headers = {"x-bad-mode": "slow", "x-request-id": "late-1"}
            async with session.post(router.url + _COMPLETIONS, json=body, headers=headers) as r:
                assert r.status == 504
                assert (await r.json())["error"]["type"] == "UpstreamTimeoutError"
    said = _warnings(caplog, "late-1")
    assert len(said) == 1, said
    assert "worker a did not answer" in said[0] and "timeouts.request_s" in said[0]


async def test_a_client_leaving_during_a_retry_charges_no_worker(
    session: aiohttp.ClientSession,
) -> None:
    """A request whose first worker answered 500 and whose client left during the retry did
    not run out of workers: its first worker was charged a failure all the same."""
    async with (
        BadWorker("a") as a,
        BadWorker("b") as b,
        BadWorker("c") as c,
        RouterService(_config([a, b, c])) as router,
    ):
        for _ in range(30):  # ties are broken at random: until a is tried first
            await _abandon(router, {"prompt": "x"}, "500@a,slow@b,slow@c", wait_for=b"")
            if a.modes:
                break
        assert a.modes == ["500"]
        await asyncio.sleep(0.2)  # its end, after the client left
        assert router.planner.pool.get("a").breaker.failures == 0


def test_only_an_engines_rank_refusal_counts_as_one() -> None:
    """Any 400 saying "out of range" (a sampling parameter's) had the worker's settings read
    again for every such request: only the engines' refusal of a dp rank is one."""
    sglang = b'{"error": {"message": "routed_dp_rank=2 out of range [0, 1)"}}'
    vllm = b'{"error": {"message": "data_parallel_rank 3 is out of range [0, 2)."}}'
    assert refuses_rank(400, sglang) and refuses_rank(400, vllm)
    assert not refuses_rank(500, sglang)
    for other in (
        b'{"error": {"message": "temperature 3.0 out of range [0, 2]"}}',
        b'{"error": {"message": "logprob_start_len out of range"}}',
    ):
        assert not refuses_rank(400, other)


def test_rank_less_retries_are_said_once_a_while_with_the_count_unsaid(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One WARNING per interval per worker, each retry between at DEBUG, and the next WARNING
    says how many went unsaid (before: one WARNING a request)."""
    now = [0.0]
    caplog.set_level(logging.DEBUG, logger="router.http.rank_refusal")
    notices = rank_refusal.RankRetryNotices(clock=lambda: now[0])
    for _ in range(4):
        notices.say("a", 1, "its ranks not read in time")
    notices.say("b", 0, "its ranks not read in time")
    now[0] = rank_refusal._SAY_RETRY_S
    notices.say("a", 1, "its ranks not read in time")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(" refused")[0] for w in warnings] == ["worker a", "worker b", "worker a"]
    assert warnings[0].endswith("0 more since the last time)")
    assert warnings[2].endswith("3 more since the last time)")
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 3


async def _serves_everyone(session: aiohttp.ClientSession, router: RouterService) -> None:
    """The fleet answers sound requests, and the router says it is healthy."""
    assert [await _post(session, router, "ok") for _ in range(4)] == [200] * 4
    async with session.get(router.url + "/health") as resp:
        assert resp.status == 200
