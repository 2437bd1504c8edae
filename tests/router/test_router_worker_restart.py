"""A worker process killed with SIGKILL and restarted on the same ports: no stale prediction.

The restarted process numbers its event batches from 0 again and is sent more prompts than the
old one had batches, straight (not through the router), so its seqs pass the router's last seq
while the router's SUB reconnects: the seq-aliasing case. Whatever the router saw of it, every
prediction it makes from the moment the worker died must be what the new process really has
(`cached_tokens`), never what the dead one had.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from indexer.protocol.events import EventBatch
from indexer.stats import StreamState
from router.config import HealthConfig, IndexerSection, LimitsConfig, WorkerConfig
from router.http.observe import install_log_request_id
from router.service import RouterService
from tests.indexer.scripted import ScriptedPublisher, workload
from tests.router.conftest import (
    AUTH,
    burst_to_stale_ranks,
    eventually,
    router_config,
)
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PROBE_S = 0.1

# /metrics' stream counters: (dp rank, worker) -> counter name -> value
Counters = dict[tuple[int, str], dict[str, float]]

_WORKER = """
import asyncio, sys
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

async def main():
    http, events, replay, dp_size = map(int, (sys.argv[1:] + ["1"])[:4])
    cfg = WorkerConfig(
        time_scale=0.0, page_size=16, port=http, events_port=events, replay_port=replay,
        dp_size=dp_size,
    )
    async with ReferenceWorker(cfg) as worker:
        print(worker.url, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (the worker binds them a moment later)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class WorkerProcess:
    """A reference worker in its own process on fixed ports, so it can come back on them."""

    def __init__(self, ports: list[int], dp_size: int = 1) -> None:
        self.ports = ports
        self.dp_size = dp_size
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _WORKER,
            *map(str, [*self.ports, self.dp_size]),
            stdout=asyncio.subprocess.PIPE,
            cwd=os.getcwd(),
        )
        assert self.proc.stdout is not None
        self.url = (await asyncio.wait_for(self.proc.stdout.readline(), 30)).decode().strip()
        assert self.url.startswith("http://"), self.url

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@pytest.fixture
async def worker() -> AsyncIterator[WorkerProcess]:
    proc = WorkerProcess(free_ports(3))
    try:
        await proc.start()
        yield proc
    finally:
        await proc.stop()


def prompt(i: int, kind: str) -> dict[str, Any]:
    """Prompts that share no page with each other (they differ from the first token)."""
    return {"prompt": f"{i} {kind} prompt: " + "lorem ipsum " * 12, "max_tokens": 1}


