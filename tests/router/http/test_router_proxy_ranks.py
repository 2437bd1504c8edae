"""How the proxy tells each engine the rank, against real in-test HTTP upstreams.

An upstream records the exact bytes and header names it received. Its "KV events" are two
silent ZMQ endpoints, one per rank (nobody publishes: the streams stay empty), so the router
knows the worker has two ranks and offers each as a candidate.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import web

from router.config import RouterConfig, WorkerConfig
from router.service import RouterService
from tests.router.conftest import router_config, serve_app

DP_HEADERS = {"x-data-parallel-rank"}


def _silent_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class RecordingUpstream:
    """A worker stand-in answering every generation route; it keeps what it received."""

    def __init__(self) -> None:
        self.status = 200
        self.seen: list[tuple[str, bytes, list[tuple[str, str]]]] = []  # path, body, headers
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _generate(self, request: web.Request) -> web.Response:
        raw_headers = [(k.decode(), v.decode()) for k, v in request.raw_headers]
        self.seen.append((request.path, await request.read(), raw_headers))
        return web.json_response({"ok": True}, status=self.status)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def rank_headers(self, index: int = -1) -> list[tuple[str, str]]:
        """The DP-rank headers of a recorded request, exactly as spelled on the wire."""
        return [(k, v) for k, v in self.seen[index][2] if k.lower() in DP_HEADERS]

    async def __aenter__(self) -> RecordingUpstream:
        app = web.Application()
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._generate)
        app.router.add_get("/health", self._health)
        self._runner, self.url = await serve_app(app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def _dp_worker(worker_id: str, url: str, engine: str) -> WorkerConfig:
    return WorkerConfig(
        url=url,
        id=worker_id,
        engine=engine,  # type: ignore[arg-type]
        events=[_silent_endpoint(), _silent_endpoint()],
        dp_size=2,
        block_size=16,
    )


def _config(workers: tuple[WorkerConfig, ...]) -> RouterConfig:
    return msgspec.structs.replace(router_config([]), workers=workers)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    raw: bytes,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str]]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with session.post(url, data=raw, headers=hdrs) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


GENERATE = b'{"text":  "caf\\u00e9 au lait",\n "sampling_params": {"max_new_tokens": 1.0e0}}\n'
COMPLETION = b'{"prompt": "caf\\u00e9", "max_tokens": 1,  "extra": [1.50, {}]}'


async def test_sglang_generate_gets_the_field_spliced_in_and_nothing_else_moved(
    session: aiohttp.ClientSession,
) -> None:
    async with RecordingUpstream() as up:
        config = _config((_dp_worker("s", up.url, "sglang"),))
        async with RouterService(config) as router:
            status, headers = await _post(session, router.url + "/generate", GENERATE)
            assert status == 200
            rank = headers["x-kvroute-dp-rank"]
            close = GENERATE.rindex(b"}")
            spliced = GENERATE[:close] + f',"routed_dp_rank":{rank}'.encode() + GENERATE[close:]
            assert up.seen[-1][1] == spliced and up.rank_headers() == []
            # the OpenAI routes: the body as sent, the rank in SGLang's header
            status, headers = await _post(session, router.url + "/v1/completions", COMPLETION)
            assert up.seen[-1][1] == COMPLETION
            assert up.rank_headers() == [("X-Data-Parallel-Rank", headers["x-kvroute-dp-rank"])]
            # a client's rank: its body goes as it is, its header is the one the engine reads
            pinned = GENERATE[:-2] + b', "data_parallel_rank": 1}\n'
            status, headers = await _post(session, router.url + "/generate", pinned)
            assert headers["x-kvroute-dp-rank"] == "1" and up.seen[-1][1] == pinned
            status, headers = await _post(
                session, router.url + "/v1/completions", COMPLETION, {"x-data-parallel-rank": "1"}
            )
            assert headers["x-kvroute-dp-rank"] == "1"
            assert up.rank_headers() == [("X-Data-Parallel-Rank", "1")]  # one, not two


async def test_vllm_is_told_by_its_header_on_every_route(session: aiohttp.ClientSession) -> None:
    async with RecordingUpstream() as up:
        config = _config((_dp_worker("v", up.url, "vllm"),))
        async with RouterService(config) as router:
            for path, raw in (("/v1/completions", COMPLETION), ("/generate", GENERATE)):
                status, headers = await _post(session, router.url + path, raw)
                assert status == 200 and up.seen[-1][1] == raw
                assert up.rank_headers() == [("X-data-parallel-rank", headers["x-kvroute-dp-rank"])]


async def test_a_failure_is_retried_on_another_worker_not_another_rank(
    session: aiohttp.ClientSession,
) -> None:
    async with RecordingUpstream() as a, RecordingUpstream() as b:
        a.status = b.status = 500
        workers = (_dp_worker("a", a.url, "sglang"), _dp_worker("b", b.url, "sglang"))
        config = _config(workers)
        async with RouterService(config) as router:
            status, headers = await _post(session, router.url + "/v1/completions", COMPLETION)
            # each worker tried once, whatever its ranks; the last answer passed through
            assert (len(a.seen), len(b.seen)) == (1, 1)
            assert status == 500 and headers["x-kvroute-worker"] in ("a", "b")
