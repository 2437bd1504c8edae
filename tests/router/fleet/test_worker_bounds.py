"""What a worker entry or a worker's `/server_info` may say: page sizes, data-parallel ranks
and ids the router cannot serve are refused where they come in, never at request time."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web

from router.service import RouterService
from tests.router.conftest import AUTH, Fleet, WorkerPassThrough, router_config
from workers.config import DEFAULT_MODEL
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

# a worker whose streams are all configured: nothing is read from it before they are built
_VLLM = {"engine": "vllm", "events": "tcp://127.0.0.1:5557", "block_size": 16}
_PROMPT = {"model": DEFAULT_MODEL, "prompt": "a prompt of a few words " * 4, "max_tokens": 2}


class Advertising(WorkerPassThrough):
    """A reference worker's HTTP API passed through, its server info saying `says` on top of
    what the worker advertises: in its `kv_events` block (`top=False`) or at its top level. An
    engine advertising settings no router can take."""

    def __init__(self, target: str, says: dict[str, Any], *, top: bool = False) -> None:
        super().__init__(target)
        self.says = says
        self.top = top

    async def _answer(
        self, request: web.Request, resp: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        if request.path not in ("/server_info", "/get_server_info"):
            return await super()._answer(request, resp)
        info = await resp.json()
        if self.top:
            return web.json_response({**info, **self.says})
        info["kv_events"] = {**info["kv_events"], **self.says}
        return web.json_response(info)


async def _admin(
    session: aiohttp.ClientSession, url: str, method: str, path: str, body: object = None
) -> tuple[int, Any]:
    async with session.request(method, url + "/admin" + path, json=body, headers=AUTH) as resp:
        return resp.status, await resp.json(content_type=None)


async def _served(session: aiohttp.ClientSession, url: str) -> list[tuple[int, str | None]]:
    """Three completions through the router: (status, the worker that served it) each."""
    served = []
    for _ in range(3):
        async with session.post(url + "/v1/completions", json=_PROMPT) as resp:
            await resp.read()
            served.append((resp.status, resp.headers.get("x-kvroute-worker")))
    return served


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        # 2**64: the namespace seed's msgpack int overflowed, every request of the model a 500
        ({"block_size": 2**64}, "block_size"),
        ({"block_size": 2**16 + 1}, "block_size"),
        # one endpoint per rank was built before anything was checked (10**9: the router's
        # memory), for a worker advertising no ranks (vLLM); ranks past port 65535 were a 400
        # only once they were all built, naming the first endpoint past it
        ({**_VLLM, "events": "tcp://127.0.0.1:5557", "dp_size": 10**6}, "dp_size"),
        ({**_VLLM, "events": "tcp://127.0.0.1:65000", "dp_size": 1000}, "dp_size"),
        ({**_VLLM, "replay": "tcp://127.0.0.1:65500", "dp_size": 64}, "dp_size"),
        # aiohttp refused the id in the x-kvroute-worker header: a 500 after the worker ran
        ({"id": "w3\r\nx-evil: injected"}, "id"),
        ({"id": "w\x01ctl"}, "id"),
        ({"id": "w\x7fdel"}, "id"),
        ({"id": "w\x85nel"}, "id"),
        ({"id": "w\ttab"}, "id"),
        # sent as raw UTF-8 in the header, which clients read as latin-1: another id
        ({"id": "\u00e9\U0001f600"}, "id"),
        # unbounded: 9,000 characters could be neither drained nor removed (the admin path
        # past aiohttp's request line), and aiohttp clients could not read its answers
        ({"id": "L" * 9000}, "id"),
        ({"id": "L" * 257}, "id"),
        # the header drops outer spaces: clients read `a`, and nothing for a blank id
        ({"id": "a "}, "id"),
        ({"id": " "}, "id"),
    ],
)
async def test_a_worker_the_router_cannot_serve_is_a_400_naming_the_field(
    fleet: Fleet, fields: dict[str, Any], named: str
) -> None:
    async with ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as spare:
        status, body = await fleet.admin(
            "POST", "/workers", {"url": spare.url, "id": "w9", **fields}
        )
    assert status == 400, body
    message = body["error"]["message"]
    assert f"workers.{named}" in message or f"$.{named}" in message, message
    assert "\n" not in message and "\r" not in message  # quoted: one log line, one header
    assert len(message) < 1000  # a long id quoted clipped
    status, listed = await fleet.admin("GET", "/workers")
    assert [w["id"] for w in listed["workers"]] == ["w0", "w1"]
    for status, _ in await _served(fleet.session, fleet.url):
        assert status == 200


async def test_the_admin_routes_take_an_id_of_any_character(fleet: Fleet) -> None:
    """`{id:.+}` left a newline out: a worker of such an id (taken before ids were checked)
    could be neither drained nor removed, the router's bare 404; the handlers answer now, and
    name the id they do not know."""
    for worker_id in ("w\nx", "w\r\nx", "a/b"):
        quoted = quote(worker_id, safe="")
        for method, path in (("DELETE", ""), ("POST", "/drain")):
            status, body = await fleet.admin(method, f"/workers/{quoted}{path}")
            assert status == 404, (worker_id, body)
            assert body["error"]["message"] == f"no worker {worker_id!r}", body


@pytest.mark.parametrize(
    ("says", "said"),
    [
        ({"block_size": 2**64}, "advertises page size 18446744073709551616, over 65536"),
        ({"block_size": 2**16 + 1}, "advertises page size 65537, over 65536"),
        # before, 5000 streams were subscribed; 10**9 would have taken the router's memory
        ({"dp_size": 5000, "endpoints": None}, "advertises dp_size 5000, over 1024"),
    ],
)
async def test_advertised_settings_past_the_bounds_are_refused_and_the_worker_served_by_load(
    caplog: pytest.LogCaptureFixture, says: dict[str, Any], said: str
) -> None:
    """A worker advertising a page size of 2**64 was registered with it: every request of its
    model was a 500 (the namespace seed overflowed), on the other workers too, and its
    subscriber failed in a loop. Now its events are not followed (no hit predicted for it:
    fail closed), it is routed by load alone, and the log says why; POST /admin/workers of it
    is a 400 saying it."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with (
        ReferenceWorker(cfg) as w0,
        ReferenceWorker(cfg) as w1,
        Advertising(w1.url, says) as absurd,
        aiohttp.ClientSession() as session,
    ):
        with caplog.at_level(logging.WARNING, logger="router.fleet"):
            config = router_config([("w0", w0.url), ("w1", absurd.url)])
            async with RouterService(config) as router:
                served = await _served(session, router.url)
                assert {status for status, _ in served} == {200}, served
                assert router.indexer.stream_configs("w1") == []
                status, body = await _admin(session, router.url, "DELETE", "/workers/w1")
                assert status == 200, body
                status, body = await _admin(
                    session, router.url, "POST", "/workers", {"url": absurd.url, "id": "w1"}
                )
                assert status == 400, body
                assert said in body["error"]["message"], body
        lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
        assert lines and lines[0].startswith("worker w1: "), caplog.text


