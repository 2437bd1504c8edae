"""Isolation violations and the pooled bound: counted by hand on tiny traces, and for real
through a router that drops `cache_salt` (a tiny aiohttp forwarder) and through kvroute."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from bench.isolation import ENDPOINTS, probe_isolation, workload_violations
from bench.pooled_bound import pooled_replay, replay_hit_rate, ttft_floor_p90_ms
from bench.routing_results import PolicyRun, RequestRecord, summarize
from bench.workloads import BenchRequest
from router.config import AdminConfig, ListenConfig, PolicyConfig, RouterConfig
from router.config import WorkerConfig as RoutedWorker
from router.service import RouterService
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker


def _req(ids: list[int], salt: str | None = None, at: float = 0.0) -> BenchRequest:
    return BenchRequest(arrival_s=at, input_ids=ids, max_new_tokens=1, cache_salt=salt)


def test_the_pooled_bound_on_a_trace_counted_by_hand() -> None:
    # page 2, room for 2 pages; one output token each, so only prompts are cached
    trace = [
        _req([1, 2, 3, 4, 9]),  # miss; caches [1 2][3 4]: full
        _req([1, 2, 3, 4, 7]),  # hits 4 (the last token is never reused)
        _req([5, 6, 1]),  # miss; [5 6] evicts the LRU leaf, the node [1 2 3 4]
        _req([1, 2, 3, 4, 8]),  # miss again; evicts [5 6]
        _req([1, 2, 3, 4, 8], salt="t"),  # another namespace: miss; evicts the unsalted node
        _req([1, 2, 3, 4, 5], salt="t"),  # hits 4
    ]
    for i, r in enumerate(trace):
        trace[i] = BenchRequest(arrival_s=float(i), input_ids=r.input_ids, max_new_tokens=1,
                                cache_salt=r.cache_salt)  # fmt: skip
    assert replay_hit_rate(pooled_replay(trace, page_size=2, capacity_tokens=4)) == pytest.approx(
        8 / 28
    )
    # with room for everything only the first of each prefix misses
    assert replay_hit_rate(pooled_replay(trace, page_size=2, capacity_tokens=64)) == pytest.approx(
        12 / 28
    )


def test_the_ttft_floor_is_each_requests_own_uncached_prefill_at_the_90th_percentile() -> None:
    # page 2, room for everything: each request computes what the pooled cache lacks
    trace = [
        BenchRequest(arrival_s=float(i), input_ids=ids, max_new_tokens=1)
        for i, ids in enumerate(
            [[1, 2, 3, 4, 9], [1, 2, 3, 4, 7], [5, 6, 1], [1, 2, 3, 4, 8], [1, 2, 9]]
        )
    ]
    replay = pooled_replay(trace, page_size=2, capacity_tokens=64)
    assert replay == [(0, 5), (4, 5), (0, 3), (4, 5), (2, 3)]
    # uncached 5, 1, 3, 1, 1 tokens at 2 ms: sorted 2 2 2 6 10 ms; p90 interpolates 6 .. 10
    assert ttft_floor_p90_ms(replay, 2.0) == pytest.approx(6 + 0.6 * 4)
    assert ttft_floor_p90_ms([], 2.0) == 0.0


def _record(i: int, sent: float, ttft: float, cached: int, prompt: int) -> RequestRecord:
    return RequestRecord(index=i, sent_s=sent, ok=True, ttft_s=ttft, e2e_s=ttft + 0.01,
                         cached_tokens=cached, prompt_tokens=prompt)  # fmt: skip


def test_cached_tokens_beyond_the_salts_own_history_are_violations() -> None:
    shared = list(range(10, 26))  # 16 tokens: 4 pages of 4
    requests = [
        _req([*shared, 1, 2], "a"),
        _req([*shared, 3, 4], "b"),  # b's first request: its 16 cached tokens came from a
        _req([*shared, 5, 6], "b"),  # b sent the prefix itself before: legitimate
        _req([*shared, 7, 8], "c"),  # c's first, sent while b's first was in flight:
    ]
    records = [
        _record(0, 0.0, 0.1, 0, 18),
        _record(1, 1.0, 0.1, 16, 18),
        _record(2, 2.0, 0.1, 16, 18),
        _record(3, 1.05, 0.1, 8, 18),
    ]
    workload_violations(requests, records, page_size=4)
    assert [r.violation_tokens for r in records] == [0, 16, 0, 8]
    s = summarize(PolicyRun(policy="p", records=records, wall_s=1.0))
    assert s.violation_tokens == 24 and s.violating_requests == 2
    assert s.reported_hit_rate == pytest.approx(40 / 72)
    assert s.hit_rate == pytest.approx(16 / 72)  # violations are not hits


def test_only_what_the_same_worker_was_sent_explains_a_hit() -> None:
    shared = list(range(10, 26))
    requests = [_req([*shared, 1, 2], "a"), _req([*shared, 3, 4], "b"), _req([*shared, 5], "a")]
    records = [
        _record(0, 0.0, 0.1, 0, 18),
        _record(1, 1.0, 0.1, 0, 18),
        _record(2, 2.0, 0.1, 16, 17),  # a sent the prefix, but to the other worker
    ]
    for r, worker in zip(records, ["9001", "9002", "9002"], strict=True):
        r.served_by = worker
    workload_violations(requests, records, page_size=4)
    assert [r.violation_tokens for r in records] == [0, 0, 16]
    # where the answers do not say which cache served them, any worker explains
    workload_violations(requests, records, page_size=4, by_worker=False)
    assert [r.violation_tokens for r in records] == [0, 0, 0]


def test_a_request_sent_after_the_first_byte_explains_nothing() -> None:
    prompt = list(range(3, 3 + 17))
    requests = [_req(prompt, "a"), _req(prompt, "a")]
    # the second was admitted (first byte at 0.5) before the first was even sent (0.6)
    records = [_record(0, 0.6, 0.1, 0, 17), _record(1, 0.4, 0.1, 16, 17)]
    workload_violations(requests, records, page_size=4)
    assert records[1].violation_tokens == 16


@contextlib.asynccontextmanager
async def _strip_salt_forwarder(upstream: str) -> AsyncIterator[str]:
    """A router that drops `cache_salt`, as sglang-router 0.3.2 does on two endpoints."""
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.Response:
        body = await request.json()
        body.pop("cache_salt", None)
        async with session.post(upstream + request.path, json=body) as resp:
            return web.Response(status=resp.status, body=await resp.read(),
                                content_type="application/json")  # fmt: skip

    app = web.Application()
    for path in ENDPOINTS:
        app.router.add_post(path, forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await session.close()


def _worker_config() -> WorkerConfig:
    return WorkerConfig(page_size=16, capacity_tokens=16384, prefill_ms_per_token=0.0,
                        decode_ms_per_token=0.0, time_scale=0.0)  # fmt: skip


async def test_a_router_that_drops_the_salt_is_counted_as_violating() -> None:
    async with ReferenceWorker(_worker_config()) as worker, aiohttp.ClientSession() as session:
        direct = await probe_isolation(session, worker.url, seed=1, pairs=2)
        # the worker itself keeps every salt apart on every endpoint
        assert [(p.endpoint, p.requests, p.violating) for p in direct] == [
            (e, 4, 0) for e in ENDPOINTS
        ]
        async with _strip_salt_forwarder(worker.url) as url:
            stripped = await probe_isolation(session, url, seed=2, pairs=2)
    for p in stripped:
        assert p.errors == 0, p.error
        # every second request of a pair got its first's pages (all but the last token)
        assert p.violating == 2 and p.violation_tokens >= 2 * 16, p


async def test_kvroute_keeps_tenants_apart_on_every_endpoint() -> None:
    async with (
        ReferenceWorker(_worker_config()) as w0,
        ReferenceWorker(_worker_config()) as w1,
    ):
        config = RouterConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            admin=AdminConfig(enabled=False),
            policy=PolicyConfig(name="approx_tree"),  # salt-blind routing, salt forwarded
            workers=(RoutedWorker(url=w0.url, id="w0"), RoutedWorker(url=w1.url, id="w1")),
        )
        async with RouterService(config) as service, aiohttp.ClientSession() as session:
            probes = await probe_isolation(session, service.url, seed=3, pairs=2)
    for p in probes:
        assert (p.requests, p.violating, p.errors) == (4, 0, 0), p
