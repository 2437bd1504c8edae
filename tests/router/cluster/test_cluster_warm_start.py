"""A new replica starts from the latest snapshot in JetStream and is ready only once warm."""

from __future__ import annotations

import logging

import aiohttp
import pytest

from router.cluster.server import NatsServer
from router.cluster.snapshots import publish_snapshot
from router.service import RouterService
from tests.router.cluster.conftest import admin, extra_key_snapshot, replica_config, workers
from tests.router.conftest import Fleet, eventually


async def _indexed_then_snapshotted(fleet: Fleet, body: dict[str, str]) -> str:
    """Send `body` through `fleet`'s router once its streams deliver, wait until its index
    holds the prompt, and publish its snapshot; returns the worker the prompt went to."""
    await fleet.warm()
    router, session = fleet.router, fleet.session
    async with session.post(
        router.url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 1}}
    ) as resp:
        assert resp.status == 200
        worker = resp.headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(body, worker, 64), what="the prompt indexed")
    assert router.cluster is not None
    assert await router.cluster.publish_snapshot() > 0
    return worker


async def test_a_new_replica_loads_the_snapshot_and_its_first_request_hits(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="indexer")
    caplog.set_level(logging.INFO, logger="router.cluster")
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        config = [("w0", w0.url), ("w1", w1.url)]
        refs = {"w0": w0, "w1": w1}
        body = {"text": "a conversation worth keeping warm " * 6, "cache_salt": "tenant-w"}
        async with RouterService(replica_config(config, nats_server.url, "a")) as a:
            worker = await _indexed_then_snapshotted(Fleet(a, refs, session), body)
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
        # each stream's load and proof are routine (INFO); before, every warm start said one
        # WARNING per stream, `state loaded from a snapshot: its entries predict nothing ...`
        loaded = [r for r in caplog.records if "state loaded from a snapshot" in r.getMessage()]
        assert len(loaded) == 4, loaded  # loaded, proven: 2 streams (c's)
        assert {r.levelno for r in loaded} == {logging.INFO}
        assert not [r for r in caplog.records if "unproven" in r.getMessage()]


async def test_a_damaged_snapshot_in_jetstream_is_refused_and_the_replica_starts_cold(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The object store's digest covers what was stored, not what was dumped: a snapshot
    damaged before it was put passes it. Its own digest refuses it (a flipped bit had loaded
    as sound entries the workers' removals never named: false hits for good)."""
    async with workers(1) as (w0,), aiohttp.ClientSession() as session:
        config = [("w0", w0.url)]
        body = {"text": "a conversation about to be damaged " * 6, "cache_salt": "tenant-d"}
        async with RouterService(replica_config(config, nats_server.url, "a")) as a:
            on_a = Fleet(a, {"w0": w0}, session)
            await on_a.warm()
            async with session.post(
                a.url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 1}}
            ) as resp:
                assert resp.status == 200
            await eventually(lambda: on_a.holds(body, "w0", 64), what="a to index the prompt")
            assert a.cluster is not None and a.cluster._js is not None
            dump = bytearray(a.indexer.dump())
            dump[-1] ^= 1  # the last stream's last field: one bit
            await publish_snapshot(a.cluster._js, a.cluster._index_bucket, bytes(dump), 0.0)
            with caplog.at_level(logging.WARNING, logger="router.cluster"):
                async with RouterService(replica_config(config, nats_server.url, "c")) as c:
                    assert c.cluster is not None and c.cluster.snapshot_at is None
            assert "does not match its digest" in caplog.text


