"""Replicas share their routing decisions: pending marks and load, applied as they arrive."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from router.cluster.server import NatsServer
from router.cluster.wire import Batch, End, Goodbye, Heartbeat, Pending, batch_decoder
from router.config import IndexerSection, PolicyConfig
from router.service import RouterService
from tests.router.cluster.conftest import (
    CuttableLink,
    admin,
    cluster,
    replica_config,
    workers,
)
from tests.router.conftest import eventually
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

# slow prefill: a request stays in flight long enough to be seen from the other replica
SLOW = {"time_scale": 1.0, "prefill_ms_per_token": 4.0}


def _body(prompt: str) -> dict[str, Any]:
    return {"text": prompt, "cache_salt": "tenant-a", "sampling_params": {"max_new_tokens": 2}}


async def _running(session: aiohttp.ClientSession, router: RouterService) -> dict[str, int]:
    status, listed = await admin(session, router, "GET", "/workers")
    assert status == 200, listed
    return {w["id"]: w["running"] for w in listed["workers"]}


async def test_a_request_on_one_replica_is_pending_and_running_on_the_others(
    nats_server: NatsServer,
) -> None:
    async with workers(2, **SLOW) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        async with (
            RouterService(replica_config(fleet, nats_server.url, "a")) as a,
            RouterService(replica_config(fleet, nats_server.url, "b")) as b,
        ):
            prompt = "a system prompt shared by a burst of sibling requests " * 3
            first = asyncio.create_task(_post(session, a, prompt))
            try:

                async def b_sees_it() -> bool:
                    plan = await _route(session, b, prompt)
                    running = await _running(session, b)
                    pending = {c["worker"]: c["pending_tokens"] for c in plan["candidates"]}
                    return any(pending[w] > 0 and running[w] == 1 for w in pending)

                await eventually(b_sees_it, what="replica b to see a's pending mark and load")
                # the sibling sent to b follows the first request to its worker
                second_worker = await _post(session, b, prompt + " and a question")
                assert second_worker == await first
            finally:
                first.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await first

            async def idle() -> bool:
                return set((await _running(session, b)).values()) == {0}

            await eventually(idle, what="a's requests to stop counting on b once they end")


async def _post(session: aiohttp.ClientSession, router: RouterService, prompt: str) -> str:
    async with session.post(router.url + "/generate", json=_body(prompt)) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-kvroute-worker"]


async def _route(session: aiohttp.ClientSession, router: RouterService, prompt: str) -> Any:
    status, plan = await admin(session, router, "POST", "/route?endpoint=/generate", _body(prompt))
    assert status == 200, plan
    return plan


async def test_decisions_made_close_together_go_as_one_message_and_a_quiet_replica_sends_at_once(
    nats_server: NatsServer,
) -> None:
    interval = 0.3
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        config = replica_config(
            fleet,
            nats_server.url,
            "a",
            # heartbeats (messages too) seldom enough that the replica has quiet spells
            cluster=cluster(
                nats_server.url,
                replica_id="a",
                publish_interval_s=interval,
                heartbeat_interval_s=2.0,
                heartbeat_timeout_s=6.0,
            ),
        )
        listener = await nats.connect(nats_server.url)
        arrived: list[tuple[float, Batch]] = []

        async def got(msg: Msg) -> None:
            arrived.append((time.monotonic(), batch_decoder.decode(msg.data)))

        try:
            await listener.subscribe("kvroute.replica.a", cb=got)
            async with RouterService(config) as a:
                await asyncio.sleep(interval * 1.5)  # quiet: the next decision goes at once
                sent = time.monotonic()
                await _post(session, a, "one request after a quiet spell")

                async def pending_arrived() -> bool:
                    return any(_has(b, Pending) for _, b in arrived)

                await eventually(pending_arrived, what="the quiet replica's pending mark")
                first = next(at for at, b in arrived if _has(b, Pending))
                assert first - sent < interval / 2, "a quiet replica's decision waited"

                await asyncio.sleep(interval * 1.5)
                arrived.clear()
                for wave in range(8):  # 24 requests over about two intervals
                    await asyncio.gather(
                        *(
                            _post(session, a, f"request {wave}.{i}, its own prompt")
                            for i in range(3)
                        )
                    )
                    await asyncio.sleep(interval / 4)

                async def all_ended() -> bool:
                    return sum(_count(b, End) for _, b in arrived) == 24

                await eventually(all_ended, what="the 24 requests' ends")
        finally:
            await listener.close()
    # every request tells its mark, begin, first byte and end: a message per loop turn would be
    # dozens; no two leave closer together than the interval (the stop's goodbye goes at once)
    arrived = [(at, b) for at, b in arrived if not _has(b, Goodbye)]
    decisions = sum(len(b.decisions) for _, b in arrived)
    assert decisions >= 4 * 24 and len(arrived) < decisions / 4
    stamps = [b.sent_at for _, b in arrived]
    gaps = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    assert gaps and min(gaps) >= interval * 0.95, gaps


async def _decision_counts(
    session: aiohttp.ClientSession, router: RouterService
) -> tuple[float, float]:
    """`kvroute_cluster_decisions_published_total` and `_applied_total`, scraped."""
    async with session.get(router.url + "/metrics") as resp:
        text = await resp.text()
    counts = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    prefix = "kvroute_cluster_decisions_"
    return counts[prefix + "published_total"], counts[prefix + "applied_total"]


async def test_the_decision_counters_count_routing_decisions_and_nothing_beside(
    nats_server: NatsServer,
) -> None:
    """`kvroute_cluster_decisions_published`, "routing decisions this replica published",
    counted every message it sent: a request's pending mark, begin, first byte and end, and
    every heartbeat (12 requests read 66, and an idle replica's rose by 10 a second);
    `_applied` alike. Each counts one per request routed now, idle heartbeats none."""
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        listener = await nats.connect(nats_server.url)
        beats: list[Batch] = []

        async def got(msg: Msg) -> None:
            batch = batch_decoder.decode(msg.data)
            if _has(batch, Heartbeat):
                beats.append(batch)

        try:
            await listener.subscribe("kvroute.replica.a", cb=got)
            async with (
                RouterService(replica_config(fleet, nats_server.url, "a")) as a,
                RouterService(replica_config(fleet, nats_server.url, "b")) as b,
            ):
                for i in range(5):
                    await _post(session, a, f"request {i} routed by a, its own prompt")
                for i in range(3):
                    await _post(session, b, f"request {i} routed by b, its own prompt")

                async def applied() -> bool:
                    _, on_b = await _decision_counts(session, b)
                    _, on_a = await _decision_counts(session, a)
                    return (on_a, on_b) == (3, 5)

                await eventually(applied, what="each replica to apply the other's decisions")
                # idle: 5 heartbeats of a's (0.1 s apart) go out, none of them a decision
                heard = len(beats)

                async def idle() -> bool:
                    return len(beats) >= heard + 5

                await eventually(idle, what="a's heartbeats while idle")
                assert await _decision_counts(session, a) == (5, 3)
                assert await _decision_counts(session, b) == (3, 5)
        finally:
            await listener.close()


def _has(batch: Batch, kind: type) -> bool:
    return any(isinstance(d, kind) for d in batch.decisions)


def _count(batch: Batch, kind: type) -> int:
    return sum(1 for d in batch.decisions if isinstance(d, kind))


async def test_an_extra_key_request_on_one_replica_shadows_its_plain_twin_on_the_others(
    nats_server: NatsServer,
) -> None:
    """Pages stored for an `extra_key` come as plain pages on the events every replica reads:
    the replica that did not route it must not predict them to a plain request either."""
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        async with (
            RouterService(replica_config(fleet, nats_server.url, "a")) as a,
            RouterService(replica_config(fleet, nats_server.url, "b")) as b,
        ):
            prompt = "a prompt a tenant sends under its own extra_key, pages long " * 4
            keyed = {**_body(prompt), "extra_key": "view-1"}
            async with session.post(a.url + "/generate", json=keyed) as resp:
                assert resp.status == 200, await resp.text()
                holder = resp.headers["x-kvroute-worker"]
            indexer = b.planner.indexer
            (stream,) = indexer.stream_ids(holder)

            def stored_on_b() -> bool:
                entries = indexer.index.entries(stream)
                return entries > 0

            async def seen() -> bool:
                return stored_on_b() and len(indexer._shadowed) > 0

            await eventually(seen, what="b to index the pages and shadow them")
            plan = await _route(session, b, prompt)
            assert all(c["matched_tokens"] == 0 for c in plan["candidates"]), plan


async def test_an_extra_key_requests_marks_on_the_others_go_with_the_pages_its_worker_removes(
    nats_server: NatsServer,
) -> None:
    """Another replica's marks of an `extra_key` request go when its worker removes the pages
    they stand for, as the sender's do (`PendingTable.twin`): the decision comes with its
    tokens, so the receiver knows which plain pages they are. Sent as block keys only, they
    stood until they lapsed: the same request sent to b was predicted its prompt pending, 0
    cached, after the worker flushed the salt."""
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        ttl = IndexerSection(pending_ttl_s=60.0)  # past the test: only a removal drops them
        async with (
            RouterService(replica_config(fleet, nats_server.url, "a", indexer=ttl)) as a,
            RouterService(replica_config(fleet, nats_server.url, "b", indexer=ttl)) as b,
        ):
            prompt = "a prompt a tenant sends under its own extra_key, pages long " * 4
            keyed = {**_body(prompt), "extra_key": "view-1"}
            async with session.post(a.url + "/generate", json=keyed) as resp:
                assert resp.status == 200, await resp.text()
                holder = resp.headers["x-kvroute-worker"]

            async def pending_on_b() -> int:
                status, plan = await admin(session, b, "POST", "/route?endpoint=/generate", keyed)
                assert status == 200, plan
                return sum(c["pending_tokens"] for c in plan["candidates"] if c["worker"] == holder)

            async def marked() -> bool:
                return await pending_on_b() > 0

            await eventually(marked, what="b to mark a's request pending")
            url = (w0 if holder == "w0" else w1).url + "/flush_cache"
            async with session.post(url, json={"cache_salt": "tenant-a"}) as resp:
                assert resp.status == 200

            async def dropped() -> bool:
                return await pending_on_b() == 0

            await eventually(dropped, what="b to drop them with the removed pages")


@pytest.mark.parametrize("flushed", ["another_salt", "its_salt"])
async def test_a_held_decision_is_judged_by_the_pages_removed_meanwhile(
    nats_server: NatsServer, flushed: str
) -> None:
    """a's link to NATS hangs while it routes an `extra_key` request (whose siblings follow
    its pending marks) and the worker flushes a salt; b applies the flush, then a's decision
    comes, late. Another salt's flush took none of the request's pages: b marks them (a time
    rule refused the whole decision for any removal on the stream, a missed hit for every
    sibling sent to b); a flush of the request's own salt took them: b marks none of them."""
    async with (
        workers(1) as (w0,),
        CuttableLink(nats_server.port) as link,
        aiohttp.ClientSession() as session,
    ):
        fleet = [("w0", w0.url)]
        ttl = IndexerSection(pending_ttl_s=60.0)  # past the test: only removals count
        async with (
            RouterService(
                replica_config(fleet, link.url, "a", indexer=ttl, cluster=_patient(link.url, "a"))
            ) as a,
            RouterService(
                replica_config(
                    fleet, nats_server.url, "b", indexer=ttl, cluster=_patient(nats_server.url, "b")
                )
            ) as b,
        ):
            other = {**_body("another tenant's prompt, pages long " * 5), "cache_salt": "o"}
            async with session.post(w0.url + "/generate", json=other) as resp:
                assert resp.status == 200, await resp.text()

            async def other_on_b() -> int:
                status, plan = await admin(session, b, "POST", "/route?endpoint=/generate", other)
                assert status == 200, plan
                return int(plan["candidates"][0]["matched_tokens"])

            await eventually(lambda: _positive(other_on_b()), what="b to index the other salt")
            keyed = {**_body("a tenant's prompt under its own extra_key, pages long " * 4)}
            keyed["extra_key"] = "view-1"
            link.held = True
            async with session.post(a.url + "/generate", json=keyed) as resp:
                assert resp.status == 200, await resp.text()
            salt = "o" if flushed == "another_salt" else "tenant-a"
            async with session.post(w0.url + "/flush_cache", json={"cache_salt": salt}) as resp:
                assert resp.status == 200
            index = b.indexer.index
            (stream,) = index.streams()
            removed = index.counters(stream).blocks_removed

            async def b_applied_the_flush() -> bool:
                return index.counters(stream).blocks_removed > removed

            await eventually(b_applied_the_flush, what="b to apply the flush")
            late = index.late_marks
            link.held = False

            async def pending_on_b() -> int:
                status, plan = await admin(session, b, "POST", "/route?endpoint=/generate", keyed)
                assert status == 200, plan
                return int(plan["candidates"][0]["pending_tokens"])

            if flushed == "another_salt":
                await eventually(lambda: _positive(pending_on_b()), what="b to mark a's request")
                assert index.late_marks == late
            else:

                async def judged() -> bool:
                    return index.late_marks > late

                await eventually(judged, what="b to judge a's late decision")
                assert await pending_on_b() == 0


