"""`policy.hold_until_room` end to end: a small reference worker behind a real router.

Two requests fill most of the worker's KV pool while they decode; a third does not fit beside
them. Without holding, the router sends it and it waits in the worker's queue; with holding, it
waits in the router (the worker's queue stays empty) and goes when one of the two ends.
`limits.max_held_requests = 0` turns holding off in practice: the control that the situation
really arises, and the cap, are the same test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.config import LimitsConfig, PolicyConfig
from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 16
CFG = ReferenceConfig(
    page_size=PAGE,
    capacity_tokens=24 * PAGE,
    max_running_requests=4,  # the pool, not the running cap, is what fills up
    prefill_ms_per_token=0.01,
    decode_ms_per_token=25.0,  # 20 output tokens: each request runs about half a second
    time_scale=1.0,
)


def prompt(i: int) -> dict[str, Any]:
    """8 pages and a token of its own, 20 output tokens: 10 of the pool's 24 pages."""
    ids = [(i * 37 + k) % 200 + 3 for k in range(8 * PAGE + 1)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 20}}


@contextlib.asynccontextmanager
async def _fleet(hold: bool, max_held: int) -> AsyncIterator[tuple[Fleet, ReferenceWorker]]:
    async with ReferenceWorker(CFG) as w0:
        config = router_config(
            [("w0", w0.url)],
            policy=PolicyConfig(hold_until_room=hold),
            limits=LimitsConfig(max_held_requests=max_held),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            await eventually(lambda: _capacity_known(fleet), what="the worker's capacity")
            yield fleet, w0


async def _capacity_known(fleet: Fleet) -> bool:
    plan = await fleet.route(prompt(99))
    (only,) = plan["candidates"]
    return bool(only["admission"]["capacity_tokens"] == 24 * PAGE)


async def _metric(fleet: Fleet, name: str) -> float:
    async with fleet.session.get(fleet.url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def _load_is(w0: ReferenceWorker, running: int, waiting: int) -> bool:
    return w0.ranks[0].load == (running, waiting)


@pytest.mark.parametrize(("hold", "max_held"), [(True, 1024), (True, 0), (False, 1024)])
async def test_a_request_without_room_waits_in_the_router_not_in_the_worker(
    hold: bool, max_held: int
) -> None:
    holds = hold and max_held > 0
    async with _fleet(hold, max_held) as (fleet, w0):
        first = [asyncio.create_task(fleet.post("/generate", prompt(i))) for i in (1, 2)]
        await eventually(lambda: _load_is(w0, 2, 0), what="two requests running")
        third = asyncio.create_task(fleet.post("/generate", prompt(3)))
        if holds:
            await eventually(
                lambda: _metric_is(fleet, "kvroute_holding_requests", 1.0), what="it is held"
            )
            assert w0.ranks[0].load == (2, 0)  # the worker's queue stays empty
        else:
            # sent at once, it waits in the worker's queue for pages
            await eventually(lambda: _load_is(w0, 2, 1), what="it queues at the worker")
        for task in [*first, third]:
            status, _, answer = await task
            assert status == 200 and len(answer["output_ids"]) == 20
        assert await _metric(fleet, "kvroute_held_requests_total") == (1.0 if holds else 0.0)
        assert await _metric(fleet, "kvroute_holding_requests") == 0.0


async def _metric_is(fleet: Fleet, name: str, value: float) -> bool:
    return await _metric(fleet, name) == value


async def test_a_pair_is_held_until_its_prefill_side_has_room() -> None:
    """Prefill/decode: the prefill side (where the prefix is reused) is held for, as one
    worker is; two slow prefills fill its pool, the third pair waits in the router."""
    from tests.router.test_router_pd import reference, warm

    slow = {"capacity_tokens": 24 * PAGE, "time_scale": 1.0, "prefill_ms_per_token": 3.0}
    async with (
        ReferenceWorker(reference("prefill", **slow)) as p0,
        ReferenceWorker(reference("decode", capacity_tokens=64 * PAGE)) as d0,
    ):
        config = router_config(
            [("p0", p0.url), ("d0", d0.url)], policy=PolicyConfig(hold_until_room=True)
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await warm(session, router, [p0], [d0])
            fleet = Fleet(router, {"p0": p0, "d0": d0}, session)
            bodies = [{**prompt(i), "sampling_params": {"max_new_tokens": 2}} for i in (4, 5, 6)]
            # 8 pages and a token each (a prefill makes one token): two fit 24 pages, three not
            first = [asyncio.create_task(fleet.post("/generate", b)) for b in bodies[:2]]
            await eventually(lambda: _at_prefill(p0, 2), what="two prefills at the worker")
            third = asyncio.create_task(fleet.post("/generate", bodies[2]))
            await eventually(
                lambda: _metric_is(fleet, "kvroute_holding_requests", 1.0), what="it is held"
            )
            assert sum(p0.ranks[0].load) == 2  # the third is not at the prefill worker
            for task in [*first, third]:
                status, headers, _ = await task
                assert status == 200 and headers["x-kvroute-prefill-worker"] == "p0"
            assert await _metric(fleet, "kvroute_held_requests_total") == 1.0


async def _at_prefill(p0: ReferenceWorker, requests: int) -> bool:
    return sum(p0.ranks[0].load) == requests  # running (prefilling) or waiting for a step


async def test_a_held_request_counts_as_queued_on_the_rank_it_waits_for() -> None:
    """The score of every other request sees a held request where it waits, as it would see
    it in the worker's queue: without that, each new request would find the rank idle, pick it
    and be held behind. Each prompt is 129 tokens the worker does not hold."""
    async with _fleet(True, 1024) as (fleet, w0):
        first = [asyncio.create_task(fleet.post("/generate", prompt(i))) for i in (1, 2)]
        await eventually(lambda: _load_is(w0, 2, 0), what="two requests running")
        # the two sent ones count their prompts until their (non-streamed) answers
        assert await _queued(fleet) == 2 * 129
        third = asyncio.create_task(fleet.post("/generate", prompt(3)))
        await eventually(
            lambda: _metric_is(fleet, "kvroute_holding_requests", 1.0), what="it is held"
        )
        assert await _queued(fleet) == 3 * 129
        for task in [*first, third]:
            status, _, _ = await task
            assert status == 200
        assert await _queued(fleet) == 0  # nothing held or in flight is left counted


async def _queued(fleet: Fleet) -> int:
    plan = await fleet.route(prompt(99))
    (only,) = plan["candidates"]
    return int(only["queued_prefill_tokens"])
