"""A worker id that names another server on a replica than on the relay predicts nothing there.

The relay's records name a stream by worker id and rank, and say the KV-event endpoint the
relay reads it from: a replica whose worker of that id was re-pointed at another server (its
admin API, not the relay's) takes none of the old server's records for the new one's, until the
relay follows that server too. Real nats-server, relay, replica and reference workers.
"""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp
import pytest

from router.cluster.server import NatsServer
from router.service import RouterService
from tests.router.cluster.conftest import admin, workers
from tests.router.cluster.test_relay import (
    follower_config,
    generate,
    index_prompt,
    predicted,
    relay_config,
)
from tests.router.conftest import Fleet, eventually


async def _registered(service: RouterService, worker: str) -> None:
    """Wait (up to 10 s) until `worker` is registered on `service`: its models known."""
    for _ in range(200):
        entry = service.planner.pool.find(worker)
        if entry is not None and entry.models is not None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{worker} was not registered within 10 s")


async def _stream_state(service: RouterService) -> str:
    return {s.stream: s.state for s in service.indexer.streams()}.get("w0#dp0", "")


async def test_an_id_re_pointed_on_the_replica_alone_predicts_nothing_of_the_old_server(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """QA: w0 deleted and added again at another server's URL on a replica, the relay still
    following the old server under that id; the replica predicted the old server's prompt on
    the new one (320 tokens, 0 cached, 8 of 12 answers) and said the stream `synced`."""
    async with (
        workers(2) as (old, new),
        aiohttp.ClientSession() as session,
        RouterService(relay_config(old, nats_server.url), relay=True) as relay,
        RouterService(follower_config(old, nats_server.url, "a")) as a,
    ):
        fleet = Fleet(a, {"w0": old}, session)
        await index_prompt(fleet, session)
        assert (await admin(session, a, "DELETE", "/workers/w0"))[0] == 200
        caplog.set_level(logging.WARNING, logger="indexer.fed_stream")
        status, body = await admin(session, a, "POST", "/workers", {"id": "w0", "url": new.url})
        assert status in (201, 202), body
        # a 202 (its registration still under way on a loaded machine) takes no request until
        # its models are known: the first one was a 503 once on CI
        await _registered(a, "w0")
        fleet = Fleet(a, {"w0": new}, session)
        # read back and followed on: the relay's records keep naming the old server's socket
        for _ in range(8):
            assert await predicted(fleet) == 0
            got = await generate(session, a.url)
            assert got[0] <= got[1]
            await asyncio.sleep(0.2)
        assert await _stream_state(a) == "stale"
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        said = [m for m in said if "the relay reads its KV events" in m]
        assert len(said) == 1, said
        # both servers' event sockets named: the relay's and this replica's
        assert len(set(re.findall(r"tcp://[\d.]+:\d+", said[0]))) == 2, said
        # the relay follows the new server too: its records are taken again
        assert (await admin(session, relay, "DELETE", "/workers/w0"))[0] == 200
        status, body = await admin(session, relay, "POST", "/workers", {"id": "w0", "url": new.url})
        assert status in (201, 202), body

        async def hits() -> bool:
            await generate(session, a.url)
            return await predicted(fleet) >= 64

        await eventually(hits, what="the replica to follow the new server through the relay")
        got = await generate(session, a.url)
        assert 64 <= got[0] <= got[1]