async def _positive(value: Any) -> bool:
    return bool(await value > 0)


def _patient(url: str, name: str) -> Any:
    """A replica that keeps a peer whose link hangs a second (heartbeats late, not lost)."""
    return cluster(url, replica_id=name, heartbeat_timeout_s=5.0)


async def test_a_shadow_reaches_replicas_that_join_later_whatever_the_senders_policy(
    nats_server: NatsServer,
) -> None:
    """A sender that marks nothing pending (least_load) still shadows on the others, and a
    replica that joins after the request was routed is told too: the shadow lasts an hour."""
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        blind = replica_config(fleet, nats_server.url, "a", policy=PolicyConfig(name="least_load"))
        async with RouterService(blind) as a:
            prompt = "a prompt a tenant sends under its own extra_key, pages long " * 4
            keyed = {**_body(prompt), "extra_key": "view-1"}
            async with session.post(a.url + "/generate", json=keyed) as resp:
                assert resp.status == 200, await resp.text()
                holder = resp.headers["x-kvroute-worker"]
            async with RouterService(replica_config(fleet, nats_server.url, "b")) as b:
                indexer = b.planner.indexer
                (stream,) = indexer.stream_ids(holder)

                async def seen() -> bool:
                    return indexer.index.entries(stream) > 0 and len(indexer._shadowed) > 0

                await eventually(seen, what="b to index the pages and take a's shadow")
                plan = await _route(session, b, prompt)
                assert all(c["matched_tokens"] == 0 for c in plan["candidates"]), plan


