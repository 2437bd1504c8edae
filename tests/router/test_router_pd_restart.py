"""Prefill/decode workers restarted on the same URL: the pairs follow their new settings.

A prefill whose bootstrap port is left to the system (SGLang's default, the reference worker's
0) binds another one each start, and a process may come back as the other side of the pairs.
Reference workers behind a real router: a prefill restarted with a new bootstrap port (seen by
the health check, or not seen at all until a decode cannot reach its old port), a prefill
restarted as a decode, and a prefill whose bootstrap server its decodes never reach.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import aiohttp
import msgspec
import pytest

from router.config import HealthConfig, WorkerConfig
from router.http.bootstrap_unreachable import UnreachableNotices
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


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


async def test_a_prefill_restarted_unseen_is_read_again_when_its_decode_cannot_reach_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A prefill restarted between two health probes, its events not read (so nothing tells
    the router): the first pair through it names the old bootstrap port, and its decode cannot
    reach it. That failure is the prefill's side: its settings are read again, and the pair
    retried on the new port, the worker not blamed. Before, the decode was blamed, its 502
    passed through unlogged, for every pair, for good."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        ports = _ports(p0)
        old = p0.disagg.bootstrap_port
        # its events not read: nothing but its pairs can tell the router it restarted
        unseen = [
            WorkerConfig(url=w.url, id=i, kv_events=False) for i, w in (("p0", p0), ("d0", d0))
        ]
        config = msgspec.structs.replace(
            router_config([], health=HealthConfig(interval_s=60, timeout_s=1)),
            workers=tuple(unseen),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            entry = router.planner.pool.get("p0")
            status, _, answer = await _generate(session, router, 0)
            assert status == 200, answer
            await p0.__aexit__(None, None, None)
            async with ReferenceWorker(reference("prefill", **ports)) as again:
                assert entry.bootstrap_port == old != again.disagg.bootstrap_port
                with caplog.at_level(logging.WARNING, logger="router"):
                    status, headers, answer = await _generate(session, router, 1)
                assert status == 200, answer
                assert headers["x-kvroute-prefill-worker"] == "p0"
                assert entry.bootstrap_port == again.disagg.bootstrap_port
                said = [r.getMessage() for r in caplog.records]
                assert any("came back as prefill" in line for line in said), said
                assert any(
                    f"has bootstrap port {entry.bootstrap_port} now" in line for line in said
                )
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


async def test_a_prefill_whose_bootstrap_server_cannot_be_reached_is_charged_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bootstrap port nobody listens on (here configured wrong; or the prefill's bootstrap
    server died) fails every pair through the prefill: each failure is charged to it at once,
    as a refused connection is, and said once, not per request. Before, the decode was blamed
    and, alone, its 502 passed through: nobody charged, nothing logged, the prefill chosen
    again for ever."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        wrong = WorkerConfig(url=p0.url, id="p0", role="prefill", bootstrap_port=_closed_port())
        config = router_config([("d0", d0.url)])
        config = msgspec.structs.replace(config, workers=(wrong, *config.workers))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            with caplog.at_level(logging.WARNING, logger="router"):
                for i in range(2):
                    status, _, answer = await _generate(session, router, i)
                    assert status == 502, answer
                    assert "could not reach its bootstrap server" in answer["error"]["message"]
            assert _failures(router) == {"p0": 2, "d0": 0}
            # (the registration said the ports differ: `..._does_not_advertise_is_said`)
            said = [r.getMessage() for r in caplog.records if "failed before" in r.getMessage()]
            assert len(said) == 1 and "prefill worker p0" in said[0], said
            assert said[0].endswith("(said at most every 60 s; 0 more since the last time)")


async def test_a_configured_bootstrap_port_the_prefill_does_not_advertise_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A `bootstrap_port` in the config wins over the one the prefill advertises (a mapped
    port is meant to), and nothing said they differed: every pair through it failed, and the
    line said its settings "give no other bootstrap port" while the worker advertised one. The
    registration says both ports in a WARNING (as a contradicting `role`), and so does the
    line of the failing pairs."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        advertised = p0.disagg.bootstrap_port
        configured = _closed_port()
        wrong = WorkerConfig(url=p0.url, id="p0", role="prefill", bootstrap_port=configured)
        config = router_config([("d0", d0.url)])
        config = msgspec.structs.replace(config, workers=(wrong, *config.workers))
        caplog.set_level(logging.WARNING, logger="router")
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            noted = [r.getMessage() for r in caplog.records if "bootstrap_port" in r.getMessage()]
            assert len(noted) == 1 and noted[0].startswith("worker p0: "), noted
            assert f"the config says bootstrap_port {configured}, " in noted[0], noted
            assert f"the worker advertises {advertised} " in noted[0], noted
            status, _, answer = await _generate(session, router, 0)
            assert status == 502, answer
            # said once: the failed pair had its settings read again, the same ports
            again = [r.getMessage() for r in caplog.records if "bootstrap_port" in r.getMessage()]
            assert [line for line in again if line.startswith("worker p0: ")] == noted
            said = [r.getMessage() for r in caplog.records if "failed before" in r.getMessage()]
            assert len(said) == 1, said
            assert f"bootstrap server at port {configured}" in said[0], said
            assert f"it advertises bootstrap port {advertised}, but its config's" in said[0]
            assert "give no other bootstrap port" not in said[0]


def test_an_unreachable_bootstrap_server_is_said_once_a_while_with_the_count_unsaid(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One WARNING a minute per prefill, each failed pair between at DEBUG, and the next
    WARNING says how many went unsaid, as the rank-less retries do (before: no count, so an
    operator could not tell one failed pair a minute from a thousand)."""
    now = [0.0]
    notices = UnreachableNotices(clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="router.http.bootstrap_unreachable")
    for _ in range(4):
        notices.say("p0", "502 cannot reach the prefill's bootstrap server")
        now[0] += 1.0
    notices.say("p1", "502 cannot reach the prefill's bootstrap server")
    now[0] = 60.0
    notices.say("p0", "502 cannot reach the prefill's bootstrap server")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(" failed")[0] for w in warnings] == [
        "prefill worker p0",
        "prefill worker p1",
        "prefill worker p0",
    ]
    assert warnings[0].endswith("0 more since the last time)")
    assert warnings[2].endswith("3 more since the last time)")
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 3
