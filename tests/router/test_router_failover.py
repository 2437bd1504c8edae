"""A worker process killed mid-request: retried elsewhere, and the worker leaves rotation."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from router.service import RouterService
from tests.router.conftest import AUTH, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

# a reference worker in its own process, slow enough (20 ms per output token) to be killed
# while a request is in flight
_WORKER = """
import asyncio
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

async def main():
    async with ReferenceWorker(WorkerConfig(decode_ms_per_token=20.0)) as worker:
        print(worker.url, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
async def doomed() -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WORKER, stdout=asyncio.subprocess.PIPE, cwd=os.getcwd()
    )
    assert proc.stdout is not None
    try:
        url = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        assert url.startswith("http://"), url
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_a_killed_worker_is_retried_elsewhere_and_leaves_rotation(
    doomed: tuple[asyncio.subprocess.Process, str],
) -> None:
    proc, doomed_url = doomed
    async with ReferenceWorker(ReferenceConfig(time_scale=0.0)) as survivor:
        config = router_config([("doomed", doomed_url), ("survivor", survivor.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def admin(method: str, path: str, body: object = None) -> object:
                async with session.request(
                    method, router.url + "/admin" + path, json=body, headers=AUTH
                ) as resp:
                    assert resp.status == 200
                    return await resp.json()

            # steer the next request to the doomed worker, then let the survivor take traffic
            await admin("POST", "/workers/survivor/drain")
            body = {"prompt": "a long answer please", "max_tokens": 200, "cache_salt": "t"}
            request = asyncio.create_task(session.post(router.url + "/v1/completions", json=body))

            async def in_flight() -> bool:
                return router.planner.load.of("doomed").running == 1

            await eventually(in_flight, what="the request to be in flight on the doomed worker")
            await admin("POST", "/workers/survivor/drain", {"drain": False})
            proc.send_signal(signal.SIGKILL)

            async with await asyncio.wait_for(request, 30) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-worker"] == "survivor"
                answer = await resp.json()
            assert answer["usage"]["completion_tokens"] == 200

            workers = await admin("GET", "/workers")
            status = {w["id"]: w["status"] for w in workers["workers"]}  # type: ignore[index]
            assert status["doomed"] in ("circuit_open", "unhealthy")
            for _ in range(3):
                async with session.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.headers["x-kvroute-worker"] == "survivor"

            async def marked_unhealthy() -> bool:
                return not router.planner.pool.get("doomed").healthy

            await eventually(marked_unhealthy, what="health checks to fail the killed worker")