async def test_a_killed_and_restarted_worker_is_never_predicted_from_its_dead_cache(
    worker: WorkerProcess,
) -> None:
    config = router_config([("w", worker.url)], indexer=IndexerSection(probe_interval_s=PROBE_S))
    async with RouterService(config) as router, aiohttp.ClientSession() as session:

        async def admin(method: str, path: str, body: object = None) -> Any:
            async with session.request(
                method, router.url + "/admin" + path, json=body, headers=AUTH
            ) as resp:
                assert resp.status == 200
                return await resp.json()

        async def stream() -> dict[str, Any]:
            (row,) = (await admin("GET", "/streams"))["streams"]
            return row  # type: ignore[no-any-return]

        async def predicted(body: dict[str, Any]) -> int:
            plan = await admin("POST", "/route", body)
            return sum(c["matched_tokens"] for c in plan["candidates"])

        old = [prompt(i, "old") for i in range(8)]
        for body in old:
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200

        async def all_indexed() -> bool:
            return all([await predicted(b) > 0 for b in old])

        await eventually(all_indexed, what="the old prompts indexed")
        last = (await stream())["last_seq"]

        await worker.kill()

        async def unverified() -> bool:
            return (await stream())["state"] in ("unverified", "stale")

        await eventually(unverified, what="the dead worker's stream to be distrusted")
        assert [await predicted(b) for b in old] == [0] * len(old)

        await worker.start()
        new = [prompt(i, "new") for i in range(last + 3)]
        # straight to the new process, at once: its seqs pass ours while the SUB reconnects
        for body in new:
            async with session.post(worker.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200

        # from the restart on, at no moment is a dead page predicted
        async def settled() -> bool:
            assert [await predicted(b) for b in old] == [0] * len(old)
            row = await stream()
            return bool(row["state"] == "synced" and row["restarts"] >= 1)

        await eventually(settled, what="the restarted worker's stream to be rebuilt")
        for _ in range(3):  # three more probe rounds change nothing
            await asyncio.sleep(PROBE_S)
            assert [await predicted(b) for b in old] == [0] * len(old)

        async def routable() -> bool:
            workers = (await admin("GET", "/workers"))["workers"]
            return bool(workers[0]["status"] == "ready")

        await eventually(routable, what="the worker back in rotation")
        # every prediction equals what the worker really reuses, new prompts and old alike
        for body in new + old:
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                matched = int(resp.headers["x-kvroute-matched-tokens"])
                answer = await resp.json()
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert matched == cached, body["prompt"][:20]
            assert (cached > 0) == (" new " in body["prompt"])


async def test_a_health_check_coming_back_makes_the_router_prove_the_stream() -> None:
    """Health down -> up is a restart candidate: the stream is distrusted until proven."""
    up = [True]

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if up[0] else 503)

    app = web.Application()
    app.router.add_get("/health", health)
    ctx = zmq.asyncio.Context()
    try:
        async with TestServer(app, host="127.0.0.1") as server, ScriptedPublisher(ctx) as pub:
            cfg = WorkerConfig(
                url=str(server.make_url("")),
                id="w",
                events=pub.endpoint,
                replay=pub.replay_endpoint,
                block_size=4,
                topic="kv",
            )
            config = msgspec.structs.replace(
                router_config([], indexer=IndexerSection(probe_interval_s=0)), workers=(cfg,)
            )
            async with RouterService(config) as router:
                indexer = router.indexer
                # empty batches until the SUB has joined (PUB drops what comes before)
                for _ in range(100):
                    seq = await pub.publish(EventBatch(ts=0.0, events=[]))
                    if await indexer.wait_applied("w", seq, timeout_s=0.1):
                        break
                for batch in workload(seed=1, batches=5):
                    seq = await pub.publish(batch)
                    assert await indexer.wait_applied("w", seq)
                held = len(indexer.index)
                assert held > 0

                def row() -> Any:
                    return indexer.streams()[0]

                up[0] = False

                async def down() -> bool:
                    return not router.planner.pool.get("w").healthy

                await eventually(down, what="the health check to fail")
                before = row().verifications  # a slow machine may have flapped already
                up[0] = True

                async def proven() -> bool:
                    return bool(row().verifications > before and row().state == "synced")

                await eventually(proven, what="the stream to be proven after the health flap")
                # the same process: nothing was dropped
                assert row().restarts == 0 and len(indexer.index) == held
    finally:
        ctx.destroy(linger=0)


async def test_a_worker_back_with_other_settings_is_registered_anew() -> None:
    """A new process on the same ports may have other dp ranks and another KV pool: read again
    when its health comes back. Before, the first process's stayed (requests named a rank it
    no longer had: 400s; the forecast counted a pool it no longer had: false hits)."""
    first = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=2, capacity_tokens=64 * 16)
    async with ReferenceWorker(first) as w0:
        config = router_config([("w", w0.url)], health=HealthConfig(interval_s=0.1, timeout_s=0.5))
        ports = {
            "port": int(w0.url.rsplit(":", 1)[1]),
            "events_port": int(w0.kv_events.endpoints[0].rsplit(":", 1)[1]),
            "replay_port": int(w0.kv_events.replay_endpoints[0].rsplit(":", 1)[1]),
        }
        async with RouterService(config) as router:
            entry = router.planner.pool.get("w")
            await eventually(lambda: _settled(router, 2), what="two ranks registered")
            assert entry.capacity_tokens == 64 * 16
            await w0.__aexit__(None, None, None)  # the process dies...

            async def down() -> bool:
                return not entry.healthy

            await eventually(down, what="its health check to fail")
            second = msgspec.structs.replace(
                first, dp_size=1, capacity_tokens=32 * 16, **ports
            )  # ...and another comes back on its ports
            async with ReferenceWorker(second):
                await eventually(lambda: _settled(router, 1), what="one rank registered anew")
                assert router.planner.pool.get("w").capacity_tokens == 32 * 16


async def _settled(router: RouterService, ranks: int) -> bool:
    return len(router.planner.indexer.stream_ids("w")) == ranks


