"""The fleet and the admin state live in JetStream KV: every replica makes every change."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import aiohttp
import nats
import pytest

from router.cluster.fleet_state import worker_key
from router.cluster.server import NatsServer
from router.config import IndexerSection
from router.http.keys import INDEXER
from router.service import RouterService
from tests.router.cluster.conftest import admin, replica_config, workers
from tests.router.conftest import Fleet, HungDiscovery, eventually
from workers.config import DEFAULT_MODEL


async def _fleet(session: aiohttp.ClientSession, router: RouterService) -> dict[str, Any]:
    status, listed = await admin(session, router, "GET", "/workers")
    assert status == 200, listed
    return {w["id"]: w for w in listed["workers"]}


async def test_admin_changes_reach_every_replica_and_a_restart_reads_them_back(
    nats_server: NatsServer,
) -> None:
    async with workers(3) as (w0, w1, w2), aiohttp.ClientSession() as session:
        config = [("w0", w0.url), ("w1", w1.url)]
        async with (
            RouterService(replica_config(config, nats_server.url, "a")) as a,
            RouterService(replica_config(config, nats_server.url, "b")) as b,
        ):
            status, _ = await admin(session, a, "POST", "/workers/w1/drain", {"drain": True})
            assert status == 200
            status, _ = await admin(session, b, "DELETE", "/workers/w0")
            assert status == 200
            status, _ = await admin(session, a, "POST", "/workers", {"url": w2.url, "id": "w2"})
            assert status == 201

            async def agreed(router: RouterService) -> bool:
                fleet = await _fleet(session, router)
                return set(fleet) == {"w1", "w2"} and fleet["w1"]["draining"]

            await eventually(lambda: agreed(a), what="a to apply b's removal")
            await eventually(lambda: agreed(b), what="b to apply a's drain and add")
        # a replica restarting with w0 in its config file reads the fleet back, w0 stays out:
        # before it says it is ready, unless its start-up outlasted `startup_timeout_s` (a
        # loaded machine), when it starts degraded and reads it back on the resync. Its own
        # file alone (w0 in, no w2) never agrees, so either way the read-back is what passes
        async with RouterService(replica_config(config, nats_server.url, "c")) as c:
            await eventually(lambda: agreed(c), what="c to read the shared fleet back")


async def test_two_replicas_starting_at_once_against_an_empty_cluster_agree(
    nats_server: NatsServer,
) -> None:
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        a = RouterService(replica_config([("w0", w0.url)], nats_server.url, "a"))
        b = RouterService(replica_config([("w1", w1.url)], nats_server.url, "b"))
        async with contextlib.AsyncExitStack() as stack:
            await asyncio.gather(
                stack.enter_async_context(a), stack.enter_async_context(b)
            )  # fmt: skip

            async def both(router: RouterService) -> bool:
                return set(await _fleet(session, router)) == {"w0", "w1"}

            await eventually(lambda: both(a), what="a to hold b's worker too")
            await eventually(lambda: both(b), what="b to hold a's worker too")


async def test_an_eviction_on_one_replica_evicts_the_namespace_on_every_replica(
    nats_server: NatsServer,
) -> None:
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        config = [("w0", w0.url), ("w1", w1.url)]
        refs = {"w0": w0, "w1": w1}
        async with (
            RouterService(replica_config(config, nats_server.url, "a")) as a,
            RouterService(replica_config(config, nats_server.url, "b")) as b,
        ):
            await Fleet(a, refs, session).warm()
            on_b = Fleet(b, refs, session)
            await on_b.warm()
            body = {"text": "a tenant's long prompt " * 8, "cache_salt": "tenant-x"}
            async with session.post(
                a.url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 1}}
            ) as resp:
                assert resp.status == 200
                worker = resp.headers["x-kvroute-worker"]
            await eventually(lambda: on_b.holds(body, worker, 64), what="b to index the prompt")
            status, _ = await admin(
                session, a, "POST", "/namespaces/evict", {"cache_salt": "tenant-x"}
            )
            assert status == 200

            async def evicted() -> bool:
                plan = await on_b.route(body)
                return all(c["matched_tokens"] == 0 for c in plan["candidates"])

            await eventually(evicted, what="b to evict what a evicted")


async def test_an_eviction_by_salt_reaches_replicas_whose_index_holds_what_this_one_lacks(
    nats_server: NatsServer,
) -> None:
    # an operator evicts a tenant on replica a while a's index does not hold its pages (its
    # stream lags behind b's, or a never saw the tenant): b's must be evicted all the same
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        config = [("w0", w0.url), ("w1", w1.url)]
        refs = {"w0": w0, "w1": w1}
        async with (
            RouterService(replica_config(config, nats_server.url, "a")) as a,
            RouterService(replica_config(config, nats_server.url, "b")) as b,
        ):
            on_a, on_b = Fleet(a, refs, session), Fleet(b, refs, session)
            await on_a.warm()
            await on_b.warm()
            body = {"text": "another tenant's long prompt " * 8, "cache_salt": "tenant-y"}
            async with session.post(
                a.url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 1}}
            ) as resp:
                assert resp.status == 200
                worker = resp.headers["x-kvroute-worker"]
            await eventually(lambda: on_a.holds(body, worker, 64), what="a to index the prompt")
            await eventually(lambda: on_b.holds(body, worker, 64), what="b to index the prompt")
            # a's own index drops the tenant (alone: straight on its indexer, no admin call)
            indexer = a.app[INDEXER]
            for stats in indexer.namespaces():
                if stats.namespace.cache_salt == "tenant-y":
                    indexer.evict_namespace(stats.namespace)
            assert not await on_a.holds(body, worker, 16)
            status, answer = await admin(
                session, a, "POST", "/namespaces/evict", {"cache_salt": "tenant-y"}
            )
            assert status == 200 and answer["entries_dropped"] == 0

            async def evicted() -> bool:
                plan = await on_b.route(body)
                return all(c["matched_tokens"] == 0 for c in plan["candidates"])

            await eventually(evicted, what="b to evict the salt a evicted")


async def test_an_eviction_by_salt_drops_every_replicas_pending_marks_of_its_extra_keys(
    nats_server: NatsServer,
) -> None:
    """An extra_key's namespace holds pending marks alone (no event shows its pages), on the
    replica that routed the request and on the others (its decision reached them). Before, a
    replica applying an eviction by salt reached only the namespaces with indexed blocks: its
    marks kept predicting the flushed pages pending until they expired."""
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        config = [("w0", w0.url), ("w1", w1.url)]
        refs = {"w0": w0, "w1": w1}
        # marks that outlive the test's patience: only the eviction can drop them
        long = IndexerSection(pending_ttl_s=60.0)
        async with (
            RouterService(replica_config(config, nats_server.url, "a", indexer=long)) as a,
            RouterService(replica_config(config, nats_server.url, "b", indexer=long)) as b,
        ):
            on_a, on_b = Fleet(a, refs, session), Fleet(b, refs, session)
            await on_a.warm()
            await on_b.warm()
            body = {"text": "an extra_key tenant's long prompt " * 8, "cache_salt": "tenant-k"}
            body["extra_key"] = "view-k"
            async with session.post(
                a.url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 1}}
            ) as resp:
                assert resp.status == 200

            async def pending(fleet: Fleet) -> int:
                plan = await fleet.route(body)
                return max(int(c["pending_tokens"]) for c in plan["candidates"])

            async def marked() -> bool:
                return await pending(on_b) >= 128

            await eventually(marked, what="b to mark a's decision pending")
            status, answer = await admin(
                session, a, "POST", "/namespaces/evict", {"cache_salt": "tenant-k"}
            )
            assert status == 200 and answer["cluster"] == "shared", answer
            assert await pending(on_a) == 0

            async def dropped() -> bool:
                return await pending(on_b) == 0

            await eventually(dropped, timeout_s=5.0, what="b to drop the salt's pending marks")


async def test_a_worker_whose_http_hangs_holds_no_replica_reading_the_fleet(
    nats_server: NatsServer,
) -> None:
    """A replica applies another's add as an admin add is made (`Supervisor.add`), so bounded
    the same way: the worker `checking` there too, discovered in the background, and the
    records after it (a drain) applied at once. Before, each replica waited for the hung
    worker's whole discovery (5 s here, 40 s at the defaults) before reading the next record."""
    async with (
        workers(1) as (w0,),
        HungDiscovery() as hung,
        aiohttp.ClientSession() as session,
    ):
        config = [("w0", w0.url)]
        async with (
            RouterService(replica_config(config, nats_server.url, "a")) as a,
            RouterService(replica_config(config, nats_server.url, "b")) as b,
        ):
            status, added = await admin(
                session, a, "POST", "/workers", {"url": hung.url, "id": "h"}
            )
            assert status == 202 and added["status"] == "checking", added
            status, _ = await admin(session, a, "POST", "/workers/w0/drain", {"drain": True})
            assert status == 200

            async def drained_beside_h() -> bool:
                fleet = await _fleet(session, b)
                return "h" in fleet and fleet["w0"]["draining"]

            # the add's bound is 1 s (two health timeouts); h's discovery takes 5 s
            await eventually(drained_beside_h, timeout_s=2.5, what="b to apply the drain after h")
            assert (await _fleet(session, b))["h"]["status"] == "checking"


