"""`kvroute bench proxy`'s streamed section: the benchmark's backend streams SSE chunks, a
real router passes them through whole and in order, and the section measures both targets."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestServer

from bench import proxy_bench
from bench.proxy_bench import STREAM_CHUNKS, _backend_app, _streamed_notes, _streamed_section
from router.config import WorkerConfig
from router.service import RouterService
from tests.router.conftest import router_config


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    server = TestServer(_backend_app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def router(backend: str) -> AsyncIterator[str]:
    plain = WorkerConfig(url=backend, id="backend", kv_events=False)  # no KV events to read
    config = msgspec.structs.replace(router_config([]), workers=(plain,))
    async with RouterService(config) as service:
        yield service.url


async def _streamed(url: str) -> tuple[dict[str, str], list[bytes]]:
    """The headers and the SSE events of one streamed request, as they arrived."""
    events: list[bytes] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/completions",
            data=proxy_bench._STREAM_BODY,
            headers={"Content-Type": "application/json"},
        ) as response,
    ):
        assert response.status == 200
        async for line in response.content:
            if line.strip():
                events.append(line.strip())
        return dict(response.headers), events


async def test_a_streamed_answer_comes_through_the_router_whole(backend: str, router: str) -> None:
    _, direct = await _streamed(backend)
    headers, routed = await _streamed(router)
    assert routed == direct
    assert len(routed) == STREAM_CHUNKS + 2  # the chunks, the usage, [DONE]
    assert routed[-1] == b"data: [DONE]"
    assert headers["Transfer-Encoding"] == "chunked"
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["x-kvroute-worker"] == "backend"


async def test_the_streamed_section_measures_each_target(backend: str, router: str) -> None:
    args = argparse.Namespace(
        latency_requests=500,  # a tenth of it: 50 samples
        throughput_requests=300,
        concurrency=4,
        deadline_s=20.0,
        rounds=1,
        processes=1,
    )
    section = await _streamed_section(
        args, {"direct": backend, "kvroute": router, "not measured": "http://127.0.0.1:9"}
    )
    assert set(section.rates) == {"direct", "kvroute"}
    assert all(rate > 0 for rate in section.rates.values())
    assert len(section.lat_rows) == 2 and len(section.tput_rows) == 2
    assert all("| 0 |" in row for row in section.tput_rows)  # no errors
    ratio = section.rates["kvroute"] / 100.0
    (note,) = _streamed_notes(args, {"kvroute": section.rates["kvroute"], "sglang-router": 100.0})
    assert note.endswith(f"{ratio:.2f}")


def test_the_streamed_notes_lead_with_cpu_and_call_a_latency_bound_ratio_so() -> None:
    # the committed run of 2026-12-05: 2.58x the requests/s at 1.02x the CPU per request,
    # sglang-router's streamed answers 41 ms slower each (its Nagle stall)
    args = argparse.Namespace(concurrency=32, processes=2)
    rates = {"kvroute": 3021.0, "kvroute --processes 2": 2916.0, "sglang-router": 1170.0}
    cpu = {"kvroute": 215.0, "kvroute --processes 2": 300.0, "sglang-router": 210.0}
    added = {"kvroute": 0.277, "kvroute --processes 2": 0.370, "sglang-router": 41.460}
    notes = _streamed_notes(args, rates, cpu, added)
    assert notes[0].startswith(
        "streamed answers: CPU per request kvroute 215 us, sglang-router 210 us (1.02x)"
    )
    assert "kvroute --processes 2 300 us, sglang-router 210 us (1.43x)" in notes[1]
    assert notes[2].startswith(
        "streamed answers: kvroute / sglang-router throughput ratio: 2.58 (latency-bound, not "
        "capacity: the CPU per request would give 0.98x; at concurrency 32"
    )
    assert "sglang-router adds 41.46 ms at p50 to a streamed answer, kvroute 0.28 ms)" in notes[2]
    assert "ratio: 2.49 (latency-bound" in notes[3] and len(notes) == 4
    # a ratio the CPU per request explains is left plain
    even = _streamed_notes(
        args,
        {"kvroute": 2000.0, "sglang-router": 1000.0},
        {"kvroute": 100.0, "sglang-router": 200.0},
    )
    assert even[1] == "streamed answers: kvroute / sglang-router throughput ratio: 2.00"
