"""Shared helpers of the router tests: real routers and reference workers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as real_datetime
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Self

import aiohttp
import pytest
from aiohttp import web

from router.config import AdminConfig, HealthConfig, ListenConfig, RouterConfig, WorkerConfig
from router.http.observe import install_log_request_id
from router.prompt import chat_template as chat_template_module
from router.service import RouterService
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Wait until `check()` is true, polling; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# health rounds as quick as `router_config`'s whose checks a stall of this process does not
# fail: on a loaded host (CI: two cores) the router and the in-process workers stop together,
# a check in flight across a stall longer than 0.5 s failed, and its worker left rotation until
# the next round (a 503, or a retry, that the test did not expect). For tests that are not
# about the health check itself
STALL_PROOF_HEALTH = HealthConfig(interval_s=0.2, timeout_s=5.0)


def router_config(workers: list[tuple[str, str]], **overrides: Any) -> RouterConfig:
    """A loopback router on a free port in front of (id, url) workers, admin token set."""
    fields: dict[str, Any] = {
        "listen": ListenConfig(host="127.0.0.1", port=0),
        "admin": AdminConfig(token=TOKEN),
        "health": HealthConfig(interval_s=0.2, timeout_s=0.5),
        "workers": tuple(WorkerConfig(url=url, id=wid) for wid, url in workers),
    }
    fields.update(overrides)
    return RouterConfig(**fields)


class Fleet:
    """Two reference workers behind one router, and an HTTP session to drive them."""

    def __init__(
        self,
        router: RouterService,
        workers: dict[str, ReferenceWorker],
        session: aiohttp.ClientSession,
    ) -> None:
        self.router = router
        self.workers = workers
        self.session = session

    @property
    def url(self) -> str:
        return self.router.url

    async def post(self, path: str, body: object, **kw: Any) -> tuple[int, dict[str, str], Any]:
        async with self.session.post(self.url + path, json=body, **kw) as resp:
            return resp.status, dict(resp.headers), await resp.json()

    async def admin(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        async with self.session.request(
            method, self.url + "/admin" + path, json=body, headers=AUTH
        ) as resp:
            return resp.status, await resp.json(content_type=None)

    async def route(self, body: object, endpoint: str | None = None) -> dict[str, Any]:
        path = "/route" if endpoint is None else f"/route?endpoint={endpoint}"
        status, plan = await self.admin("POST", path, body)
        assert status == 200, plan
        return plan  # type: ignore[no-any-return]

    async def warm(self) -> None:
        """Wait until every stream (each worker's every dp rank) delivers to the index.

        A ZMQ SUB only receives once its connection is up (the "slow joiner"), and a message
        published before that is recovered only when the next one reveals the gap. So: poke each
        rank of each worker (asking for it by `routed_dp_rank`) until its stream has applied
        something and is `synced`. Applied is not enough: a batch the join's catch-up read from
        the replay buffer sets `last_seq` while the stream is still `syncing` (its SUB not
        connected, or the replay asked once it was not answered yet), and a `syncing` stream
        predicts nothing, pending marks included. Before, a test that routed at once could
        find its worker predicted nothing right after a 200 (CI, loaded: `0 + 0 >= 256`).
        """
        pokes = iter(range(1_000_000))
        for wid, worker in self.workers.items():
            for rank in range(worker.config.dp_size):

                async def applied(wid: str = wid, url: str = worker.url, rank: int = rank) -> bool:
                    # a new prompt every time: a cache hit would publish nothing
                    poke = {
                        "input_ids": [8, next(pokes) % 250 + 3] * 8,
                        "cache_salt": "warm-up",
                        "routed_dp_rank": rank,
                        "sampling_params": {"max_new_tokens": 1},  # quick on slow workers too
                    }
                    async with self.session.post(url + "/generate", json=poke) as resp:
                        assert resp.status == 200, await resp.text()
                    _, streams = await self.admin("GET", "/streams")
                    return any(
                        s["stream"] == f"{wid}#dp{rank}"
                        and s["last_seq"] is not None
                        and s["state"] == "synced"
                        for s in streams["streams"]
                    )

                await eventually(applied, what=f"{wid} rank {rank}'s KV events to reach the index")

    async def holds(self, body: object, worker: str, tokens: int) -> bool:
        """Whether the index says `worker` (any of its dp ranks) holds `tokens` of the prompt."""
        plan = await self.route(body)
        held = [int(c["matched_tokens"]) for c in plan["candidates"] if c["worker"] == worker]
        return max(held, default=0) >= tokens


async def unfollow(router: RouterService, worker: str) -> None:
    """Have the false-hit watch leave `worker`'s KV events unfollowed, as two streaks of false
    hits close together do: through `Supervisor.mispredicted`, what `FalseHitWatch` calls. The
    first subscribes its streams anew; the second, once the first is done, leaves them
    unfollowed for twice `indexer.stale_after_s` (60 s at the default)."""
    supervisor = router.supervisor
    entry = router.planner.pool.get(worker)
    supervisor.mispredicted(worker, 320, 0)

    async def unfollowed() -> bool:
        supervisor.mispredicted(worker, 320, 0)  # ignored while the first check runs
        return entry.unfollowed_until is not None and not router.indexer.has_worker(worker)

    await eventually(unfollowed, what=f"{worker}'s KV events unfollowed")


async def serve_app(app: web.Application, **runner_options: Any) -> tuple[web.AppRunner, str]:
    """`app` served on an ephemeral port of 127.0.0.1: its runner (`cleanup()` stops it) and
    its base URL."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


class WorkerPassThrough:
    """A worker's HTTP API passed through a server of its own (`url`), for tests that stand
    between a router and a worker: `_before` may hold a request, `_answer` rewrite an answer."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _before(self, request: web.Request) -> None:
        return None

    async def _answer(
        self, request: web.Request, resp: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        body = await resp.read()
        return web.Response(body=body, status=resp.status, content_type=resp.content_type)

    async def _pass(self, request: web.Request) -> web.StreamResponse:
        await self._before(request)
        assert self._session is not None
        async with self._session.request(
            request.method, self.target + request.path_qs, data=await request.read()
        ) as resp:
            return await self._answer(request, resp)

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._pass)
        self._runner, self.url = await serve_app(app, shutdown_timeout=0.1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


class DiscoveryGate(WorkerPassThrough):
    """A worker's HTTP API passed through, its `/server_info` held until `open` is set: a
    worker whose discovery takes a while, as a loaded or distant one's does."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.open = asyncio.Event()
        self.info_asked = 0

    async def _before(self, request: web.Request) -> None:
        if request.path in ("/server_info", "/get_server_info"):
            self.info_asked += 1
            await self._held()

    async def _held(self) -> None:
        await self.open.wait()

    async def __aexit__(self, *exc: object) -> None:
        self.open.set()
        await super().__aexit__(*exc)


@contextlib.asynccontextmanager
async def one_worker_fleet(
    cfg: ReferenceConfig | None = None, **router_overrides: Any
) -> AsyncIterator[Fleet]:
    """One reference worker, `w0` (no simulated latency, 16-token pages unless `cfg` says
    otherwise), behind a kv router (`router_config` with `router_overrides`), its stream
    delivering to the index."""
    cfg = cfg or ReferenceConfig(time_scale=0.0, page_size=16)
    async with (
        ReferenceWorker(cfg) as w0,
        RouterService(router_config([("w0", w0.url)], **router_overrides)) as router,
        aiohttp.ClientSession() as session,
    ):
        fleet = Fleet(router, {"w0": w0}, session)
        await fleet.warm()
        yield fleet


async def burst_to_stale_ranks(
    session: aiohttp.ClientSession, router: RouterService, n: int = 6
) -> list[tuple[int, str]]:
    """`n` /generate requests at once, after a worker restarted with fewer dp ranks than the
    router believes in: spread by load over those ranks, the vanished one too. Their
    (status, body)."""

    async def send(i: int) -> tuple[int, str]:
        body = {"text": f"after the restart {i}"}
        async with session.post(router.url + "/generate", json=body) as resp:
            return resp.status, await resp.text()

    return list(await asyncio.gather(*(send(i) for i in range(n))))


def check_rank_refusals(answers: list[tuple[int, str]], max_retries: int) -> None:
    """With a retry left every request of `burst_to_stale_ranks` is served (the worker read
    again, tried on its ranks); with none, the ones told the vanished rank get the engine's
    refusal itself."""
    if max_retries:
        assert all(status == 200 for status, _ in answers), answers
    else:
        refused = [text for status, text in answers if status != 200]
        assert refused, answers  # the vanished rank was told to some
        assert all("out of range" in text for text in refused), answers


class HungDiscovery:
    """Healthy, and never answers `/server_info`, `/get_server_info` or `/v1/models`."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.info_asked = 0
        self.asked: dict[str, int] = {}  # per path: how often each was asked
        self.health_asked = 0
        self._release = asyncio.Event()

    async def _health(self, request: web.Request) -> web.Response:
        self.health_asked += 1
        return web.Response(text="")

    async def _hang(self, request: web.Request) -> web.Response:
        self.info_asked += 1
        self.asked[request.path] = self.asked.get(request.path, 0) + 1
        await self._release.wait()  # until the test ends: the router gives up first
        return web.json_response({})

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._hang)
        app.router.add_get("/get_server_info", self._hang)
        app.router.add_get("/v1/models", self._hang)
        self._runner, self.url = await serve_app(app, shutdown_timeout=0.1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    """Two reference workers (no simulated latency, 16-token pages) and a kv router."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        config = router_config([("w0", w0.url), ("w1", w1.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            yield fleet


@pytest.fixture
def frozen_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chat templates that print today's date see the day the chat-template goldens were made."""
    goldens = Path(__file__).resolve().parents[1] / "fixtures" / "chat-templates"
    made = next(goldens.glob("*/goldens.json"))
    golden_now = real_datetime.datetime.fromisoformat(json.loads(made.read_text("utf-8"))["now"])

    class Frozen(real_datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return golden_now

    monkeypatch.setattr(chat_template_module, "datetime", Frozen)


@pytest.fixture
def log_request_ids() -> Iterator[None]:
    """Log records carry `request_id` (as `kvroute serve` sets up), undone afterwards."""
    factory = logging.getLogRecordFactory()
    install_log_request_id()
    yield
    logging.setLogRecordFactory(factory)