async def test_an_older_replicas_record_of_an_id_refused_now_is_left_out_and_removable(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica of a version that took any id wrote a worker `w<LF>x` to the shared fleet.
    Applied, it put the id in every answer's `x-kvroute-worker` header, which aiohttp refused:
    each request the worker served was a 500 after it ran. This replica leaves the record out
    (one WARNING, the id quoted), serves on, and removes it from the fleet when told to: the
    admin route takes an id of any character."""
    async with (
        workers(2) as (w0, w1),
        aiohttp.ClientSession() as session,
        RouterService(replica_config([("w0", w0.url)], nats_server.url, "a")) as a,
    ):
        listener = await nats.connect(nats_server.url)
        try:
            fleet = await listener.jetstream().key_value("kvroute_fleet")
            record = {"id": "w\nx", "config": {"url": w1.url, "id": "w\nx"}, "by": "old"}
            with caplog.at_level(logging.WARNING, logger="router.cluster"):
                await fleet.put(worker_key("w\nx"), json.dumps(record).encode())

                async def refused() -> bool:
                    return "unreadable worker record" in caplog.text

                await eventually(refused, what="a to read the record")
            said = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
            assert len(said) == 1 and "'w\\nx'" in said[0] and "\nx" not in said[0], said
            assert list(await _fleet(session, a)) == ["w0"]
            body = {"model": DEFAULT_MODEL, "prompt": "served on " * 8, "max_tokens": 2}
            for _ in range(3):
                async with session.post(a.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-kvroute-worker"] == "w0"
            status, answer = await admin(session, a, "DELETE", "/workers/w%0Ax")
            assert status == 200 and answer == {"removed": "w\nx", "cluster": "shared"}
            entry = await fleet.get(worker_key("w\nx"))
            assert json.loads(entry.value or b"")["removed"] is True
            assert list(await _fleet(session, a)) == ["w0"]
            cluster = a.cluster
            assert cluster is not None

            async def read_back() -> bool:  # the removal, which this replica reads
                return not cluster.fleet.unread_worker("w\nx")

            await eventually(read_back, what="a to read its removal back")
            status, _ = await admin(session, a, "DELETE", "/workers/w%0Ax")
            assert status == 404  # nothing more to remove
        finally:
            await listener.close()


async def test_a_long_or_spaced_id_is_refused_at_the_admin_and_in_an_older_replicas_records(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A 3,100-character id was taken: its fleet key ("w." + base64) pushed the replica's
    publish past nats-server's 4 KiB control line, the server dropped the client, and the
    replica stayed degraded. Now the admin API refuses it (the cluster stays ok), and an older
    replica's records of ids refused now (too long; an outer space, which the answer header
    drops) are left out with one WARNING each, the id clipped, and removable."""
    long_id = "k" * 300
    async with (
        workers(2) as (w0, w1),
        aiohttp.ClientSession() as session,
        RouterService(replica_config([("w0", w0.url)], nats_server.url, "a")) as a,
    ):
        status, body = await admin(
            session, a, "POST", "/workers", {"url": w1.url, "id": "k" * 3100}
        )
        assert status == 400 and "is 3100 characters long" in body["error"]["message"], body
        async with session.get(a.url + "/health") as resp:
            assert (await resp.json())["cluster"]["status"] == "ok"
        listener = await nats.connect(nats_server.url)
        try:
            fleet = await listener.jetstream().key_value("kvroute_fleet")
            records = {
                long_id: {"id": long_id, "config": {"url": w1.url, "id": long_id}, "by": "old"},
                "a ": {"id": "a ", "config": {"url": w1.url, "id": "a "}, "by": "old"},
            }
            with caplog.at_level(logging.WARNING, logger="router.cluster"):
                for worker_id, record in records.items():
                    await fleet.put(worker_key(worker_id), json.dumps(record).encode())
                cluster = a.cluster
                assert cluster is not None

                async def refused() -> bool:
                    return all(cluster.fleet.unread_worker(w) for w in records)

                await eventually(refused, what="a to read both records")
            said = [r.getMessage() for r in caplog.records if "worker record" in r.getMessage()]
            assert len(said) == 2, said
            assert all(long_id not in line and len(line) < 600 for line in said), said
            assert any("'a '" in line and "space" in line for line in said), said
            assert list(await _fleet(session, a)) == ["w0"]
            status, answer = await admin(session, a, "DELETE", f"/workers/{long_id}")
            assert status == 200 and answer == {"removed": long_id, "cluster": "shared"}
            async with session.get(a.url + "/health") as resp:
                assert (await resp.json())["cluster"]["status"] == "ok"
        finally:
            await listener.close()
