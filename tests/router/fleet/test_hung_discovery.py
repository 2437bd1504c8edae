"""A worker that answers its health check but never its `/server_info` holds nothing up.

Discovery of such a worker runs to its timeout (five health timeouts, on both SGLang paths).
Before, the router's startup awaited it (it listened, and Ctrl-C took effect, only after), and
every health round awaited it again, so the other workers' health went unchecked meanwhile.
Real servers on 127.0.0.1: a reference worker and a small aiohttp server that hangs.
"""

from __future__ import annotations

import asyncio
import time

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


def _quiet_router(health: HealthConfig) -> RouterService:
    """A router of no workers (its first health round is done before it listens)."""
    return RouterService(msgspec.structs.replace(router_config([]), health=health, workers=()))


async def test_an_admin_add_of_a_hung_worker_answers_within_the_bound_and_goes_on() -> None:
    """A worker that accepts and never answers its settings: the admin add answers 202 after
    `ADD_WAIT_TIMEOUTS` health timeouts, the worker `checking`, saying why; its discovery goes
    on in the background, one at a time (the rounds start none beside it), and reads the
    server info once. Before, the add answered after the whole discovery: 40 s at the default
    timeouts with its events spelled out (both server-info paths twice, then /v1/models)."""
    health = HealthConfig(interval_s=0.1, timeout_s=0.3)  # 1.5 s a path, 0.6 s for the add
    async with (
        HungDiscovery() as hung,
        _quiet_router(health) as router,
        aiohttp.ClientSession() as session,
    ):
        fleet = Fleet(router, {}, session)
        explicit = {
            "id": "ex",
            "url": hung.url,
            "events": "tcp://127.0.0.1:9",
            "replay": "tcp://127.0.0.1:10",
            "block_size": 16,
        }
        started = time.monotonic()
        status, added = await fleet.admin("POST", "/workers", explicit)
        took = time.monotonic() - started
        assert status == 202, added
        assert took < 4 * health.timeout_s, took  # 0.6 s and the answer's own time
        assert (added["id"], added["status"], added["discovered"]) == ("ex", "checking", False)
        assert "still being discovered" in added["not_registered"], added
        assert "0.6 s" in added["not_registered"], added

        await asyncio.sleep(5 * health.interval_s)  # rounds probe it, and leave it be
        assert hung.health_asked >= 1
        assert hung.asked.get("/server_info") == 1, hung.asked  # one discovery at a time
        _, listed = await fleet.admin("GET", "/workers")
        assert [(w["id"], w["status"]) for w in listed["workers"]] == [("ex", "checking")]

        # a worker that definitely fails is refused as before, and leaves nothing behind
        refused = {**explicit, "id": "gone", "url": "http://127.0.0.1:9"}
        status, answer = await fleet.admin("POST", "/workers", refused)
        assert status == 400 and "v1/models" in answer["error"]["message"], answer
        _, listed = await fleet.admin("GET", "/workers")
        assert [w["id"] for w in listed["workers"]] == ["ex"]


async def test_a_registration_reads_the_server_info_once() -> None:
    """The settings of a worker whose events are spelled out were read, and when they did not
    answer, read again for its role: a hung worker's registration took two more paths' worth
    of timeouts. Rounds far apart: nothing but the add's discovery asks anything."""
    health = HealthConfig(interval_s=60.0, timeout_s=0.1)  # 0.5 s a path
    async with (
        HungDiscovery() as hung,
        _quiet_router(health) as router,
        aiohttp.ClientSession() as session,
    ):
        fleet = Fleet(router, {}, session)
        explicit = {"id": "ex", "url": hung.url, "events": "tcp://127.0.0.1:9", "block_size": 16}
        status, added = await fleet.admin("POST", "/workers", explicit)
        assert status == 202, added
        supervisor = router.app[SUPERVISOR]

        async def refused() -> bool:
            return supervisor.refusal("ex") is not None

        await eventually(refused, timeout_s=5.0, what="the background discovery's refusal")
        assert "/v1/models: no answer within 0.5 s" in (supervisor.refusal("ex") or "")
        assert hung.asked == {"/server_info": 1, "/get_server_info": 1, "/v1/models": 1}
        assert not supervisor.discovering("ex")
        # the health rounds decide from here, as for a worker of the config
        assert supervisor.not_registered("ex") == supervisor.refusal("ex")


async def test_a_background_discovery_ends_with_the_router() -> None:
    """Owned: the router's shutdown cancels an added worker's discovery under way, and waits
    for nothing of it."""
    health = HealthConfig(interval_s=0.1, timeout_s=1.0)  # 5 s a path
    async with HungDiscovery() as hung:
        async with _quiet_router(health) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {}, session)
            status, added = await fleet.admin("POST", "/workers", {"id": "h", "url": hung.url})
            assert status == 202, added
            supervisor = router.app[SUPERVISOR]
            assert supervisor.discovering("h")
            stopping = time.monotonic()
        assert time.monotonic() - stopping < health.timeout_s
        assert not supervisor.discovering("h")
        assert hung.asked == {"/server_info": 1}  # cancelled on its first path
