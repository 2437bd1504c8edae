"""`policy.hold_until_room` end to end: a small reference worker behind a real router.

Two requests fill most of the worker's KV pool while they decode; a third does not fit beside
them. Without holding, the router sends it and it waits in the worker's queue; with holding, it
waits in the router (the worker's queue stays empty) and goes when one of the two ends.
`limits.max_held_requests = 0` turns holding off in practice: the control that the situation
really arises, and the cap, are the same test. Held requests go first come, first served (over
the cap too), and one held to its deadline is answered without anything committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from router.config import LimitsConfig, PolicyConfig, RouterConfig, TimeoutsConfig
from router.http.reload import ConfigSource
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
async def _fleet(
    hold: bool, max_held: int, *, request_s: float = 300.0, source: list[RouterConfig] | None = None
) -> AsyncIterator[tuple[Fleet, ReferenceWorker]]:
    """One reference worker behind a router; `source`, when given, gets the config, and a
    reload reads its last element (`RouterService.reload`)."""
    async with ReferenceWorker(CFG) as w0:
        config = router_config(
            [("w0", w0.url)],
            policy=PolicyConfig(hold_until_room=hold),
            limits=LimitsConfig(max_held_requests=max_held),
            timeouts=TimeoutsConfig(request_s=request_s),
        )
        configs = source if source is not None else []
        configs.append(config)
        reads = ConfigSource("test", lambda: configs[-1])
        async with (
            RouterService(config, config_source=reads) as router,
            aiohttp.ClientSession() as session,
        ):
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


async def _total(fleet: Fleet, name: str) -> float:
    """The sum of a family's samples, whatever their labels."""
    async with fleet.session.get(fleet.url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def _metric_is(fleet: Fleet, name: str, value: float) -> bool:
    return await _metric(fleet, name) == value


async def test_a_pair_is_held_until_its_prefill_side_has_room() -> None:
    """Prefill/decode: the prefill side (where the prefix is reused) is held for, as one
    worker is; two slow prefills fill its pool, the third pair waits in the router."""
    from tests.router.test_router_pd import reference, warm

    # each prefill takes about 1.5 s: the third pair is held only until one of them ends, and
    # at 3 ms a token (0.4 s) a loaded CI machine once polled the gauge too late to see it held
    slow = {"capacity_tokens": 24 * PAGE, "time_scale": 1.0, "prefill_ms_per_token": 12.0}
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


async def test_a_newer_request_that_fits_waits_behind_an_older_held_one() -> None:
    """First come, first served, as the worker's own queue admits: a small request that would
    fit beside the running ones does not take the room the held request before it waits for
    (it did, and a stream of them kept the older one waiting to its deadline)."""
    async with _fleet(True, 1024) as (fleet, w0):
        first = [asyncio.create_task(fleet.post("/generate", prompt(i))) for i in (1, 2)]
        await eventually(lambda: _load_is(w0, 2, 0), what="two requests running")
        older = asyncio.create_task(fleet.post("/generate", prompt(3)))
        await eventually(
            lambda: _metric_is(fleet, "kvroute_holding_requests", 1.0), what="it is held"
        )
        # 40 tokens and 20 of output: room beside the two running (the 129-token one has none)
        small = {"input_ids": [7] * 40, "sampling_params": {"max_new_tokens": 20}}
        assert (await fleet.route(small))["candidates"][0]["room"] is True
        newer = asyncio.create_task(fleet.post("/generate", small))

        async def placed() -> bool:
            held = await _metric(fleet, "kvroute_holding_requests")
            return held == 2.0 or w0.ranks[0].load != (2, 0)

        await eventually(placed, what="the small request held or sent")
        assert await _metric(fleet, "kvroute_holding_requests") == 2.0
        assert w0.ranks[0].load == (2, 0)  # it waits behind the older one, in the router
        for task in [*first, older, newer]:
            status, _, _ = await task
            assert status == 200


async def test_held_requests_over_the_cap_are_served_in_order_not_starved() -> None:
    """Steady load over `limits.max_held_requests`: a request over the cap lets the oldest held
    one go (the worker queues it) and waits in its place. Requests over the cap used to go
    straight to the worker, which counted them as in flight: the held request saw no room for
    as long as they came, and got 504 at its deadline while newer ones were served."""
    async with _fleet(True, 1, request_s=4.0) as (fleet, w0):
        served: list[tuple[float, float, int]] = []  # (sent, answered, status), the clients'
        stop = asyncio.Event()
        numbers = iter(range(10, 200))

        async def client() -> None:
            while not stop.is_set():
                sent = time.monotonic()
                status, _, _ = await fleet.post("/generate", prompt(next(numbers)))
                served.append((sent, time.monotonic(), status))

        # two clients in a loop fill the worker; the request held next is the one watched;
        # two more clients in a loop come over the cap behind it, for as long as it waits
        clients = [asyncio.create_task(client()) for _ in range(2)]
        await eventually(lambda: _load_is(w0, 2, 0), what="the worker full")
        held_at = time.monotonic()
        watched = asyncio.create_task(fleet.post("/generate", prompt(5)))
        await eventually(
            lambda: _metric_is(fleet, "kvroute_holding_requests", 1.0), what="it is held"
        )
        clients += [asyncio.create_task(client()) for _ in range(2)]
        status, _, answer = await watched
        answered = time.monotonic()
        stop.set()
        await asyncio.gather(*clients)
        assert status == 200, answer
        assert all(s == 200 for _, _, s in served)
        # first come, first served: no request sent after it was answered well before it
        overtook = [end - answered for sent, end, _ in served if sent > held_at and end < answered]
        assert min(overtook, default=0.0) > -0.1, overtook


async def test_a_request_held_to_its_deadline_is_answered_with_nothing_committed() -> None:
    """It was never sent: no worker is blamed, no pending marks or decision are left for the
    next request to follow, and no routed request is counted (the plan it waited on used to be
    committed before the deadline was checked)."""
    source: list[RouterConfig] = []
    async with _fleet(True, 1024, source=source) as (fleet, w0):
        long = [{**prompt(i), "sampling_params": {"max_new_tokens": 60}} for i in (1, 2)]
        first = [asyncio.create_task(fleet.post("/generate", body)) for body in long]
        await eventually(lambda: _load_is(w0, 2, 0), what="two requests running")
        routed = await _total(fleet, "kvroute_routed_requests_total")
        # a short deadline for the requests from now on (the two running keep theirs)
        source.append(msgspec.structs.replace(source[-1], timeouts=TimeoutsConfig(request_s=0.5)))
        await fleet.router.reload()
        status, _, answer = await fleet.post("/generate", prompt(3))
        assert status == 504
        assert answer["error"]["type"] == "HoldTimeoutError"
        assert "never sent" in answer["error"]["message"]
        assert w0.ranks[0].load == (2, 0)  # the worker never had it
        (only,) = (await fleet.route(prompt(3)))["candidates"]
        assert only["pending_tokens"] == 0 and only["matched_tokens"] == 0
        assert await _total(fleet, "kvroute_routed_requests_total") == routed
        for task in first:
            status, _, _ = await task
            assert status == 200
        assert await _metric(fleet, "kvroute_holding_requests") == 0.0


async def test_a_reload_that_turns_holding_off_lets_the_held_requests_go() -> None:
    """The operator turned holding off: the requests held already are sent at once (the
    worker queues them), not held on for room. Before, they went at the next poll of a held
    request (50 ms), and the docs said they stayed held."""
    source: list[RouterConfig] = []
    async with _fleet(True, 1024, source=source) as (fleet, w0):
        long = [{**prompt(i), "sampling_params": {"max_new_tokens": 60}} for i in (1, 2)]
        first = [asyncio.create_task(fleet.post("/generate", body)) for body in long]
        await eventually(lambda: _load_is(w0, 2, 0), what="two requests running")
        held = [asyncio.create_task(fleet.post("/generate", prompt(i))) for i in (3, 4)]
        await eventually(
            lambda: _metric_is(fleet, "kvroute_holding_requests", 2.0), what="two held"
        )
        policy = msgspec.structs.replace(source[-1].policy, hold_until_room=False)
        source.append(msgspec.structs.replace(source[-1], policy=policy))
        diff = await fleet.router.reload()
        assert diff.changed == ["policy.hold_until_room"], diff
        assert await _metric(fleet, "kvroute_holding_requests") == 0.0  # let go by the reload
        await eventually(lambda: _load_is(w0, 2, 2), what="both queue at the worker")
        for task in [*first, *held]:
            status, _, _ = await task
            assert status == 200
        assert await _metric(fleet, "kvroute_held_requests_total") == 2.0


async def test_a_held_request_its_client_abandoned_is_counted() -> None:
    """A client that gives up while its request is held (the fleet is full) never reached a
    worker: it is counted with the requests the router ended itself, as ClientClosedRequest
    (499), not lost from the metrics."""
    async with _fleet(True, 1024) as (fleet, w0):
        first = [asyncio.create_task(fleet.post("/generate", prompt(i))) for i in (1, 2)]
        await eventually(lambda: _load_is(w0, 2, 0), what="two requests running")
        third = asyncio.create_task(fleet.post("/generate", prompt(3)))
        await eventually(
            lambda: _metric_is(fleet, "kvroute_holding_requests", 1.0), what="it is held"
        )
        third.cancel()  # the client closes its connection
        with contextlib.suppress(asyncio.CancelledError):
            await third
        name = 'kvroute_rejected_requests_total{endpoint="/generate",error="ClientClosedRequest"'

        async def counted() -> bool:
            return await _total(fleet, name) == 1.0

        await eventually(counted, what="the abandoned one counted")
        assert await _metric(fleet, "kvroute_holding_requests") == 0.0
        for task in first:
            status, _, _ = await task
            assert status == 200
        assert w0.ranks[0].load == (0, 0)


async def test_a_held_request_whose_worker_is_drained_is_told_so() -> None:
    """The worker a request waits for is drained (the model's only one): the request is
    refused, and its 503 says the worker is draining (it said "no routable worker among 1", as
    if the fleet were gone)."""
    async with _fleet(True, 1024) as (fleet, w0):
        long = [{**prompt(i), "sampling_params": {"max_new_tokens": 60}} for i in (1, 2)]
        first = [asyncio.create_task(fleet.post("/generate", body)) for body in long]
        await eventually(lambda: _load_is(w0, 2, 0), what="two requests running")
        third = asyncio.create_task(fleet.post("/generate", prompt(3)))
        await eventually(
            lambda: _metric_is(fleet, "kvroute_holding_requests", 1.0), what="it is held"
        )
        assert (await fleet.admin("POST", "/workers/w0/drain"))[0] == 200
        status, _, answer = await third
        assert status == 503
        assert answer["error"]["message"] == "no routable worker among 1: 1 draining"
        assert w0.ranks[0].load == (2, 0)  # the worker never had it
        for task in first:
            status, _, _ = await task
            assert status == 200
