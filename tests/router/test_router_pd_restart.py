"""Prefill/decode workers restarted on the same URL: the pairs follow their new settings.

A prefill whose bootstrap port is left to the system (SGLang's default, the reference worker's
0) binds another one each start, and a process may come back as the other side of the pairs.
Reference workers behind a real router: a prefill restarted with a new bootstrap port, and a
prefill restarted as a decode.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from router.service import RouterService
from tests.router.conftest import AUTH, eventually, router_config
from tests.router.test_router_pd import PROMPT, reference
from workers.worker import ReferenceWorker

BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}


def _ports(worker: ReferenceWorker) -> dict[str, int]:
    """The ports a worker's successor takes again: HTTP, KV events and replay (not bootstrap)."""
    return {
        "port": int(worker.url.rsplit(":", 1)[1]),
        "events_port": int(worker.kv_events.endpoints[0].rsplit(":", 1)[1]),
        "replay_port": int(worker.kv_events.replay_endpoints[0].rsplit(":", 1)[1]),
    }


async def _generate(
    session: aiohttp.ClientSession, router: RouterService, n: int
) -> tuple[int, dict[str, str], Any]:
    """Request `n`: the shared prompt and a last token of its own."""
    body = {**BODY, "input_ids": [*PROMPT, 3 + n]}
    async with session.post(router.url + "/generate", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def _failures(router: RouterService) -> dict[str, int]:
    return {e.id: e.breaker.failures for e in router.planner.pool}


async def test_a_prefill_back_with_another_bootstrap_port_is_paired_on_it() -> None:
    """The health check sees the prefill down and back: its settings are read again, and its
    new bootstrap port is the one its pairs are told. Before, only capacity, concurrency and
    streams were read again: the old port stayed, and every pair through it failed (the
    decode's 502 `kv_transfer_failed`) until the worker was removed and added again."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        ports = _ports(p0)
        old = p0.disagg.bootstrap_port
        config = router_config([("p0", p0.url), ("d0", d0.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            entry = router.planner.pool.get("p0")
            assert entry.bootstrap_port == old
            status, _, answer = await _generate(session, router, 0)
            assert status == 200, answer
            await p0.__aexit__(None, None, None)

            async def down() -> bool:
                return not entry.healthy

            await eventually(down, what="its health check to fail")
            async with ReferenceWorker(reference("prefill", **ports)) as again:
                new = again.disagg.bootstrap_port
                assert new != old

                async def moved() -> bool:
                    return entry.bootstrap_port == new and entry.healthy

                await eventually(moved, what="its new bootstrap port to be taken")
                for i in range(3):
                    status, headers, answer = await _generate(session, router, 1 + i)
                    assert status == 200, answer
                    assert headers["x-kvroute-prefill-worker"] == "p0"
            assert _failures(router) == {"p0": 0, "d0": 0}


async def test_a_prefill_restarted_as_a_decode_is_listed_and_used_as_one() -> None:
    """A process back on a prefill's URL as a decode: listed and paired as a decode. Before,
    the router kept it a prefill (its `/admin/workers` said so) and sent it prefill legs."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode")) as d0,
    ):
        ports = _ports(p0)
        config = router_config([("p0", p0.url), ("p1", p1.url), ("d0", d0.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            entry = router.planner.pool.get("p0")
            await p0.__aexit__(None, None, None)

            async def down() -> bool:
                return not entry.healthy

            await eventually(down, what="its health check to fail")
            async with ReferenceWorker(reference("decode", **ports)):

                async def decode() -> bool:
                    return entry.role == "decode" and entry.healthy

                await eventually(decode, what="its new role to be taken")
                async with session.get(router.url + "/admin/workers", headers=AUTH) as resp:
                    listed = {w["id"]: w["role"] for w in (await resp.json())["workers"]}
                assert listed == {"p0": "decode", "p1": "prefill", "d0": "decode"}
                async with session.post(
                    router.url + "/admin/workers/d0/drain", headers=AUTH
                ) as resp:
                    assert resp.status == 200
                for i in range(2):  # d0 drained: the decode side is p0's
                    status, headers, answer = await _generate(session, router, 1 + i)
                    assert status == 200, answer
                    assert headers["x-kvroute-worker"] == "p0"
                    assert headers["x-kvroute-prefill-worker"] == "p1"