@pytest.mark.parametrize(
    ("says", "said", "capacity", "host_capacity"),
    [
        # int(1e308 * pool) was a float infinity: OverflowError after the streams were
        # subscribed, a 500, and the stream left subscribed for good
        (
            {"enable_hierarchical_cache": True, "hicache_ratio": 1e308},
            "hicache_ratio 1e+308 makes no host tier",
            True,
            None,
        ),
        # past any float: the ratio times it raised too
        (
            {"max_total_num_tokens": 2**1030, "enable_hierarchical_cache": True},
            f"max_total_num_tokens {str(2**1030)[:40]}...",
            None,
            None,
        ),
        (
            {"max_running_requests": 2**100},
            "max_running_requests 1267650600228229401496703205376",
            True,
            0,
        ),
    ],
)
async def test_advertised_capacities_past_the_bounds_are_taken_as_unknown_and_said_once(
    fleet: Fleet,
    caplog: pytest.LogCaptureFixture,
    says: dict[str, Any],
    said: str,
    capacity: bool | None,
    host_capacity: int | None,
) -> None:
    """The worker is registered (its events followed), its capacity or host tier or
    concurrency unknown: no forecast from it, no host-tier hit predicted (fail closed)."""
    async with (
        ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as spare,
        Advertising(spare.url, says, top=True) as absurd,
    ):
        with caplog.at_level(logging.WARNING, logger="router.fleet"):
            status, body = await fleet.admin("POST", "/workers", {"url": absurd.url, "id": "w9"})
            assert status == 201, body
            assert fleet.router.indexer.stream_configs("w9") != []
            entry = fleet.router.planner.pool.find("w9")
            assert entry is not None
            assert (entry.capacity_tokens is not None) is bool(capacity)
            assert entry.host_capacity_tokens is None
            if "max_running_requests" in says:
                assert entry.max_running_requests is None
        lines = [r.getMessage() for r in caplog.records if "advertises" in r.getMessage()]
        assert len(lines) == 1 and said in lines[0], lines
        assert lines[0].startswith("worker w9: its server info advertises ")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_registration_that_fails_after_subscribing_leaves_no_stream_behind(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A defect after the worker's streams were subscribed (an advertised hicache_ratio of
    1e308 was one) made the add a 500 and left its stream subscribed for good, unlisted: the
    same server under another id was `duplicate` (its stream taken) until a restart. The
    failure is injected (no real one is left to trigger: the bounds above removed it)."""

    def broken(info: object) -> str:
        raise RuntimeError("a defect after the subscription")

    async with ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as spare:
        with monkeypatch.context() as patched, caplog.at_level(logging.CRITICAL):
            patched.setattr("router.fleet.registration.version_from_server_info", broken)
            status, body = await fleet.admin("POST", "/workers", {"url": spare.url, "id": "w9"})
        assert status == 500, body
        assert fleet.router.indexer.stream_configs("w9") == []
        assert spare.kv_events.endpoints[0] not in {
            s.endpoint for w in ("w0", "w1") for s in fleet.router.indexer.stream_configs(w)
        }
        status, body = await fleet.admin("POST", "/workers", {"url": spare.url, "id": "w10"})
        assert status == 201 and body["status"] != "duplicate", body
        assert fleet.router.indexer.stream_configs("w10") != []
