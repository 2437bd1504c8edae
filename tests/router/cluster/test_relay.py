"""`kvroute relay` and the replicas that follow it, on a real nats-server and real workers.

The relay subscribes to the workers; the replicas (`[cluster] events = "relay"`) open no socket
to any worker and hold what the relay's records say, never more: a relay that stops makes
their streams stale, a relay that restarts (and may have missed removals) makes them start
afresh, and a warm start is trusted only once the relay shows the batch its snapshot ended on.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from indexer.fed_stream import ANEW_MARGIN_S
from router.cluster.server import NatsServer
from router.config import HealthConfig, IndexerSection, RouterConfig
from router.errors import ConfigError
from router.service import RouterService
from tests.router.cluster.conftest import cluster, extra_key_snapshot, replica_config, workers
from tests.router.conftest import AUTH, Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PROMPT = "a tenant's long system prompt that the relay carries to every replica " * 4


def relay_config(worker: ReferenceWorker, nats_url: str, **overrides: Any) -> RouterConfig:
    """The relay of one worker `w0`: its stream repaired and proven as a router's."""
    return router_config(
        [("w0", worker.url)], cluster=cluster(nats_url, **overrides.pop("cluster", {}))
    )


def follower_config(
    worker: ReferenceWorker, nats_url: str, name: str, **overrides: Any
) -> RouterConfig:
    """A replica in front of `w0` that reads its KV events from the relay only."""
    fields: dict[str, Any] = {"indexer": IndexerSection(pending_ttl_s=0.5, stale_after_s=1.5)}
    fields.update(overrides)
    config = replica_config([("w0", worker.url)], nats_url, name, **fields)
    assert config.cluster is not None
    return msgspec.structs.replace(
        config, cluster=msgspec.structs.replace(config.cluster, events="relay")
    )


@contextlib.asynccontextmanager
async def relay(worker: ReferenceWorker, nats_url: str) -> AsyncIterator[RouterService]:
    async with RouterService(relay_config(worker, nats_url), relay=True) as service:
        assert service.relay is not None
        yield service


async def generate(session: aiohttp.ClientSession, url: str, salt: str = "t") -> tuple[int, int]:
    """(predicted, cached) tokens of one request of PROMPT through `url`."""
    body = {"text": PROMPT, "cache_salt": salt, "sampling_params": {"max_new_tokens": 1}}
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        predicted = int(resp.headers.get("x-kvroute-matched-tokens", "0"))
    return predicted, int(answer["meta_info"]["cached_tokens"])


async def past_the_buffer(session: aiohttp.ClientSession, worker: ReferenceWorker) -> None:
    """Three batches straight to `worker`: what it published before is gone from a replay
    buffer of two."""
    for other in range(3):
        body = {"input_ids": [other + 7] * 32, "sampling_params": {"max_new_tokens": 1}}
        async with session.post(worker.url + "/generate", json=body) as resp:
            assert resp.status == 200


async def index_prompt(fleet: Fleet, session: aiohttp.ClientSession) -> None:
    """Send PROMPT through `fleet`'s router once its stream delivers, and wait until the
    router's index holds it (through the relay, for a follower)."""
    await fleet.warm()
    await generate(session, fleet.url)
    await eventually(lambda: _holds(fleet, 64), what="the prompt to be indexed")


async def predicted(fleet: Fleet, salt: str = "t") -> int:
    plan = await fleet.route({"text": PROMPT, "cache_salt": salt})
    return max((int(c["matched_tokens"]) for c in plan["candidates"]), default=0)


