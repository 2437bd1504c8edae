"""A reload on one replica changes the fleet of every replica (the admin API's path)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any
from unittest.mock import ANY

import aiohttp
import msgspec

from router.cluster.server import NatsServer
from router.config import HealthConfig, RouterConfig
from router.http.reload import ConfigSource
from router.service import RouterService
from tests.router.cluster.conftest import admin, replica_config, workers
from tests.router.conftest import DiscoveryGate, eventually
from workers.config import DEFAULT_MODEL


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


class _Turnstile(DiscoveryGate):
    """A worker's HTTP API passed through; once `close`d, each `/server_info` ask waits for a
    `let_one` (a discovery of this replica or of that one, in the order they ask)."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.open.set()
        self._turns = asyncio.Semaphore(0)

    def close(self) -> None:
        self.open.clear()

    def let_one(self) -> None:
        self._turns.release()

    async def _held(self) -> None:
        if not self.open.is_set():
            await self._turns.acquire()

    async def __aexit__(self, *exc: object) -> None:
        for _ in range(8):
            self._turns.release()
        await super().__aexit__(*exc)


async def _complete(session: aiohttp.ClientSession, router: RouterService) -> tuple[int, Any]:
    body = {"model": DEFAULT_MODEL, "prompt": "renamed under traffic " * 6, "max_tokens": 1}
    async with session.post(router.url + "/v1/completions", json=body) as resp:
        answer = await resp.json(content_type=None)
        return resp.status, (resp.headers.get("x-kvroute-worker"), answer)


async def test_a_rename_on_one_replica_fails_no_request_on_another(
    nats_server: NatsServer,
) -> None:
    """The QA run: replica a's reload renames the worker (its server under a new id) while
    clients send to replica b. Before, b read the old id's removal first and the new id only
    once a had registered it: b's requests of that gap got 404s listing no model, then 503s
    while b checked the new id. Now a tells the new id first; b hands the server to it in one
    change, which its requests wait out."""
    health = HealthConfig(interval_s=0.2, timeout_s=3.0)  # the adds wait 6 s for the gate
    async with (
        workers(1) as (w,),
        _Turnstile(w.url) as gate,
        aiohttp.ClientSession() as session,
    ):
        before = [("w0", gate.url)]
        file = {"a": replica_config(before, nats_server.url, "a", health=health)}
        source = ConfigSource("a.toml", lambda: file["a"])
        async with (
            RouterService(file["a"], config_source=source) as a,
            RouterService(replica_config(before, nats_server.url, "b", health=health)) as b,
        ):
            assert await _complete(session, b) == (200, ("w0", ANY))
            gate.close()
            asked = gate.info_asked
            renamed: Any = replica_config([("x0", gate.url)], nats_server.url, "a", health=health)
            file["a"] = msgspec.structs.replace(renamed, cluster=file["a"].cluster)
            reload = asyncio.create_task(admin(session, a, "POST", "/reload"))

            def asked_again(times: int) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return gate.info_asked >= asked + times

                return check

            # a discovers x0 (held): b keeps serving by w0, which a told nobody is gone
            await eventually(asked_again(1), what="a's discovery of x0")
            status, (worker, answer) = await _complete(session, b)
            assert (status, worker) == (200, "w0"), answer
            gate.let_one()
            # b reads x0's record: w0 handed over, x0 discovered (held): b's requests wait
            await eventually(asked_again(2), what="b's discovery of x0")
            sent = [asyncio.create_task(_complete(session, b)) for _ in range(3)]
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in sent), [t.result() for t in sent if t.done()]
            gate.let_one()
            for status, (worker, answer) in await asyncio.gather(*sent):
                assert (status, worker) == (200, "x0"), answer
            status, answer = await reload
            assert status == 200, answer
            assert (answer["workers_added"], answer["workers_removed"]) == (["x0"], ["w0"])
            assert await _ids(session, b) == {"x0"}
