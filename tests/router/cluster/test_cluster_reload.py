"""A reload on one replica changes the fleet of every replica (the admin API's path)."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from router.cluster.server import NatsServer
from router.config import RouterConfig
from router.http.reload import ConfigSource
from router.service import RouterService
from tests.router.cluster.conftest import admin, replica_config, workers
from tests.router.conftest import eventually


async def _ids(session: aiohttp.ClientSession, router: RouterService) -> set[str]:
    status, listed = await admin(session, router, "GET", "/workers")
    assert status == 200, listed
    return {w["id"] for w in listed["workers"]}


async def test_a_reload_on_one_replica_reaches_every_replica(nats_server: NatsServer) -> None:
    async with workers(3) as (w0, w1, w2), aiohttp.ClientSession() as session:
        before = [("w0", w0.url), ("w1", w1.url)]
        file: dict[str, RouterConfig] = {"a": replica_config(before, nats_server.url, "a")}
        source = ConfigSource("a.toml", lambda: file["a"])
        async with (
            RouterService(file["a"], config_source=source) as a,
            RouterService(replica_config(before, nats_server.url, "b")) as b,
        ):
            after = [("w1", w1.url), ("w2", w2.url)]
            edited: Any = replica_config(after, nats_server.url, "a")
            file["a"] = msgspec.structs.replace(edited, cluster=file["a"].cluster)
            status, answer = await admin(session, a, "POST", "/reload")
            assert status == 200, answer
            assert (answer["workers_added"], answer["workers_removed"]) == (["w2"], ["w0"])
            assert answer["needs_restart"] == []
            assert await _ids(session, a) == {"w1", "w2"}

            async def agreed() -> bool:
                return await _ids(session, b) == {"w1", "w2"}

            await eventually(agreed, what="replica b to apply a's reload")
