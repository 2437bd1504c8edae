"""Replicas share their routing decisions: pending marks and load, applied as they arrive."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from router.cluster.server import NatsServer
from router.service import RouterService
from tests.router.cluster.conftest import admin, replica_config, workers
from tests.router.conftest import eventually

# slow prefill: a request stays in flight long enough to be seen from the other replica
SLOW = {"time_scale": 1.0, "prefill_ms_per_token": 4.0}


def _body(prompt: str) -> dict[str, Any]:
    return {"text": prompt, "cache_salt": "tenant-a", "sampling_params": {"max_new_tokens": 2}}


async def _running(session: aiohttp.ClientSession, router: RouterService) -> dict[str, int]:
    status, listed = await admin(session, router, "GET", "/workers")
    assert status == 200, listed
    return {w["id"]: w["running"] for w in listed["workers"]}


async def test_a_request_on_one_replica_is_pending_and_running_on_the_others(
    nats_server: NatsServer,
) -> None:
    async with workers(2, **SLOW) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        async with (
            RouterService(replica_config(fleet, nats_server.url, "a")) as a,
            RouterService(replica_config(fleet, nats_server.url, "b")) as b,
        ):
            prompt = "a system prompt shared by a burst of sibling requests " * 3
            first = asyncio.create_task(_post(session, a, prompt))
            try:

                async def b_sees_it() -> bool:
                    plan = await _route(session, b, prompt)
                    running = await _running(session, b)
                    pending = {c["worker"]: c["pending_tokens"] for c in plan["candidates"]}
                    return any(pending[w] > 0 and running[w] == 1 for w in pending)

                await eventually(b_sees_it, what="replica b to see a's pending mark and load")
                # the sibling sent to b follows the first request to its worker
                second_worker = await _post(session, b, prompt + " and a question")
                assert second_worker == await first
            finally:
                first.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await first

            async def idle() -> bool:
                return set((await _running(session, b)).values()) == {0}

            await eventually(idle, what="a's requests to stop counting on b once they end")


async def _post(session: aiohttp.ClientSession, router: RouterService, prompt: str) -> str:
    async with session.post(router.url + "/generate", json=_body(prompt)) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-kvroute-worker"]


async def _route(session: aiohttp.ClientSession, router: RouterService, prompt: str) -> Any:
    status, plan = await admin(session, router, "POST", "/route?endpoint=/generate", _body(prompt))
    assert status == 200, plan
    return plan
