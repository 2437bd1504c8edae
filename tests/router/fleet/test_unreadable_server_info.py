"""A worker whose `/server_info` is no settings document: nested past what a decoder reads,
longer than any worker's settings, or JSON that is not an object. Its registration is refused
naming why, as for malformed JSON: a 400 to the admin add, one WARNING line from a discovery in
the background, never a 500 or a traceback. Real servers on 127.0.0.1: a small aiohttp worker
that answers such a server info, and a real router.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import msgspec
import pytest
from aiohttp import web

from router.config import HealthConfig
from router.errors import RequestError
from router.fleet.worker_settings import MAX_ANSWER_BYTES, read_server_info
from router.http.keys import SUPERVISOR
from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config, serve_app

_DEEP_ARRAYS = b"[" * 100_000 + b"]" * 100_000
_DEEP_OBJECTS = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
# longer than the cap, and valid: refused for its length alone
_LONG = b'{"pad": "' + b"x" * MAX_ANSWER_BYTES + b'"}'


@asynccontextmanager
async def _worker(
    info: bytes, *, chunked: bool = False, delay_s: float = 0.0
) -> AsyncIterator[str]:
    """A worker (its URL) that is healthy and answers `info` at both SGLang settings paths
    and `/v1/models`, after `delay_s`; `chunked`: without a Content-Length, so only the bytes
    read say its length."""

    async def answer(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay_s)
        if not chunked:
            return web.Response(body=info, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for start in range(0, len(info), 1 << 20):
            await resp.write(info[start : start + (1 << 20)])
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    for path in ("/server_info", "/get_server_info", "/v1/models"):
        app.router.add_get(path, answer)
    runner, url = await serve_app(app, shutdown_timeout=0.1)
    try:
        yield url
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("info", "chunked", "said"),
    [
        # before: a RecursionError out of msgspec, past the reader's except
        (_DEEP_ARRAYS, False, "/get_server_info: JSON nested too deep to decode"),
        (_DEEP_OBJECTS, False, "/get_server_info: JSON nested too deep to decode"),
        # before: read whole into the router's memory, whatever its length
        (_LONG, False, "/get_server_info: answer longer than 4 MiB"),
        (_LONG, True, "/get_server_info: answer longer than 4 MiB"),
        # before: "/get_server_info: HTTP 200", which named nothing wrong
        (b"null", False, "/get_server_info: HTTP 200 with null, not a JSON object"),
        (b"[1, 2]", False, "/get_server_info: HTTP 200 with an array, not a JSON object"),
        (b'"info"', False, "/get_server_info: HTTP 200 with a string, not a JSON object"),
        (b"{", False, "/get_server_info: DecodeError: "),
    ],
    ids=["arrays", "objects", "long", "long-chunked", "null", "array", "string", "malformed"],
)
async def test_a_server_info_that_is_no_settings_is_refused_naming_why(
    info: bytes, chunked: bool, said: str
) -> None:
    async with _worker(info, chunked=chunked) as url, aiohttp.ClientSession() as session:
        with pytest.raises(RequestError) as refused:
            await read_server_info(session, url, timeout_s=10.0)
    message = str(refused.value)
    assert message.startswith(f"cannot read server_info of {url}: {said}"), message
    assert "\n" not in message


async def test_a_refused_answer_is_freed_at_once_not_by_a_collection() -> None:
    """The bytes read of a refused answer go when the refusal is handled, without the
    collector: the router collects rarely (`router.commands.collector_settings`). Before, the
    refusal's traceback held the frame that held them (a cycle), and an idle router in front
    of a worker answering 4 MiB+ chunked grew to 1.3 GB in 80 s (QA)."""

    def answers_held() -> int:
        # what lists of bytes hold now, and the bytes objects the collector tracks not
        return sum(
            sum(map(len, o))
            for o in gc.get_objects()
            if type(o) is list and o and all(type(x) is bytes for x in o)
        )

    async with _worker(_LONG, chunked=True) as url, aiohttp.ClientSession() as session:
        gc.collect()
        before = answers_held()
        gc.disable()
        try:
            for _ in range(3):
                with pytest.raises(RequestError):
                    await read_server_info(session, url, timeout_s=10.0)
            held = answers_held() - before
        finally:
            gc.enable()
    assert held < len(_LONG) // 2, held


def _unexpected(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The log's ERROR records, and any record carrying a traceback."""
    return [
        f"{r.levelname} {r.getMessage()[:200]}"
        for r in caplog.records
        if r.levelno >= logging.ERROR or r.exc_info
    ]


@pytest.mark.parametrize(
    "info", [_DEEP_ARRAYS, _DEEP_OBJECTS, _LONG], ids=["arrays", "objects", "long"]
)
async def test_an_admin_add_of_such_a_worker_is_a_400_and_logs_no_traceback(
    info: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, nested arrays answered 500 InternalError, and logged an ERROR traceback."""
    config = msgspec.structs.replace(router_config([]), workers=())
    async with (
        _worker(info) as url,
        RouterService(config) as router,
        aiohttp.ClientSession() as session,
    ):
        fleet = Fleet(router, {}, session)
        with caplog.at_level(logging.INFO):
            status, answer = await fleet.admin("POST", "/workers", {"url": url, "id": "deep"})
        assert status == 400, answer
        message = answer["error"]["message"]
        assert f"cannot read server_info of {url}: /get_server_info: " in message, message
        _, listed = await fleet.admin("GET", "/workers")
        assert listed["workers"] == []
    assert _unexpected(caplog) == []


@pytest.mark.parametrize("added", [False, True], ids=["configured", "added"])
async def test_a_discovery_in_the_background_says_it_in_one_warning_line(
    added: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose server info nests too deep, discovered in the background: one of the
    config (beside the start), or an admin add that answered 202 before its discovery ended
    (the worker slower than the add waits). Its refusal is one WARNING line, the same each
    round. Before, an ERROR with a RecursionError's traceback."""
    health = HealthConfig(interval_s=0.1, timeout_s=0.2)  # the add waits 0.4 s, a path 1 s
    async with _worker(_DEEP_OBJECTS, delay_s=0.3 if added else 0.0) as url:
        workers = [] if added else [("deep", url)]
        config = msgspec.structs.replace(router_config(workers), health=health)
        with caplog.at_level(logging.INFO):
            async with RouterService(config) as router, aiohttp.ClientSession() as session:
                if added:
                    fleet = Fleet(router, {}, session)
                    status, answer = await fleet.admin(
                        "POST", "/workers", {"url": url, "id": "deep"}
                    )
                    assert status == 202, answer
                supervisor = router.app[SUPERVISOR]

                async def refused() -> bool:
                    return supervisor.refusal("deep") is not None

                await eventually(refused, timeout_s=10.0, what="the discovery's refusal")
                assert "JSON nested too deep to decode" in (supervisor.refusal("deep") or "")
                await asyncio.sleep(5 * health.interval_s)  # rounds retry it meanwhile
    said = [r for r in caplog.records if "nested too deep" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], [r.getMessage() for r in said]
    assert "\n" not in said[0].getMessage()
    assert _unexpected(caplog) == []
