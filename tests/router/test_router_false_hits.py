"""A pod replaced behind its URL while the old one keeps running: the old sockets answer every
probe (never STALE), the health check never fails; the router's over-predictions
(`router.fleet.false_hits`) and the slow settings cadence (`health.settings_interval_s`) catch
it. And a worker whose `/server_info` cannot be read is said so."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from functools import partial
from typing import Any, NamedTuple

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import HealthConfig, IndexerSection
from router.fleet.false_hits import GROSS_PAGES, STREAK, WINDOW, FalseHitWatch
from router.service import RouterService
from tests.router.conftest import AUTH, eventually, router_config, unfollow
from tests.router.test_router_worker_restart import PROBE_S, Front
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 16


def prompt(i: int, kind: str) -> dict[str, Any]:
    """Prompts sharing no page with each other, long enough (well over GROSS_PAGES pages) for
    a wrong cache to be told from an eviction."""
    return {"prompt": f"{i} {kind} prompt: " + "lorem ipsum dolor " * 40, "max_tokens": 1}


class Client:
    """The router's answers: what it predicted, what the worker reused."""

    def __init__(self, session: aiohttp.ClientSession, router: RouterService) -> None:
        self._session = session
        self._url = router.url

    async def send(self, body: dict[str, Any]) -> tuple[int, int]:
        """(x-kvroute-matched-tokens, the answer's cached_tokens)."""
        async with self._session.post(self._url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            matched = int(resp.headers["x-kvroute-matched-tokens"])
            answer = await resp.json()
        return matched, answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def predicted(self, body: dict[str, Any]) -> int:
        async with self._session.post(self._url + "/admin/route", json=body, headers=AUTH) as resp:
            plan = await resp.json()
        return sum(c["matched_tokens"] for c in plan["candidates"])

    async def indexed(self, bodies: list[dict[str, Any]]) -> bool:
        return all([await self.predicted(b) > 0 for b in bodies])


class Pods(NamedTuple):
    """Two pods, a front (the Service) pointing at the old one, and a router behind it."""

    old: ReferenceWorker
    new: ReferenceWorker
    front: Front
    router: RouterService


@contextlib.asynccontextmanager
async def old_pod_behind_front(
    settings_interval_s: float = 600.0, stale_after_s: float = 1.0
) -> AsyncIterator[Pods]:
    """A router in front of worker `w`, served by the old pod until a test moves the front.
    The default cadence and STALE re-read are far off: only the answers can tell."""
    config = ReferenceConfig(time_scale=0.0, page_size=PAGE)
    async with (
        ReferenceWorker(config) as old_pod,
        ReferenceWorker(config) as new_pod,
        Front(old_pod.url) as front,
    ):
        router_cfg = router_config(
            [("w", front.url)],
            health=HealthConfig(
                interval_s=0.1, timeout_s=0.5, settings_interval_s=settings_interval_s
            ),
            indexer=IndexerSection(probe_interval_s=PROBE_S, stale_after_s=stale_after_s),
        )
        async with RouterService(router_cfg) as router:
            yield Pods(old_pod, new_pod, front, router)


def on_ports_of(router: RouterService, worker: ReferenceWorker) -> bool:
    configs = router.indexer.stream_configs("w")  # none while it is subscribed anew
    return [c.endpoint for c in configs] == worker.kv_events.endpoints


async def test_a_pod_replaced_while_the_old_one_runs_on_is_caught_by_its_false_hits() -> None:
    """The old pod answers its replay probes, so its stream stays SYNCED, and the new one is
    never read again: every request was predicted from the old pod's cache (QA: 12 of 12
    false hits over 33 s). Now STREAK of its last answers reusing far less than predicted have
    the worker's settings read at once: the new pod's event ports register it anew."""
    async with old_pod_behind_front() as pods, aiohttp.ClientSession() as session:
        _, new_pod, front, router = pods
        client = Client(session, router)
        old = [prompt(i, "old") for i in range(STREAK + 4)]
        for body in old:
            await client.send(body)
        await eventually(partial(client.indexed, old), what="the old pod's prompts indexed")

        front.target = new_pod.url  # the old pod runs on, answering its probes
        for body in old[:STREAK]:
            matched, cached = await client.send(body)
            assert matched > cached  # a false hit: the new pod never saw it

        async def anew() -> bool:
            return on_ports_of(router, new_pod)

        await eventually(anew, timeout_s=5.0, what="registered anew on the new pod's ports")
        # the old pod's cache predicts nothing from here on
        for body in old[STREAK:]:
            assert await client.send(body) == (0, 0)
        new = [prompt(i, "new") for i in range(4)]
        for body in new:
            await client.send(body)
        await eventually(partial(client.indexed, new), what="the new pod's pages predicted")
        for body in new:
            matched, cached = await client.send(body)
            assert matched == cached > 0
        assert router.planner.pool.get("w").healthy


async def test_a_streak_follows_nothing_of_the_worker_while_its_settings_are_read_again() -> None:
    """Before, the streak subscribed the worker's streams anew at once and read its settings
    in parallel: the new subscription caught up over the old sockets (the old pod runs on) and
    was trusted before the re-read could register the new pod's (QA: one more false hit 50 ms
    after the streak). Now nothing of the worker is followed until the re-read ended (here
    it hangs, so for two health timeouts)."""
    async with old_pod_behind_front() as pods, aiohttp.ClientSession() as session:
        _, new_pod, front, router = pods
        client = Client(session, router)
        old = [prompt(i, "old") for i in range(STREAK + 1)]
        for body in old:
            await client.send(body)
        await eventually(partial(client.indexed, old), what="the old pod's prompts indexed")
        front.target = new_pod.url
        front.info = "slow"  # the re-read hangs
        for body in old[:STREAK]:
            matched, cached = await client.send(body)
            assert matched > cached  # a false hit: the new pod never saw it
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.8  # within the two health timeouts (0.5 s each) it waits
        polls = 0
        while loop.time() < until:
            assert await client.predicted(old[STREAK]) == 0
            polls += 1
            await asyncio.sleep(0.02)
        assert polls > 10


class TcpForward:
    """A Service's port: each new connection goes to the pod it points at now (`port`), the
    open ones stay where they were (as kube-proxy does). While `opened` is clear, a new
    connection waits before it reaches the pod (one that comes up late: a slow handshake on a
    loaded host)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listen = 0
        self.opened = asyncio.Event()
        self.opened.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> TcpForward:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.listen = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        # tracked, so the exit cancels it (the server's own handler tasks are not)
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._spawn(self._connect(reader, writer))

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self.opened.wait()
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        except (OSError, asyncio.CancelledError):
            writer.close()
            raise
        self._spawn(self._pipe(reader, up_writer))
        self._spawn(self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


async def test_a_pod_replaced_behind_a_service_with_the_same_sockets_is_followed_anew(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both pods advertise the same sockets (the Service's: SGLang's `tcp://*:5557` behind a
    Service URL), so the settings read again are the ones it was registered with. The old
    pod, still running, kept the router's open connections: putting the streams in doubt
    only had a replay over them prove the old pod again (QA: 24 of 24 false hits over 46 s,
    until the old pod exited). Now the streak subscribes the streams anew, their entries
    dropped: the new connections reach the new pod, and its pages are predicted. Its settings
    read again are the ones it had: it is not registered anew (the re-read compared them with
    none, once: "runs other settings than it was registered with" at every first streak)."""
    config = ReferenceConfig(time_scale=0.0, page_size=PAGE)
    async with (
        ReferenceWorker(config) as old_pod,
        ReferenceWorker(config) as new_pod,
        TcpForward(port_of(old_pod.kv_events.endpoints[0])) as events,
        TcpForward(port_of(old_pod.kv_events.replay_endpoints[0])) as replay,
        Front(old_pod.url) as front,
        aiohttp.ClientSession() as session,
    ):
        async with session.get(old_pod.url + "/server_info") as resp:
            info = await resp.json()
        info["kv_events"]["endpoint_port_base"] = events.listen
        info["kv_events"]["replay_endpoint_port_base"] = replay.listen
        front.server_info = json.dumps(info).encode()  # what either pod says through it
        router_cfg = router_config(
            [("w", front.url)],
            health=HealthConfig(interval_s=0.1, timeout_s=0.5, settings_interval_s=600.0),
            indexer=IndexerSection(probe_interval_s=PROBE_S, stale_after_s=1.0),
        )
        async with RouterService(router_cfg) as router:
            client = Client(session, router)
            old = [prompt(i, "old") for i in range(STREAK + 4)]
            for body in old:
                await client.send(body)
            await eventually(partial(client.indexed, old), what="the old pod's prompts indexed")

            front.target = new_pod.url  # the Service moves on; the old pod runs on
            events.port = port_of(new_pod.kv_events.endpoints[0])
            replay.port = port_of(new_pod.kv_events.replay_endpoints[0])
            caplog.set_level(logging.WARNING, logger="router.fleet")
            for body in old[:STREAK]:
                matched, cached = await client.send(body)
                assert matched > cached == 0  # a false hit: the new pod never saw it

            def said() -> list[str]:
                return [r.getMessage() for r in caplog.records if "of its last" in r.getMessage()]

            async def followed_anew() -> bool:
                return bool(said())

            await eventually(followed_anew, timeout_s=5.0, what="the streams subscribed anew")
            assert said() == [
                f"worker w: {STREAK} of its last {WINDOW} answers reused far fewer tokens than "
                f"predicted (the last: 0 of {matched}): its KV-event streams are subscribed "
                "anew, their entries dropped, and its settings read again (another process may "
                "be serving its URL)"
            ]
            # the old pod's cache predicts nothing from here on, and the new pod's does
            for body in old[STREAK:]:
                assert await client.send(body) == (0, 0)
            new = [prompt(i, "new") for i in range(4)]
            for body in new:
                await client.send(body)
            await eventually(partial(client.indexed, new), what="the new pod's pages predicted")
            for body in new + old[STREAK:]:
                matched, cached = await client.send(body)
                assert matched == cached > 0
            assert not [m for m in said_all(caplog) if "runs other settings" in m]


def said_all(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


async def test_sockets_that_reach_the_old_pod_again_leave_the_worker_unfollowed_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The old pod's own sockets (its `/server_info` gave their address, and the front still
    answers it: the settings look unchanged): subscribed anew, the streams followed the old
    pod again, and every request was a false hit (QA: 30 of 30 over 44 s). A second streak
    soon after leaves the worker unfollowed (routed by load, no hit predicted) for twice
    `stale_after_s`, then follows it again, judged again by its answers."""
    async with old_pod_behind_front() as pods, aiohttp.ClientSession() as session:
        old_pod, new_pod, front, router = pods
        client = Client(session, router)
        old = [prompt(i, "old") for i in range(4 * STREAK)]
        for body in old:
            await client.send(body)
        await eventually(partial(client.indexed, old), what="the old pod's prompts indexed")
        async with session.get(old_pod.url + "/server_info") as resp:
            front.server_info = await resp.read()  # the old pod's sockets, as it said them
        front.target = new_pod.url
        caplog.set_level(logging.WARNING, logger="router.fleet.false_hit_response")

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "of its last" in r.getMessage()]

        for body in old[:STREAK]:
            matched, cached = await client.send(body)
            assert matched > cached == 0
        await eventually(partial(_said, said, 1), what="the first streak acted on")
        assert "subscribed anew" in said()[0]
        # the new subscription reaches the old pod again: its replay brings its pages back
        await eventually(partial(client.indexed, old[STREAK:]), what="the old pod followed again")
        for body in old[STREAK : 2 * STREAK]:
            matched, cached = await client.send(body)
            assert matched > cached == 0
        await eventually(partial(_said, said, 2), what="the second streak acted on")
        assert "not followed for 2 s (routed by load, no hit predicted)" in said()[1]
        # unfollowed: nothing is predicted of the old pod's cache, and /admin/workers says so
        assert not router.indexer.has_worker("w")
        assert 0 < await unfollowed_s(session, router) <= 2.0
        # and /metrics, for an alert: the seconds left, and what the watch did
        metrics = await scrape(session, router)
        assert 0 < metrics["kvroute_worker_unfollowed_seconds", "w", ""] <= 2.0
        assert metrics["kvroute_false_hit_actions_total", "w", "resubscribed"] == 1
        assert metrics["kvroute_false_hit_actions_total", "w", "unfollowed"] == 1
        for body in old[2 * STREAK : 3 * STREAK]:
            assert await client.send(body) == (0, 0)

        async def followed_again() -> bool:
            return router.indexer.has_worker("w")

        await eventually(followed_again, timeout_s=5.0, what="its streams followed again")
        assert len(said()) == 2  # one line a streak
        assert await unfollowed_s(session, router) == 0.0
        # followed again, it follows the old pod again: the next streak doubles the quarantine
        # (before, a quarantine longer than the quiet window started over at a resubscription)
        await eventually(partial(client.indexed, old[3 * STREAK :]), what="the old pod followed")
        for body in old[3 * STREAK :]:  # never sent to the new pod
            matched, cached = await client.send(body)
            assert matched > cached == 0
        await eventually(partial(_said, said, 3), what="the third streak acted on")
        assert "not followed for 4 s" in said()[2]


async def unfollowed_s(session: aiohttp.ClientSession, router: RouterService) -> float:
    async with session.get(router.url + "/admin/workers", headers=AUTH) as resp:
        (worker,) = (await resp.json())["workers"]
    return float(worker["unfollowed_s"])


async def scrape(
    session: aiohttp.ClientSession, router: RouterService
) -> dict[tuple[str, str, str], float]:
    """The false-hit watch's samples of /metrics by (name, worker, action)."""
    async with session.get(router.url + "/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, s.labels["worker"], s.labels.get("action", "")): s.value
        for family in text_string_to_metric_families(text)
        if family.name in ("kvroute_worker_unfollowed_seconds", "kvroute_false_hit_actions")
        for s in family.samples
        if not s.name.endswith("_created")
    }


async def _said(said: Callable[[], list[str]], lines: int) -> bool:
    return len(said()) >= lines


async def test_a_replaced_pod_is_caught_without_traffic_by_the_settings_cadence() -> None:
    """No request, no answer to tell: the healthy worker's `/server_info` is read again every
    `health.settings_interval_s` all the same, and the new pod's ports register it anew."""
    async with old_pod_behind_front(settings_interval_s=0.5, stale_after_s=30.0) as pods:
        old_pod, new_pod, front, router = pods

        async def registered() -> bool:
            return router.indexer.has_worker("w") and on_ports_of(router, old_pod)

        await eventually(registered, what="registered on the old pod's ports")
        reads = front.asked.count("/server_info")
        await asyncio.sleep(1.2)  # two cadences: read again, nothing changed
        assert 1 <= front.asked.count("/server_info") - reads <= 4
        assert on_ports_of(router, old_pod)
        front.target = new_pod.url

        async def anew() -> bool:
            return on_ports_of(router, new_pod)

        await eventually(anew, timeout_s=5.0, what="registered anew on the new pod's ports")


async def test_an_unreadable_server_info_is_said_once_per_back_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A healthy worker with a STALE stream has its settings read again at a back-off; one
    whose `/server_info` answers garbage was asked in bursts without a line in the log. Now
    each back-off interval says it once, with why."""
    async with ReferenceWorker(ReferenceConfig(time_scale=0.0)) as w, Front(w.url) as front:
        stale_after_s = 0.2
        router_cfg = router_config(
            [("w", front.url)],
            health=HealthConfig(interval_s=0.02, timeout_s=0.1),
            indexer=IndexerSection(probe_interval_s=0, stale_after_s=stale_after_s),
        )
        async with RouterService(router_cfg) as router:
            entry = router.planner.pool.get("w")

            async def up() -> bool:
                return entry.routable(router.planner.clock())

            await eventually(up, what="the worker registered and healthy")
            front.server_info = b"<html>not json"
            caplog.set_level(logging.WARNING, logger="router.fleet.reread_schedule")
            first = front.asked.count("/server_info")
            # back-offs of 0.2, 0.4, 0.8, 1.6 s
            await asyncio.sleep(stale_after_s + 2.0)
            reads = front.asked.count("/server_info") - first
            said = [
                r.getMessage()
                for r in caplog.records
                if "settings could not be read again" in r.getMessage()
            ]
            assert said, reads
            assert len(said) <= 4 < reads, (said, reads)
            assert said[0].startswith("worker w: ")
            assert "/get_server_info: DecodeError" in said[0]  # why, as the last path said


def test_evictions_that_keep_a_prefix_head_or_come_alone_never_make_a_streak() -> None:
    """KV pressure between routing and admission loses a prefix's tail and keeps its head, or
    now and then a whole prefix; a wrong cache loses every prediction but a shared prompt's."""
    told: list[tuple[str, int, int]] = []
    watch = FalseHitWatch(lambda worker: PAGE, lambda *args: told.append(args))
    for _ in range(4 * WINDOW):
        watch.answered("w", 320, 96)  # the head kept: 96 of 320, over a quarter
        watch.answered("w", 320, 0)  # a prefix evicted whole, one in three
        watch.answered("w", 320, 320)  # confirmed
        watch.answered("w", PAGE * (GROSS_PAGES - 1), 0)  # a short prompt tells nothing
        watch.answered("w", 0, 0)  # nothing predicted: nothing to confirm
    assert told == []
    # the old pod followed, a shared system prompt a true hit between the false ones
    for _ in range(STREAK):
        watch.answered("w", 384, 384)
        watch.answered("w", 304, 16)
    assert told == [("w", 304, 16)]
    watch.answered("w", 304, 16)  # counted afresh from there
    assert told == [("w", 304, 16)]
    watch.forget("w")
    for _ in range(STREAK):
        watch.answered("x", 304, 0)  # in a row, on another worker
    assert told == [("w", 304, 16), ("x", 304, 0)]


def _two_free_ports() -> int:
    """A port of 127.0.0.1 free now with the next one free too (rank 1 binds base + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return int(base)
    raise AssertionError("no two free ports in a row")


async def test_a_worker_restarted_with_more_ranks_while_unfollowed_is_read_again_first() -> None:
    """The false-hit watch leaves the worker unfollowed; meanwhile it restarts on its ports
    with two dp ranks, unseen (no health probe falls in the gap). When the quarantine ends,
    its settings are read again before its streams are followed: it is registered with both
    ranks. Before, it was followed again on the one rank it had at the streak, the new
    process's rank 0 trusted at once, and a request the engine placed on rank 1 was predicted
    rank 0's pages (QA: 4 of 9 prompts, 288 tokens, 0 cached) until a later re-read."""
    first = ReferenceConfig(
        time_scale=0.0,
        page_size=16,
        events_port=_two_free_ports(),
        replay_port=_two_free_ports(),
    )
    async with ReferenceWorker(first) as w0:
        config = router_config(
            [("w", w0.url)],
            health=HealthConfig(interval_s=600.0, timeout_s=0.5, settings_interval_s=600.0),
            indexer=IndexerSection(probe_interval_s=PROBE_S, stale_after_s=1.0),
        )
        async with RouterService(config) as router:
            indexer = router.planner.indexer
            await eventually(lambda: _ranks(router, 1), what="one rank registered")
            await unfollow(router, "w")  # for 2 s
            port = int(w0.url.rsplit(":", 1)[1])
            await w0.__aexit__(None, None, None)
            second = msgspec.structs.replace(first, port=port, dp_size=2)
            async with ReferenceWorker(second):

                async def followed() -> bool:
                    return indexer.has_worker("w")

                await eventually(followed, timeout_s=10.0, what="followed again")
                assert len(indexer.stream_ids("w")) == 2


async def _ranks(router: RouterService, ranks: int) -> bool:
    return len(router.planner.indexer.stream_ids("w")) == ranks