async def test_a_pairs_decode_side_counts_on_every_replica(nats_server: NatsServer) -> None:
    slow_decode: dict[str, Any] = {
        "time_scale": 1.0,
        "decode_ms_per_token": 100.0,
        "kv_transfer_timeout_s": 5.0,
    }
    async with (
        ReferenceWorker(ReferenceConfig(page_size=16, time_scale=0.0, role="prefill")) as p0,
        ReferenceWorker(ReferenceConfig(page_size=16, role="decode", **slow_decode)) as d0,
        aiohttp.ClientSession() as session,
    ):
        fleet = [("p0", p0.url), ("d0", d0.url)]
        async with (
            RouterService(replica_config(fleet, nats_server.url, "a")) as a,
            RouterService(replica_config(fleet, nats_server.url, "b")) as b,
        ):
            body = {"text": "a long answer " * 8, "sampling_params": {"max_new_tokens": 20}}
            sent = asyncio.create_task(session.post(a.url + "/generate", json=body))
            try:

                async def b_counts_it() -> bool:
                    return (await _running(session, b)).get("d0") == 1

                await eventually(b_counts_it, what="b to count a's request on the decode side")
            finally:
                resp = await sent
                assert resp.status == 200, await resp.text()
                resp.release()

            async def b_ends_it() -> bool:
                return (await _running(session, b)).get("d0") == 0

            await eventually(b_ends_it, what="b to see it end")


