"""A new replica starts from the latest snapshot in JetStream and is ready only once warm."""

from __future__ import annotations

import aiohttp

from router.cluster.server import NatsServer
from router.service import RouterService
from tests.router.cluster.conftest import replica_config, workers
from tests.router.conftest import Fleet, eventually


async def test_a_new_replica_loads_the_snapshot_and_its_first_request_hits(
    nats_server: NatsServer,
) -> None:
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        config = [("w0", w0.url), ("w1", w1.url)]
        refs = {"w0": w0, "w1": w1}
        body = {"text": "a conversation worth keeping warm " * 6, "cache_salt": "tenant-w"}
        async with RouterService(replica_config(config, nats_server.url, "a")) as a:
            on_a = Fleet(a, refs, session)
            await on_a.warm()
            async with session.post(
                a.url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 1}}
            ) as resp:
                assert resp.status == 200
                worker = resp.headers["x-kvroute-worker"]
            await eventually(lambda: on_a.holds(body, worker, 64), what="a to index the prompt")
            assert a.cluster is not None
            assert await a.cluster.publish_snapshot() > 0
            async with RouterService(replica_config(config, nats_server.url, "c")) as c:
                assert c.cluster is not None and c.cluster.snapshot_at is not None
                # ready means warm: the very first look at the prompt predicts the hit
                on_c = Fleet(c, refs, session)
                assert await on_c.holds(body, worker, 64)
                body_req = {**body, "sampling_params": {"max_new_tokens": 1}}
                async with session.post(c.url + "/generate", json=body_req) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-kvroute-worker"] == worker
                    assert int(resp.headers["x-kvroute-matched-tokens"]) >= 64