async def test_a_worker_restarted_between_probes_is_registered_anew() -> None:
    """A process restarted on the same ports with other dp ranks between two health probes (or
    a pod replaced behind a stable URL) never looks down to the health check; its event stream
    shows the restart, and that is when its settings are read again. Before, only a probe that
    saw it down did: a shrunk worker was sent ranks it no longer had (400s) for good, a grown
    one was predicted from rank 0's events only (false hits)."""
    proc = WorkerProcess([free_ports(1)[0], 0, 0], dp_size=2)  # it binds its runs of ports
    try:
        await proc.start()
        # no probe in the test's time: only the stream can tell
        config = router_config([("w", proc.url)], health=HealthConfig(interval_s=60, timeout_s=1))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await eventually(lambda: _settled(router, 2), what="two ranks registered")
            async with session.get(proc.url + "/server_info") as resp:
                events = (await resp.json())["kv_events"]
            proc.ports[1:] = [events["endpoint_port_base"], events["replay_endpoint_port_base"]]
            for step, ranks in enumerate((1, 2)):  # shrunk, then grown (on the ports it had)
                for i in range(2):  # batches on rank 0: its restart is provable
                    body = {"text": f"before restart {step} ({i})", "routed_dp_rank": 0}
                    async with session.post(router.url + "/generate", json=body) as resp:
                        assert resp.status == 200
                await proc.stop()
                proc.dp_size = ranks
                await proc.start()
                await eventually(partial(_settled, router, ranks), what=f"{ranks} rank(s)")
                assert router.planner.pool.get("w").healthy
                for i in range(4):  # every rank the router names is one the worker has
                    body = {"text": f"after restart {step} ({i})"}
                    async with session.post(router.url + "/generate", json=body) as resp:
                        assert resp.status == 200, await resp.text()
    finally:
        await proc.stop()