async def test_a_follower_holds_what_the_relay_subscribed_to_and_opens_no_worker_socket(
    nats_server: NatsServer,
) -> None:
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        relay(w0, nats_server.url) as r,
    ):
        async with RouterService(follower_config(w0, nats_server.url, "a")) as a:
            assert a.indexer.fed is not None  # no subscriber: streams fed by the relay
            fleet = Fleet(a, {"w0": w0}, session)
            await fleet.warm()
            first = await generate(session, a.url)
            assert first == (0, 0)
            await eventually(
                lambda: _holds(fleet, 64), what="the relay's records to reach the replica"
            )
            again = await generate(session, a.url)
            # predicted what the worker then served from its cache, no more
            assert again[0] >= 64
            assert again[0] <= again[1]
            streams = {s.stream: s for s in a.indexer.streams()}
            batches = streams["w0#dp0"].batches
            assert batches > 0
            metrics = await (await session.get(a.url + "/metrics")).text()
            # every batch the replica's stream took came as one relay record, counted applied
            # (so do the relay's heartbeats: at least, not equal)
            applied = _sample(metrics, "kvroute_cluster_relay_records_applied_total")
            assert applied >= batches
        status, body = await _health(session, r)
        assert status == 200 and body["relay"]["published"] > 0
        relay_metrics = await (await session.get(r.url + "/metrics")).text()
        published = _sample(relay_metrics, "kvroute_cluster_relay_records_published_total")
        assert published >= body["relay"]["published"]
        # the relay follows w0 as a router does: its stream is proven
        synced = {"worker": "w0", "dp_rank": "0", "state": "synced"}
        assert _sample(relay_metrics, "kvroute_stream_state", **synced) == 1


async def _holds(fleet: Fleet, tokens: int, salt: str = "t") -> bool:
    return await predicted(fleet, salt) >= tokens


async def _health(session: aiohttp.ClientSession, service: RouterService) -> tuple[int, Any]:
    async with session.get(service.url + "/health") as resp:
        return resp.status, await resp.json()


def _sample(text: str, name: str, **labels: str) -> float:
    """The one sample `name` with `labels` among its labels in a `/metrics` answer."""
    (value,) = (
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
    return value


async def test_when_the_relay_stops_the_followers_stream_goes_stale_and_predicts_nothing(
    nats_server: NatsServer,
) -> None:
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        RouterService(follower_config(w0, nats_server.url, "a")) as a,
    ):
        fleet = Fleet(a, {"w0": w0}, session)
        async with relay(w0, nats_server.url):
            await index_prompt(fleet, session)
            # an idle worker: the relay's heartbeats alone keep the stream trusted, longer
            # than the indexer's stale_after_s (1.5 s) and the heartbeat timeout (0.5 s)
            await asyncio.sleep(2.0)
            states = {s.stream: s.state for s in a.indexer.streams()}
            assert states["w0#dp0"] == "synced"
            assert await predicted(fleet) >= 64
        # no relay: nothing tells this replica what the worker evicts any more

        async def stale() -> bool:
            states = {s.stream: s.state for s in a.indexer.streams()}
            return states.get("w0#dp0") == "stale"

        await eventually(stale, what="the stream to go stale without the relay")
        assert await predicted(fleet) == 0


async def test_a_relay_restart_that_missed_a_flush_leaves_no_false_hit(
    nats_server: NatsServer,
) -> None:
    """Whatever happened while no relay ran is unknown to the followers: the new relay's
    records (a new epoch) make them start the stream afresh, so the flush they never saw
    cannot leave the old prefix predicted. The worker's replay buffer (two batches) no longer
    holds the flush when the new relay joins, so no record of it ever comes."""
    async with (
        workers(1, buffer_steps=2) as (w0,),
        aiohttp.ClientSession() as session,
        RouterService(follower_config(w0, nats_server.url, "a")) as a,
    ):
        fleet = Fleet(a, {"w0": w0}, session)
        async with relay(w0, nats_server.url):
            await index_prompt(fleet, session)
        async with session.post(w0.url + "/flush_cache") as resp:
            assert resp.status == 200
        await past_the_buffer(session, w0)
        async with relay(w0, nats_server.url):

            async def afresh() -> bool:
                stats = {s.stream: s for s in a.indexer.streams()}["w0#dp0"]
                return stats.restarts >= 1 and stats.state == "synced"

            await eventually(afresh, what="the stream to follow the new relay")
            assert await predicted(fleet) == 0
            got = await generate(session, a.url)
            assert got[0] <= got[1]


async def _snapshot_from(
    session: aiohttp.ClientSession, worker: ReferenceWorker, nats_url: str
) -> None:
    """A follower `a` indexes PROMPT through the relay running now and publishes the index
    snapshot that a later replica starts from."""
    async with RouterService(follower_config(worker, nats_url, "a")) as a:
        fleet = Fleet(a, {"w0": worker}, session)
        await index_prompt(fleet, session)
        assert a.cluster is not None
        assert await a.cluster.publish_snapshot() > 0


