"""A health check that the router's own stall expired is made again, not failed.

Real servers on 127.0.0.1: a reference worker behind a pass-through whose `/health` may stop
the whole process for a while (a synchronous sleep: the router's loop stops with it, as in a
long GC pass or a CPU-starved process), or hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from router.config import HealthConfig
from router.late_timeout import LATE_S
from router.service import RouterService
from tests.router.conftest import WorkerPassThrough, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

HEALTH = HealthConfig(interval_s=0.2, timeout_s=0.5)
WENT_DOWN = "is now unhealthy"


class HealthFaults(WorkerPassThrough):
    """The worker's API passed through; its next health checks may stall the loop or hang."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.stalls = 0  # the next this many health checks stop the process first
        self.hang = False  # health checks hang (the worker's process is stuck)
        self.done = asyncio.Event()  # a stalled check went through

    async def _before(self, request: web.Request) -> None:
        if request.path != "/health":
            return
        if self.stalls:
            self.stalls -= 1
            time.sleep(1.0)  # noqa: ASYNC251 - the stall under test: every task stops
            self.done.set()
        if self.hang:
            await asyncio.sleep(30)


async def _health(session: aiohttp.ClientSession, router: RouterService) -> int:
    async with session.get(router.url + "/health") as resp:
        return resp.status


async def _rounds(router: RouterService, session: aiohttp.ClientSession, count: int) -> None:
    """Wait through `count` health rounds, the router answering 200 throughout."""
    for _ in range(count):
        await asyncio.sleep(HEALTH.interval_s)
        assert await _health(session, router) == 200


@contextlib.asynccontextmanager
async def _fleet() -> AsyncIterator[tuple[HealthFaults, RouterService, aiohttp.ClientSession]]:
    """A reference worker behind `HealthFaults`, its router past two health rounds."""
    async with (
        ReferenceWorker(ReferenceConfig(time_scale=0.0)) as worker,
        HealthFaults(worker.url) as faults,
        RouterService(router_config([("w0", faults.url)], health=HEALTH)) as router,
        aiohttp.ClientSession() as session,
    ):
        await _rounds(router, session, 2)
        yield faults, router, session


async def test_a_stall_of_the_routers_loop_takes_no_healthy_worker_out_of_rotation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A check in flight when the process stopped for 1 s expired as it came back (its timer
    ran before the task the answer woke): the worker went unhealthy, and alone in the fleet,
    the router answered 503 for a stall of its own. Its check is made again now."""
    caplog.set_level(logging.DEBUG, logger="router.fleet")
    async with _fleet() as (faults, router, session):
        faults.stalls = 1
        await asyncio.wait_for(faults.done.wait(), 5)
        await _rounds(router, session, 3)
    assert not [r for r in caplog.records if WENT_DOWN in r.getMessage()]
    again = [r.getMessage() for r in caplog.records if "checked again" in r.getMessage()]
    assert len(again) == 1 and "health check of w0 expired" in again[0], again
    late_ms = float(again[0].split("ran ")[1].split(" ms")[0])
    assert late_ms >= LATE_S * 1e3


async def test_a_hung_worker_is_still_found_across_a_stall(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The check made again is no second chance for a worker that does not answer: it times
    out on time, and the worker goes unhealthy."""
    caplog.set_level(logging.DEBUG, logger="router.fleet")
    async with _fleet() as (faults, router, session):
        faults.hang = True
        faults.stalls = 1
        started = time.monotonic()

        async def down() -> bool:
            return await _health(session, router) == 503

        await eventually(down, 10, "the hung worker out of rotation")
        took = time.monotonic() - started
    messages = [r.getMessage() for r in caplog.records]
    assert sum("checked again" in m for m in messages) == 1, messages
    assert any("w0 is now unhealthy" in m for m in messages), messages
    # the stall, the late check and the one made again: a few seconds, not the hang's 30
    assert took < 5.0, took