@pytest.mark.parametrize("max_retries", [2, 0])
async def test_a_worker_refusing_a_rank_it_no_longer_has_is_read_again_and_retried(
    max_retries: int,
) -> None:
    """A worker restarted with fewer ranks between two probes (here on other event ports, so
    its streams cannot tell) refuses a rank the router chose ("routed_dp_rank=1 out of range
    [0, 1)"): that 400 was the client's answer, for as long as the router kept the old ranks.
    Now its settings are read again and the request retried on the ranks it has, the worker
    not blamed; with no retry left (`max_retries = 0`) it is sent again without a rank (the
    400 used to be the answer), and the next requests go to the ranks read again."""
    first = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=2)
    w0 = ReferenceWorker(first)
    await w0.__aenter__()
    try:
        config = router_config(
            [("w", w0.url)],
            health=HealthConfig(interval_s=60, timeout_s=0.5),  # no probe sees it go
            limits=LimitsConfig(max_retries=max_retries),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await eventually(lambda: _settled(router, 2), what="two ranks registered")
            port = int(w0.url.rsplit(":", 1)[1])
            await w0.__aexit__(None, None, None)
            w0 = ReferenceWorker(msgspec.structs.replace(first, dp_size=1, port=port))
            await w0.__aenter__()

            answers = await burst_to_stale_ranks(session, router)
            assert all(status == 200 for status, _ in answers), answers
            assert await _settled(router, 1)
            entry = router.planner.pool.get("w")
            assert entry.routable(router.planner.clock())
            assert entry.breaker.failures == 0
    finally:
        await w0.__aexit__(None, None, None)


@pytest.mark.parametrize("info", ["garbage", "slow"])
async def test_a_rank_refused_while_the_server_info_is_unreadable_is_sent_without_one(
    info: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker replaced behind its URL by one with fewer ranks (other event ports: no stream
    tells) refuses a rank the router chose, and its server info cannot be read to say which
    ranks it has now (garbage, or no answer). The request used to wait for the re-read (5
    times `health.timeout_s`) and then get the engine's 400. Now it waits `health.timeout_s`
    at most and is sent to the worker again without a rank, the engine placing it. A rank the
    client named itself keeps its refusal: that one is the client's."""
    timeout_s = 1.0
    first = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=2)
    w = ReferenceWorker(first)
    await w.__aenter__()
    try:
        async with Front(w.url) as front:
            config = router_config(
                [("w", front.url)],
                health=HealthConfig(interval_s=60, timeout_s=timeout_s),
                limits=LimitsConfig(max_retries=2),
            )
            async with RouterService(config) as router, aiohttp.ClientSession() as session:
                await eventually(lambda: _settled(router, 2), what="two ranks registered")
                second = ReferenceWorker(msgspec.structs.replace(first, dp_size=1))
                await second.__aenter__()
                front.info = info
                front.target = second.url
                await w.__aexit__(None, None, None)
                w = second

                caplog.set_level(logging.DEBUG, logger="router.http.rank_refusal")
                started = time.monotonic()
                answers = await burst_to_stale_ranks(session, router)
                took = time.monotonic() - started
                assert all(status == 200 for status, _ in answers), answers
                unranked = [r for r in caplog.records if "retried without a rank" in r.message]
                assert unranked  # the stale rank was chosen for some
                # said once at WARNING, the others at DEBUG: not a line a request
                assert len(unranked) > 1  # (the burst retried several without a rank)
                assert [r.levelno for r in unranked].count(logging.WARNING) == 1
                assert took < 2.5 * timeout_s, took  # one bounded wait, not five
                assert await _settled(router, 2)  # its ranks are still unknown
                body = {"text": "rank 1, asked for", "routed_dp_rank": 1}
                async with session.post(router.url + "/generate", json=body) as resp:
                    assert resp.status == 400
                    assert "out of range" in await resp.text()
                assert router.planner.pool.get("w").breaker.failures == 0
    finally:
        await w.__aexit__(None, None, None)


async def test_a_registration_started_by_a_request_logs_without_its_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request refused a rank re-registers its worker: the re-read, the registration and
    the subscribers it started ran in that request's context, so its id was on every line
    they logged, minutes later too (`stream w#dp0: replay from 12 timed out`). Now only the
    request's own lines carry it."""
    factory = logging.getLogRecordFactory()
    install_log_request_id()
    first = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=2)
    w = ReferenceWorker(first)
    await w.__aenter__()
    try:
        config = router_config([("w", w.url)], health=HealthConfig(interval_s=60, timeout_s=1.0))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await eventually(lambda: _settled(router, 2), what="two ranks registered")
            port = int(w.url.rsplit(":", 1)[1])
            await w.__aexit__(None, None, None)
            w = ReferenceWorker(msgspec.structs.replace(first, dp_size=1, port=port))
            await w.__aenter__()
            caplog.set_level(logging.INFO)
            caplog.clear()
            answers = await burst_to_stale_ranks(session, router)
            assert all(status == 200 for status, _ in answers), answers
            assert await _settled(router, 1)
            retried = [r for r in caplog.records if "other dp ranks now" in r.message]
            assert retried and all(_request_id(r) != "-" for r in retried)  # the request's
            registered = [r for r in caplog.records if "registered anew" in r.message]
            assert registered
            said = len(caplog.records)
            await w.__aexit__(None, None, None)  # the new subscriber says its worker went

            async def went() -> bool:
                return any(
                    r.name == "indexer.stream" and "w#dp0" in r.message
                    for r in caplog.records[said:]
                )

            await eventually(went, what="the new subscriber to log")
            background = [
                r for r in caplog.records if r.name.startswith(("indexer.", "router.fleet."))
            ]
            assert [(r.message, _request_id(r)) for r in background if _request_id(r) != "-"] == []
    finally:
        logging.setLogRecordFactory(factory)
        await w.__aexit__(None, None, None)


def _request_id(record: logging.LogRecord) -> object:
    """What `install_log_request_id` put on the record."""
    return getattr(record, "request_id", None)


class Front:
    """A stable URL in front of whichever worker is current, as a Kubernetes Service is in
    front of its pod: the worker is replaced behind it without its health check ever failing."""

    def __init__(self, target: str) -> None:
        self.target = target
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._server = TestServer(app, host="127.0.0.1")
        self._session: aiohttp.ClientSession | None = None
        self.url = ""
        self.asked: list[str] = []  # the paths asked, in order
        # when set, what the server-info paths answer (200) in place of the worker's: a broken
        # one
        self.server_info: bytes | None = None
        # how the server info is answered otherwise: forwarded, "garbage" (not JSON) or "slow"
        # (no answer until the test ends)
        self.info = "forwarded"
        self._released = asyncio.Event()

    async def __aenter__(self) -> Front:
        self._session = aiohttp.ClientSession()
        await self._server.start_server()
        self.url = str(self._server.make_url("")).rstrip("/")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._released.set()
        await self._server.close()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        self.asked.append(request.path)
        info_path = request.path in ("/server_info", "/get_server_info")
        if info_path and self.server_info is not None:
            return web.Response(body=self.server_info, content_type="application/json")
        if info_path and self.info != "forwarded":
            if self.info == "slow":
                await self._released.wait()
            return web.Response(body=b"<html>not json", content_type="application/json")
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with self._session.request(
            request.method,
            self.target + request.path_qs,
            data=await request.read(),
            headers=headers,
        ) as resp:
            body = await resp.read()
            kind = resp.headers.get("Content-Type", "application/json")
            return web.Response(status=resp.status, body=body, headers={"Content-Type": kind})