async def test_a_warm_start_is_trusted_once_the_relay_shows_its_last_batch(
    nats_server: NatsServer,
) -> None:
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        relay(w0, nats_server.url),
    ):
        await _snapshot_from(session, w0, nats_server.url)
        async with RouterService(follower_config(w0, nats_server.url, "c")) as c:
            assert c.cluster is not None and c.cluster.snapshot_at is not None
            # ready means proven: the first look at the prompt predicts the hit
            fleet_c = Fleet(c, {"w0": w0}, session)
            assert await predicted(fleet_c) >= 64
            got = await generate(session, c.url)
            assert 64 <= got[0] <= got[1]


async def test_a_snapshot_loaded_into_a_running_follower_is_proven_by_the_relays_past(
    nats_server: NatsServer,
) -> None:
    """`POST /admin/index/load` on a follower of the relay, of a snapshot the worker has moved
    past (another tenant's prompt stored since): the relay's stream is read back for it, the
    snapshot proven at its last batch and what came since applied. Before, only a warm start
    read from the snapshot's time: the next live heartbeat, past the snapshot, dropped it,
    and the prompt the worker still held was predicted nothing (QA: 592 tokens held, 0)."""
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        relay(w0, nats_server.url),
        RouterService(follower_config(w0, nats_server.url, "a")) as a,
    ):
        fleet = Fleet(a, {"w0": w0}, session)
        await index_prompt(fleet, session)
        async with session.get(a.url + "/admin/index/dump", headers=AUTH) as resp:
            assert resp.status == 200
            snapshot = await resp.read()
        got = await generate(session, a.url, salt="since")  # the worker moves past it
        assert got[1] == 0

        async def since_indexed() -> bool:
            return await predicted(fleet, salt="since") >= 64

        await eventually(since_indexed, what="the later prompt indexed")
        await asyncio.sleep(1.0)  # the relay's heartbeats past the snapshot go by
        async with session.post(a.url + "/admin/index/load", data=snapshot, headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()

        async def both_predicted() -> bool:
            return await predicted(fleet) >= 64 and await predicted(fleet, salt="since") >= 64

        await eventually(both_predicted, what="the snapshot proven and the rest applied")
        got = await generate(session, a.url)
        assert 64 <= got[0] <= got[1]


async def test_a_snapshot_the_worker_moved_past_unseen_is_not_trusted(
    nats_server: NatsServer,
) -> None:
    """The worker flushed after the snapshot while the relay was away, and its replay buffer
    (two batches) no longer holds the flush: the new relay's batches do not continue the
    snapshot's, so the warm start predicts nothing of it."""
    async with workers(1, buffer_steps=2) as (w0,), aiohttp.ClientSession() as session:
        async with relay(w0, nats_server.url):
            await _snapshot_from(session, w0, nats_server.url)
        async with session.post(w0.url + "/flush_cache") as resp:
            assert resp.status == 200
        await past_the_buffer(session, w0)
        async with (
            relay(w0, nats_server.url),
            RouterService(follower_config(w0, nats_server.url, "c")) as c,
        ):
            assert c.cluster is not None and c.cluster.snapshot_at is not None
            fleet_c = Fleet(c, {"w0": w0}, session)

            async def settled() -> bool:
                stats = {s.stream: s for s in c.indexer.streams()}["w0#dp0"]
                return stats.state == "synced"

            await eventually(settled, what="the stream to follow the relay")
            assert await predicted(fleet_c) == 0
            got = await generate(session, c.url)
            assert got[0] <= got[1]


async def test_the_relay_refuses_a_config_without_a_cluster() -> None:
    async with workers(1) as (w0,):
        with pytest.raises(ConfigError, match=r"\[cluster\]"):
            RouterService(router_config([("w0", w0.url)]), relay=True)


async def test_a_worker_the_relay_removes_and_adds_again_is_dropped_by_its_followers(
    nats_server: NatsServer,
) -> None:
    """While the relay does not follow the worker, the worker's removals reach nobody: its
    followers drop the stream when the relay drops it, not keep pages evicted meanwhile (the
    worker's replay buffer, two batches, no longer holds the flush when it is added again)."""
    async with (
        workers(1, buffer_steps=2) as (w0,),
        aiohttp.ClientSession() as session,
        relay(w0, nats_server.url) as r,
        RouterService(follower_config(w0, nats_server.url, "a")) as a,
    ):
        fleet = Fleet(a, {"w0": w0}, session)
        await index_prompt(fleet, session)
        async with session.delete(r.url + "/admin/workers/w0", headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
        async with session.post(w0.url + "/flush_cache") as resp:
            assert resp.status == 200
        await past_the_buffer(session, w0)
        body = {"id": "w0", "url": w0.url}
        async with session.post(r.url + "/admin/workers", json=body, headers=AUTH) as resp:
            assert resp.status in (201, 202), await resp.text()
        await eventually(
            lambda: _predicts_nothing(fleet), what="the follower to drop the removed stream"
        )
        got = await generate(session, a.url)
        assert got[0] <= got[1]


async def _predicts_nothing(fleet: Fleet) -> bool:
    return await predicted(fleet) == 0


async def test_a_replica_starting_after_the_relay_died_trusts_nothing_of_its_old_records(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A relay killed (no last word) leaves records in the stream that were true when it
    wrote them: a replica starting later reads them as the past they are (stale), not as now,
    while the worker evicts with nobody watching."""
    async with workers(1) as (w0,), aiohttp.ClientSession() as session:
        config = tmp_path / "relay.json"
        config.write_bytes(msgspec.json.encode(relay_config(w0, nats_server.url)))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.commands.cli", "relay", "--config", str(config),
            "--port", "0", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            async with RouterService(follower_config(w0, nats_server.url, "a")) as a:
                fleet = Fleet(a, {"w0": w0}, session)
                await index_prompt(fleet, session)
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        async with session.post(w0.url + "/flush_cache") as resp:
            assert resp.status == 200
        await asyncio.sleep(1.0)  # the relay's last heartbeat is older than the timeout (0.5 s)
        async with RouterService(follower_config(w0, nats_server.url, "b")) as b:
            fleet_b = Fleet(b, {"w0": w0}, session)
            assert {s.stream: s.state for s in b.indexer.streams()}["w0#dp0"] == "stale"
            assert await predicted(fleet_b) == 0


async def test_a_nats_server_that_lost_its_store_gets_the_relays_stream_again(
    tmp_path: Path,
) -> None:
    """The stream is gone with the store: the relay (or the follower, whichever checks first)
    makes it again and the follower subscribes again, so new prompts are predicted again
    instead of never (the records lost show as numbers skipped: the stream starts afresh)."""
    nats = NatsServer(store_dir=tmp_path)
    await nats.start()
    try:
        async with (
            workers(1) as (w0,),
            aiohttp.ClientSession() as session,
            relay(w0, nats.url),
            RouterService(follower_config(w0, nats.url, "a")) as a,
        ):
            fleet = Fleet(a, {"w0": w0}, session)
            await fleet.warm()
            await nats.stop()
            shutil.rmtree(tmp_path / "jetstream", ignore_errors=True)
            await nats.start()
            salts = iter(range(1000))

            async def recovered() -> bool:
                # a new tenant each time: records written before the stream was made again
                # are lost (the follower then starts the stream afresh, as it should)
                salt = f"after-{next(salts)}"
                await generate(session, a.url, salt)
                await asyncio.sleep(0.2)
                return await _holds(fleet, 64, salt)

            await eventually(recovered, timeout_s=20, what="the follower to read the stream again")
    finally:
        await nats.stop()


async def test_a_worker_a_replica_follows_later_is_read_back_from_the_relays_stream(
    nats_server: NatsServer,
) -> None:
    """The relay wrote the worker's records before this replica followed it (added through
    its admin API later): the replica reads back what the stream keeps, and the prompt the
    worker cached before is predicted at once, not only once the worker stores anew."""
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        relay(w0, nats_server.url) as r,
    ):
        relay_fleet = Fleet(r, {"w0": w0}, session)
        await relay_fleet.warm()
        body = {"text": PROMPT, "cache_salt": "t", "sampling_params": {"max_new_tokens": 1}}
        async with session.post(w0.url + "/generate", json=body) as resp:
            assert resp.status == 200
        await eventually(lambda: _holds(relay_fleet, 64), what="the relay to index the prompt")
        later = msgspec.structs.replace(follower_config(w0, nats_server.url, "a"), workers=())
        async with RouterService(later) as a:
            fleet = Fleet(a, {"w0": w0}, session)
            status, _ = await fleet.admin("POST", "/workers", {"id": "w0", "url": w0.url})
            assert status in (201, 202)
            await eventually(lambda: _holds(fleet, 64), what="the stream to be read back")
            got = await generate(session, a.url)
            assert 64 <= got[0] <= got[1]


async def test_every_stream_of_a_live_relay_stays_fresh_on_an_idle_fleet(
    nats_server: NatsServer,
) -> None:
    """The relay heartbeats its streams back to back: each is fresh, not only the last of
    the burst (freshness is a record's age by the server's clock, not "nothing behind it")."""
    async with (
        workers(2) as (w0, w1),
        aiohttp.ClientSession() as session,
        RouterService(
            router_config([("w0", w0.url), ("w1", w1.url)], cluster=cluster(nats_server.url)),
            relay=True,
        ),
    ):
        config = follower_config(w0, nats_server.url, "a")
        config = msgspec.structs.replace(
            config,
            workers=(
                *config.workers,
                msgspec.structs.replace(config.workers[0], id="w1", url=w1.url),
            ),
        )
        async with RouterService(config) as a:
            fleet = Fleet(a, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            await asyncio.sleep(2.0)  # idle: longer than the heartbeat timeout (0.5 s)

            # the relay's presence comes every 25 ms here, gone after 75 ms: on a loaded CI
            # host a late one may make both streams STALE a moment (as it should), and the next
            # record trusts them again; what must hold is that idle streams are fresh
            async def fresh() -> bool:
                states = {s.stream: s.state for s in a.indexer.streams()}
                return states == {"w0#dp0": "synced", "w1#dp0": "synced"}

            await eventually(fresh, timeout_s=1.0, what="both idle streams fresh")


async def test_a_worker_the_relay_registered_anew_before_a_replica_saw_it_back_is_predicted(
    nats_server: NatsServer,
) -> None:
    """The worker restarted with two ranks; the relay saw it back first, registered it anew
    and indexed what the new process cached. The replica's health check then sees it come
    back: what it holds came from the relay's records since it saw the worker down, so there
    is nothing to prove. Before, its streams stayed UNVERIFIED (0 predicted against 64 cached)
    and were dropped 10 s later, waiting for a check the relay had no reason to make."""
    first = ReferenceConfig(time_scale=0.0, page_size=16)
    w0 = ReferenceWorker(first)
    await w0.__aenter__()
    try:
        # the replica's health checks are this test's (a round now and then would race it)
        replica = follower_config(
            w0, nats_server.url, "a", health=HealthConfig(interval_s=3600, timeout_s=0.5)
        )
        async with (
            aiohttp.ClientSession() as session,
            relay(w0, nats_server.url) as r,
            RouterService(replica) as a,
        ):
            entry = a.planner.pool.get("w0")
            await a.supervisor.check(entry)
            fleet = Fleet(a, {"w0": w0}, session)
            await fleet.warm()
            port = int(w0.url.rsplit(":", 1)[1])
            await w0.__aexit__(None, None, None)
            assert not await a.supervisor.check(entry)  # seen down here
            await asyncio.sleep(2 * ANEW_MARGIN_S)  # the margin a record's age is read with
            w0 = ReferenceWorker(msgspec.structs.replace(first, dp_size=2, port=port))
            await w0.__aenter__()

            async def relay_indexed_the_new_process() -> bool:
                # straight to the worker: the replica does not route to it yet
                body = {"text": PROMPT, "cache_salt": "t", "sampling_params": {"max_new_tokens": 1}}
                async with session.post(w0.url + "/generate", json=body) as resp:
                    assert resp.status == 200
                streams = a.indexer.streams()
                return (
                    len(streams) == 2
                    and sum(s.entries for s in streams) >= 4
                    and _synced(a)
                    # the relay's own health check saw it back too: no check of the relay's
                    # is left to come and end a suspicion (the case this test is about)
                    and r.planner.pool.get("w0").healthy
                    and _synced(r)
                )

            await eventually(
                relay_indexed_the_new_process, timeout_s=20, what="the relay's new registration"
            )
            assert await a.supervisor.check(entry)  # back, as this replica sees it

            async def trusted() -> bool:
                return _synced(a) and await predicted(fleet) >= 64

            await eventually(trusted, timeout_s=5, what="the new process's pages to be predicted")
            await asyncio.sleep(11.0)  # past the verify window (10 s): nothing dropped
            got = await generate(session, a.url)
            assert 64 <= got[0] <= got[1]
    finally:
        await w0.__aexit__(None, None, None)


async def test_a_worker_restarted_with_another_page_size_between_probes_is_followed_at_once(
    nats_server: NatsServer,
) -> None:
    """The worker came back with page size 32 before the replica's next probe: the relay saw
    it (its subscriber and its own health checks), the replica's health check did not. The
    relay's records tell the replica (the restart it counted, pages that do not fit), which
    reads the worker's settings again, as a subscriber's restart makes a router do. Before,
    the replica's stream stayed at 16, `synced`, every prediction 0, until the settings
    cadence (60 s)."""
    # the same event ports again, as an engine restarted with its flags: the relay's
    # subscriber sees the restart (on new ports the relay finds it only once the stream is
    # STALE, and its own probes may miss the restart too)
    http, events, replay = free_ports(3)
    first = ReferenceConfig(
        time_scale=0.0, page_size=16, port=http, events_port=events, replay_port=replay
    )
    w0 = ReferenceWorker(first)
    await w0.__aenter__()
    try:
        replica = follower_config(
            w0,
            nats_server.url,
            "a",
            # no probe of the replica's sees it down, no slow cadence reads it within the test
            health=HealthConfig(interval_s=3600, timeout_s=0.5, settings_interval_s=60.0),
        )
        async with (
            aiohttp.ClientSession() as session,
            relay(w0, nats_server.url),
            RouterService(replica) as a,
        ):
            fleet = Fleet(a, {"w0": w0}, session)
            await fleet.warm()
            assert a.indexer.block_size("w0") == 16
            await w0.__aexit__(None, None, None)
            w0 = ReferenceWorker(msgspec.structs.replace(first, page_size=32))
            await w0.__aenter__()

            async def followed() -> bool:
                # straight to the worker: its pages of 32 reach the replica through the relay
                body = {"text": PROMPT, "cache_salt": "t", "sampling_params": {"max_new_tokens": 1}}
                async with session.post(w0.url + "/generate", json=body) as resp:
                    assert resp.status == 200
                return a.indexer.block_size("w0") == 32 and await predicted(fleet) >= 64

            await eventually(followed, timeout_s=15, what="the replica to follow page size 32")
            assert a.planner.pool.get("w0").healthy  # never seen down here
            got = await generate(session, a.url)
            assert 64 <= got[0] <= got[1]
    finally:
        await w0.__aexit__(None, None, None)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (the worker binds them a moment later)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _synced(service: RouterService) -> bool:
    return all(s.state == "synced" for s in service.indexer.streams())


async def test_a_stream_read_back_from_the_relays_stream_predicts_nothing_of_its_past(
    nats_server: NatsServer,
) -> None:
    """The relay wrote PROMPT's pages, hundreds of batches after them, then the worker's flush;
    a replica follows the worker only then (added through its admin API) and reads its records
    back one at a time, each saying `synced` (the relay's state when written). Before, the
    flushed prompt was predicted while they were read (QA: 288 tokens matched, 0 cached); now
    the stream predicts nothing until the read-back and what came meanwhile are applied."""
    async with (
        workers(1, max_running_requests=1) as (w0,),
        aiohttp.ClientSession() as session,
        relay(w0, nats_server.url) as r,
    ):
        relay_fleet = Fleet(r, {"w0": w0}, session)
        await relay_fleet.warm()
        body = {"text": PROMPT, "cache_salt": "t", "sampling_params": {"max_new_tokens": 1}}
        async with session.post(w0.url + "/generate", json=body) as resp:
            assert resp.status == 200
        await eventually(lambda: _holds(relay_fleet, 64), what="the relay to index the prompt")
        # one batch per prompt (one prompt a step), then the flush: the prompt is gone
        fill = [[200, 201, i % 250 + 3] * 6 for i in range(300)]
        filling = {"input_ids": fill, "sampling_params": {"max_new_tokens": 1}}
        async with session.post(w0.url + "/generate", json=filling) as resp:
            assert resp.status == 200
        async with session.get(w0.url + "/flush_cache") as resp:
            assert resp.status == 200

        async def flushed() -> bool:
            return await predicted(relay_fleet) == 0 and _synced(r)

        await eventually(flushed, what="the relay to see the flush")
        later = msgspec.structs.replace(follower_config(w0, nats_server.url, "a"), workers=())
        async with RouterService(later) as a:
            fleet = Fleet(a, {"w0": w0}, session)
            cluster_service = a.cluster
            assert cluster_service is not None and cluster_service.follower is not None
            follower = cluster_service.follower
            seen: list[int] = []
            held_past = 0  # polls at which the stream held pages of the records read back
            stop = asyncio.Event()

            async def watch() -> None:
                nonlocal held_past
                while not stop.is_set():
                    body = {"text": PROMPT, "cache_salt": "t"}
                    status, plan = await fleet.admin("POST", "/route", body)
                    if status == 200:  # (503 until the worker's models are discovered)
                        seen.extend(int(c["matched_tokens"]) for c in plan["candidates"])
                    held_past += sum(s.entries for s in a.indexer.streams())

            task = asyncio.create_task(watch())
            try:
                status, _ = await fleet.admin("POST", "/workers", {"id": "w0", "url": w0.url})
                assert status in (201, 202)

                async def read_back() -> bool:
                    return not follower._catching and _synced(a) and a.indexer.streams() != []

                await eventually(read_back, timeout_s=20, what="the stream to be read back")
            finally:
                stop.set()
                await task
            assert seen and max(seen) == 0
            assert held_past > 0  # it did hold the flushed prompt's past while reading
            got = await generate(session, a.url)
            assert got[0] <= got[1]


async def test_a_relay_restart_keeps_the_extra_key_shadows_a_replica_loaded(
    nats_server: NatsServer,
) -> None:
    """QA: a follower that started from the cluster's snapshot took its `extra_key` shadows,
    judged by the worker's next batch. A new relay process reads the worker's buffer back from
    its oldest batch, seq 0, which the judgment took for a new worker process: the shadows were
    dropped, and a plain request of the salt was predicted the extra_key's pages (320 tokens,
    0 cached). The worker never restarted."""
    prompt = [(i * 11) % 200 + 5 for i in range(20 * 16 + 1)]
    plain: dict[str, Any] = {"input_ids": prompt, "cache_salt": "tenant-x"}
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        contextlib.AsyncExitStack() as first_relay,
    ):
        await first_relay.enter_async_context(relay(w0, nats_server.url))
        async with RouterService(follower_config(w0, nats_server.url, "a")) as a:
            other = await extra_key_snapshot(Fleet(a, {"w0": w0}, session), plain)
        async with RouterService(follower_config(w0, nats_server.url, "c")) as c:
            on_c = Fleet(c, {"w0": w0}, session)
            assert await on_c.holds(other, "w0", 320)  # warm from the snapshot
            assert not await on_c.holds(plain, "w0", 16)
            await first_relay.aclose()
            async with relay(w0, nats_server.url):

                async def afresh() -> bool:
                    stats = {s.stream: s for s in c.indexer.streams()}["w0#dp0"]
                    return stats.restarts >= 1 and stats.state == "synced"

                await eventually(afresh, what="c to follow the new relay")
                await eventually(lambda: on_c.holds(other, "w0", 320), what="its records")
                assert not await on_c.holds(plain, "w0", 16)
                body = {**plain, "sampling_params": {"max_new_tokens": 1}}
                async with session.post(c.url + "/generate", json=body) as resp:
                    assert resp.status == 200
                    answer = await resp.json()
                    assert int(resp.headers["x-kvroute-matched-tokens"]) == 0
                    assert answer["meta_info"]["cached_tokens"] == 0
