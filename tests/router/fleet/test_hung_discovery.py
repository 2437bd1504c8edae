"""A worker that answers its health check but never its `/server_info` holds nothing up.

Discovery of such a worker runs to its timeout (five health timeouts, on both SGLang paths).
Before, the router's startup awaited it (it listened, and Ctrl-C took effect, only after), and
every health round awaited it again, so the other workers' health went unchecked meanwhile.
Real servers on 127.0.0.1: a reference worker and a small aiohttp server that hangs.
"""

from __future__ import annotations

import asyncio
from typing import Self

import aiohttp
import msgspec
from aiohttp import web

from router.config import HealthConfig, WorkerConfig
from router.http.keys import SUPERVISOR
from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


class HungDiscovery:
    """Healthy, and never answers `/server_info` or `/get_server_info`."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.info_asked = 0
        self._release = asyncio.Event()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _hang(self, request: web.Request) -> web.Response:
        self.info_asked += 1
        await self._release.wait()  # until the test ends: the router gives up first
        return web.json_response({})

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._hang)
        app.router.add_get("/get_server_info", self._hang)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()


async def test_a_hung_discovery_neither_holds_the_startup_nor_the_health_rounds() -> None:
    health = HealthConfig(interval_s=0.1, timeout_s=0.4)  # discovery gives up after 2 s a path
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as good, HungDiscovery() as hung:
        config = msgspec.structs.replace(
            router_config([]),
            health=health,
            workers=(WorkerConfig(url=good.url, id="good"), WorkerConfig(url=hung.url, id="hung")),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"good": good}, session)
            supervisor = router.app[SUPERVISOR]
            # serving already, while the hung worker's discovery is still under way: not
            # refused yet (that comes when its timeouts run out), not registered
            assert hung.info_asked >= 1
            assert supervisor.refusal("hung") is None
            _, listed = await fleet.admin("GET", "/workers")
            discovered = {w["id"]: w["discovered"] for w in listed["workers"]}
            assert discovered == {"good": True, "hung": False}

            # the health rounds go on beside it: the good worker's death is seen within a
            # few rounds, not after the hung discovery's timeouts
            await good.__aexit__(None, None, None)

            async def good_is_down() -> bool:
                _, listed = await fleet.admin("GET", "/workers")
                return any(w["id"] == "good" and not w["healthy"] for w in listed["workers"])

            await eventually(good_is_down, timeout_s=1.5, what="the good worker's death seen")
            assert supervisor.refusal("hung") is None  # its discovery still hangs