async def stream_counters(session: aiohttp.ClientSession, router: RouterService) -> Counters:
    """Every `kvroute_stream_*_total` series of /metrics: (dp rank, worker) -> name -> value."""
    async with session.get(router.url + "/metrics") as resp:
        text = await resp.text()
    series: Counters = {}
    for match in re.finditer(r"^kvroute_stream_(\w+)_total\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match[2]))
        key = (int(labels["dp_rank"]), labels["worker"])
        series.setdefault(key, {})[match[1]] = float(match[3])
    return series


def assert_carried(before: dict[str, float], after: dict[str, float], restarts: int) -> None:
    """Every counter of one series kept (monotonic) and the restart counted."""
    assert after.keys() == before.keys()
    assert {k: v for k, v in after.items() if v < before[k]} == {}
    assert after["restarts"] == before["restarts"] + restarts, (before, after)


async def test_a_worker_replaced_behind_its_url_with_other_event_ports_is_registered_anew() -> None:
    """A new process behind the worker's URL publishing on other event and replay ports (a
    pod replaced behind a Service) never looks down to the health check, and its old sockets
    never answer, so no stream sees a restart: the router kept subscribing to the dead ones,
    routing it without KV affinity for good. Now a stream STALE while its worker is healthy
    has its settings read again, and the worker is registered anew on the new ports: hits are
    predicted again (never one of the old process's), and the restart is counted without the
    series' counters going back."""
    first = ReferenceConfig(time_scale=0.0, page_size=16)
    w1 = ReferenceWorker(first)
    await w1.__aenter__()
    try:
        async with Front(w1.url) as front:
            config = router_config(
                [("w", front.url)],
                health=HealthConfig(interval_s=0.1, timeout_s=0.5),
                indexer=IndexerSection(probe_interval_s=PROBE_S, stale_after_s=1.0),
            )
            async with RouterService(config) as router, aiohttp.ClientSession() as session:

                async def predicted(body: dict[str, Any]) -> int:
                    async with session.post(
                        router.url + "/admin/route", json=body, headers=AUTH
                    ) as resp:
                        plan = await resp.json()
                    return sum(c["matched_tokens"] for c in plan["candidates"])

                async def send(body: dict[str, Any]) -> tuple[int, int]:
                    async with session.post(router.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        matched = int(resp.headers["x-kvroute-matched-tokens"])
                        answer = await resp.json()
                    return matched, answer["usage"]["prompt_tokens_details"]["cached_tokens"]

                old = [prompt(i, "old") for i in range(4)]
                for body in old:
                    await send(body)

                async def indexed(bodies: list[dict[str, Any]]) -> bool:
                    return all([await predicted(b) > 0 for b in bodies])

                await eventually(partial(indexed, old), what="the old prompts indexed")
                before = (await stream_counters(session, router))[(0, "w")]

                w2 = ReferenceWorker(first)  # other ephemeral event and replay ports
                await w2.__aenter__()
                front.target = w2.url
                await w1.__aexit__(None, None, None)
                w1 = w2

                async def noticed() -> bool:
                    # (its connection's drop reaches the stream a moment after the exit: CI
                    # once read a prediction in between)
                    configs = router.indexer.stream_configs("w")
                    moved = [c.endpoint for c in configs] == w2.kv_events.endpoints
                    states = [s.state for s in router.indexer.streams() if s.worker == "w"]
                    return moved or StreamState.SYNCED not in states

                await eventually(noticed, what="the old process's death seen by its stream")

                async def anew() -> bool:
                    # never a hit of the dead process's cache meanwhile
                    assert [await predicted(b) for b in old] == [0] * len(old)
                    configs = router.indexer.stream_configs("w")  # none while subscribing
                    return [c.endpoint for c in configs] == w2.kv_events.endpoints

                await eventually(anew, what="the worker registered anew on its new ports")
                assert router.planner.pool.get("w").healthy
                new = [prompt(i, "new") for i in range(4)]
                for body in new:
                    assert await send(body) == (0, 0)
                await eventually(partial(indexed, new), what="the new process's pages predicted")
                for body in new + old:  # every prediction is what the worker reuses
                    matched, cached = await send(body)
                    assert matched == cached
                    assert (cached > 0) == (" new " in body["prompt"])
                after = (await stream_counters(session, router))[(0, "w")]
                # no stream saw the restart: the re-registration counts it
                assert_carried(before, after, restarts=1)
    finally:
        await w1.__aexit__(None, None, None)


async def test_a_worker_registered_anew_keeps_its_streams_counters() -> None:
    """A restart with other settings (page size, dp ranks) registers the worker anew: its
    streams' counters used to start at 0 again (restarts 1 -> 0 in /metrics, a counter reset
    to Prometheus, and no `increase()` for exactly that restart). Now the series of a rank it
    keeps carries on, with the restart counted; a rank it no longer has goes as a removed
    worker's series do, and a new rank's starts at 0."""
    first = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=2)
    w = ReferenceWorker(first)
    await w.__aenter__()
    try:
        config = router_config(
            [("w", w.url)],
            health=HealthConfig(interval_s=0.1, timeout_s=0.5),
            indexer=IndexerSection(probe_interval_s=PROBE_S),
        )
        ports = {
            "port": int(w.url.rsplit(":", 1)[1]),
            "events_port": int(w.kv_events.endpoints[0].rsplit(":", 1)[1]),
            "replay_port": int(w.kv_events.replay_endpoints[0].rsplit(":", 1)[1]),
        }
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            entry = router.planner.pool.get("w")
            await eventually(lambda: _settled(router, 2), what="two ranks registered")

            async def served(n: int) -> bool:
                for i in range(n):
                    body = {"text": f"{n} ranks, page {router.indexer.block_size('w')} ({i})"}
                    async with session.post(router.url + "/generate", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                return True

            for step, (ranks, page) in enumerate(((1, 64), (2, 16))):
                await served(4)

                async def applied() -> bool:
                    rows = router.indexer.streams()
                    return all(r.batches > 0 and r.state == "synced" for r in rows)

                await eventually(applied, what="batches on every rank")
                before = await stream_counters(session, router)
                await w.__aexit__(None, None, None)

                async def down() -> bool:
                    return not entry.healthy

                await eventually(down, what="its health check to fail")
                w = ReferenceWorker(
                    msgspec.structs.replace(first, dp_size=ranks, page_size=page, **ports)
                )
                await w.__aenter__()

                async def anew(ranks: int = ranks, page: int = page) -> bool:
                    sizes = {c.block_size for c in router.indexer.stream_configs("w")}
                    return await _settled(router, ranks) and sizes == {page}

                await eventually(anew, what=f"registered anew with {ranks} rank(s)")

                async def up() -> bool:
                    return entry.routable(router.planner.clock())

                await eventually(up, what="the worker back in rotation")
                after = await stream_counters(session, router)
                assert_carried(before[(0, "w")], after[(0, "w")], restarts=1)
                if step == 0:
                    assert (1, "w") not in after  # its rank 1 went: so did that series
                else:
                    assert after[(1, "w")]["restarts"] == 0  # a new rank starts at 0
    finally:
        await w.__aexit__(None, None, None)


async def test_a_stale_stream_of_a_healthy_worker_rereads_its_settings_backing_off() -> None:
    """An idle worker without probes is STALE for good with unchanged settings: its server
    info is read again at a back-off (`stale_after_s`, doubling to 8 times it), not on every
    health round, and nothing is registered anew."""
    async with ReferenceWorker(ReferenceConfig(time_scale=0.0)) as w, Front(w.url) as front:
        stale_after_s = 0.2
        config = router_config(
            [("w", front.url)],
            health=HealthConfig(interval_s=0.02, timeout_s=0.5),
            indexer=IndexerSection(probe_interval_s=0, stale_after_s=stale_after_s),
        )
        async with RouterService(config) as router:
            entry = router.planner.pool.get("w")

            async def up() -> bool:
                return entry.routable(router.planner.clock())

            await eventually(up, what="the worker registered and healthy")
            subscribed = router.indexer.stream_configs("w")
            first = front.asked.count("/server_info")
            # waits of 0.2, 0.4, 0.8, 1.6 s: three to four reads after the first, where a read
            # per round would be about 150
            await asyncio.sleep(stale_after_s + 3.2)
            reads = front.asked.count("/server_info") - first
            rounds = front.asked.count("/health")
            assert 2 <= reads <= 6 < rounds, (reads, rounds)
            assert router.indexer.stream_configs("w") == subscribed