async def test_a_replica_restarted_under_its_id_applies_its_eviction_to_an_older_snapshot(
    nats_server: NatsServer,
) -> None:
    """A fixed `replica_id` names the replica, not the process. Before, a replica restarted
    under it skipped the eviction records bearing its id, taking them for its own process's:
    loaded from a snapshot older than its eviction, it held the evicted tenant again (and put
    it in its next snapshots, for every replica after it)."""
    async with workers(1) as (w0,), aiohttp.ClientSession() as session:
        config = [("w0", w0.url)]
        refs = {"w0": w0}
        body = {"text": "a tenant about to leave the fleet " * 6, "cache_salt": "tenant-x"}
        async with RouterService(replica_config(config, nats_server.url, "fixed")) as a:
            on_a = Fleet(a, refs, session)
            assert await _indexed_then_snapshotted(on_a, body) == "w0"  # holds the tenant
            status, answer = await admin(
                session, a, "POST", "/namespaces/evict", {"cache_salt": "tenant-x"}
            )
            assert (status, answer["cluster"]) == (200, "shared")
            assert not await on_a.holds(body, "w0", 16)
        async with RouterService(replica_config(config, nats_server.url, "fixed")) as again:
            assert again.cluster is not None and again.cluster.snapshot_at is not None
            assert not await Fleet(again, refs, session).holds(body, "w0", 16)


async def test_a_worker_the_cluster_re_pointed_stays_warm_on_a_replica_started_with_the_old_file(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """w1 re-pointed through the admin API (DELETE, then POST with another server); a replica
    started with the config file naming its old server. Before, its warm start proved the
    snapshot's stream of w1 against the file's server (the fleet record applied after it) and
    cleared it (`the publisher's newest seq is 0, below ours (8)`): cold on w1, whose replay
    (2 batches kept) could not bring it back. Now the fleet applies first."""
    caplog.set_level(logging.WARNING)
    async with workers(2, buffer_steps=2) as (old, new), aiohttp.ClientSession() as session:
        config = [("w1", old.url)]
        refs = {"w1": new}
        body = {"text": "a prompt on the server w1 names now " * 6, "cache_salt": "tenant-r"}
        async with RouterService(replica_config(config, nats_server.url, "a")) as a:
            assert (await admin(session, a, "DELETE", "/workers/w1"))[0] == 200
            moved = await admin(session, a, "POST", "/workers", {"id": "w1", "url": new.url})
            assert moved[0] in (201, 202), moved  # 202: discovery outlasted the add's wait
            on_a = Fleet(a, refs, session)
            await on_a.warm()
            for i in range(4):  # the prompt's batch, then more: past the 2 the replay keeps
                text = body["text"] if i == 0 else f"another prompt {i} " * 12
                async with session.post(
                    a.url + "/generate",
                    json={**body, "text": text, "sampling_params": {"max_new_tokens": 1}},
                ) as resp:
                    assert resp.status == 200
            assert await _indexed_then_snapshotted(on_a, {**body, "text": "x " * 40}) == "w1"
            assert await on_a.holds(body, "w1", 64)
            async with RouterService(replica_config(config, nats_server.url, "c")) as c:
                assert c.cluster is not None and c.cluster.snapshot_at is not None
                assert await Fleet(c, refs, session).holds(body, "w1", 64)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "below ours" in m or "cleared" in m], said


async def test_a_cluster_restarted_whole_keeps_the_extra_key_shadows_of_its_snapshot(
    nats_server: NatsServer,
) -> None:
    """Every replica stopped at once (a rollout, a crash): none is left to send the shadows of
    the last hour again, and the snapshot carried none, so the first replica back predicted an
    `extra_key` request's pages (plain ones to the events) to a plain request of its salt. On
    the old code: 320 tokens predicted, 0 cached."""
    async with workers(1) as (w0,), aiohttp.ClientSession() as session:
        config = [("w0", w0.url)]
        refs = {"w0": w0}
        prompt = [(i * 11) % 200 + 5 for i in range(20 * 16 + 1)]
        plain = {"input_ids": prompt, "cache_salt": "tenant-x"}
        async with RouterService(replica_config(config, nats_server.url, "a")) as a:
            other = await extra_key_snapshot(Fleet(a, refs, session), plain)
        async with RouterService(replica_config(config, nats_server.url, "c")) as c:
            assert c.cluster is not None and c.cluster.snapshot_at is not None
            on_c = Fleet(c, refs, session)
            assert await on_c.holds(other, "w0", 320)  # warm from the snapshot
            assert not await on_c.holds(plain, "w0", 16)
            async with session.post(c.url + "/generate", json=plain) as resp:
                assert resp.status == 200
                answer = await resp.json()
                assert int(resp.headers["x-kvroute-matched-tokens"]) == 0
                assert answer["meta_info"]["cached_tokens"] == 0