async def test_a_replica_back_under_its_id_is_told_the_shadows_it_made_before(
    nats_server: NatsServer,
) -> None:
    """The replica that routed an extra_key request restarts (same id, within the heartbeat
    timeout): its own shadows went with its process, so the others send it theirs, its own
    among them. It had predicted the plain prompt 688 tokens the worker did not hold."""
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        slow = {"cluster": cluster(nats_server.url, replica_id="a", heartbeat_timeout_s=30.0)}
        a_config = replica_config(fleet, nats_server.url, "a", **slow)
        b_config = replica_config(
            fleet, nats_server.url, "b",
            cluster=cluster(nats_server.url, replica_id="b", heartbeat_timeout_s=30.0),
        )  # fmt: skip
        prompt = "a prompt a tenant sends under its own extra_key, pages long " * 4
        async with RouterService(b_config) as b:
            async with RouterService(a_config) as a:
                keyed = {**_body(prompt), "extra_key": "view-1"}
                async with session.post(a.url + "/generate", json=keyed) as resp:
                    assert resp.status == 200, await resp.text()
                    holder = resp.headers["x-kvroute-worker"]

                async def b_shadows() -> bool:
                    return len(b.planner.indexer._shadowed) > 0

                await eventually(b_shadows, what="b to take a's shadow")
            async with RouterService(a_config) as again:
                indexer = again.planner.indexer
                (stream,) = indexer.stream_ids(holder)

                async def told() -> bool:
                    return indexer.index.entries(stream) > 0 and len(indexer._shadowed) > 0

                await eventually(told, what="the new a to index the pages and be told the shadow")
                plan = await _route(session, again, prompt)
                assert all(c["matched_tokens"] == 0 for c in plan["candidates"]), plan


