"""Admission-time prediction end to end: a small reference worker behind a real router.

A prompt is cached; then requests for two other prompts queue behind a long-running one, and
their allocations will push the first prompt out before the worker admits it again. The index
still holds it when that request is routed (the raw match), but the router predicts what the
worker will hold at admission, and that equals the worker-reported `cached_tokens`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 16


def prompt(i: int, pages: int = 8, out: int = 1) -> dict[str, Any]:
    """A prompt of `pages` pages and a token, sharing no page with the others."""
    ids = [(i * 37 + k) % 200 + 3 for k in range(pages * PAGE + 1)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": out}}


async def test_the_prediction_at_admission_equals_what_the_worker_reuses() -> None:
    cfg = ReferenceConfig(
        page_size=PAGE,
        capacity_tokens=24 * PAGE,
        max_running_requests=1,  # one at a time: the others wait in the worker's queue
        prefill_ms_per_token=0.01,
        decode_ms_per_token=40.0,
        time_scale=1.0,
    )
    async with ReferenceWorker(cfg) as w0:
        config = router_config([("w0", w0.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            w0.flush_all()  # the warm-up pokes went around the router: start empty
            await eventually(lambda: _empty(fleet), what="the flush to reach the index")
            await _admission_case(fleet, w0)


async def _empty(fleet: Fleet) -> bool:
    plan = await fleet.route(prompt(99))
    (only,) = plan["candidates"]
    return bool(only["admission"]["held_tokens"] == 0)


async def _admission_case(fleet: Fleet, w0: ReferenceWorker) -> None:
    a = prompt(0)
    status, headers, answer = await fleet.post("/generate", a)
    assert status == 200
    assert answer["meta_info"]["cached_tokens"] == 0
    await eventually(lambda: fleet.holds(a, "w0", 8 * PAGE), what="prompt A indexed")

    # a long request runs (max_running_requests = 1), and B and C queue behind it
    long_one = asyncio.create_task(fleet.post("/generate", prompt(1, pages=2, out=60)))
    await eventually(lambda: _queued(w0, running=1, waiting=0), what="the long request to run")
    queued = [asyncio.create_task(fleet.post("/generate", prompt(i))) for i in (2, 3)]
    await eventually(lambda: _queued(w0, running=1, waiting=2), what="B and C to queue")

    # A is still held now, but B and C will have evicted it when A is admitted again
    plan = await fleet.route(a)
    (only,) = plan["candidates"]
    forecast = only["admission"]
    assert only["matched_tokens"] == 8 * PAGE  # the raw match, per the events
    assert forecast["raw_tokens"] == 8 * PAGE and forecast["kept_tokens"] == 0
    assert forecast["capacity_tokens"] == 24 * PAGE
    assert "evicted least recently used first" in forecast["why"]

    status, headers, answer = await fleet.post("/generate", a)
    assert status == 200
    assert int(headers["x-kvroute-raw-matched-tokens"]) == 8 * PAGE
    predicted = int(headers["x-kvroute-matched-tokens"]) + int(headers["x-kvroute-pending-tokens"])
    assert predicted == answer["meta_info"]["cached_tokens"] == 0
    for task in [long_one, *queued]:
        status, _, _ = await task
        assert status == 200

    # with nothing queued, A (cached again by its last request) is predicted in full, once its
    # events are in (on a loaded machine they may trail the answer)
    await eventually(lambda: fleet.holds(a, "w0", 8 * PAGE), what="prompt A indexed again")
    status, headers, answer = await fleet.post("/generate", a)
    assert status == 200
    predicted = int(headers["x-kvroute-matched-tokens"])
    assert predicted == answer["meta_info"]["cached_tokens"] == 8 * PAGE


async def _queued(w0: ReferenceWorker, *, running: int, waiting: int) -> bool:
    return w0.ranks[0].load == (running, waiting)
