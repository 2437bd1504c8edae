"""A worker that answers its health check but never its `/server_info` holds nothing up.

Discovery of such a worker runs to its timeout (five health timeouts, on both SGLang paths).
Before, the router's startup awaited it (it listened, and Ctrl-C took effect, only after), and
every health round awaited it again, so the other workers' health went unchecked meanwhile.
Real servers on 127.0.0.1: a reference worker and a small aiohttp server that hangs.
"""

from __future__ import annotations

import aiohttp
import msgspec
import pytest

from indexer.engines import engine_spec
from router.config import HealthConfig, WorkerConfig
from router.errors import RequestError
from router.fleet.worker_settings import read_served_models, read_server_info
from router.http.keys import SUPERVISOR
from router.service import RouterService
from tests.router.conftest import Fleet, HungDiscovery, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


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


async def test_a_discovery_that_times_out_says_so_and_after_how_long() -> None:
    """Before, the reason read "/get_server_info: TimeoutError: " (a timeout's text is empty):
    nothing said the worker was slow rather than broken, nor how long it was given."""
    async with HungDiscovery() as hung, aiohttp.ClientSession() as session:
        with pytest.raises(RequestError) as refused:
            await read_server_info(session, hung.url, timeout_s=0.2)
        assert hung.info_asked == 2  # both SGLang paths
        message = str(refused.value)
        assert message.endswith("/get_server_info: no answer within 0.2 s (timed out)"), message
        worker = WorkerConfig(url=hung.url, id="hung", kv_events=False)
        with pytest.raises(RequestError, match=r"/v1/models: no answer within 0\.2 s"):
            await read_served_models(session, worker, engine_spec("vllm"), None, timeout_s=0.2)