async def test_a_replica_stopping_sends_its_last_ends_before_its_goodbye(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that ends while its replica stops (the stop lets it finish) is told ended
    with the goodbye: the others say the replica stopped with none in flight. Before, its
    end waited in the buffer for the next batch, which the stop dropped, and the others
    logged it stopped with a request in flight it had answered (QA: `its 1 requests`)."""
    caplog.set_level(logging.INFO, logger="router.cluster")
    async with workers(2, **SLOW) as (w0, w1), aiohttp.ClientSession() as session:
        fleet = [("w0", w0.url), ("w1", w1.url)]
        async with RouterService(replica_config(fleet, nats_server.url, "a")) as a:
            async with RouterService(replica_config(fleet, nats_server.url, "b")) as b:
                body = _body("a long question " * 20)  # about 1.3 s of prefill
                answer = asyncio.create_task(session.post(b.url + "/generate", json=body))

                async def seen_on_a() -> bool:
                    return sum((await _running(session, a)).values()) == 1

                await eventually(seen_on_a, what="a to count b's request")
            # b stopped once its request was answered
            resp = await answer
            assert resp.status == 200
            resp.release()

            def said() -> list[str]:
                return [
                    r.getMessage() for r in caplog.records if "replica b stopped" in r.getMessage()
                ]

            async def told() -> bool:
                return bool(said())

            await eventually(told, what="a to hear b's goodbye")
            assert said() == ["replica b stopped: its 0 requests in flight no longer count"]
            assert await _running(session, a) == {"w0": 0, "w1": 0}
